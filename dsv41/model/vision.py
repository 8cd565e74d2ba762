"""The vision tower: ViT with 2D RoPE and the aligner that turns its features into LLM rows
(SPEC.md §9). Parameter names are the official checkpoint names (`vision.*`, `aligner.*`).

Numerics are the official ones (bf16 activations): Linear layers are torch's bf16 `F.linear` with
the bias fused; RMSNorm in fp32 with an fp32 weight, rounded once; RoPE in fp32 rounded once;
attention is one fp32 softmax attention rounded once; SiLU, the gate product and the aligner's
GELU are bf16 operations, each rounded. Under `numerics.stable_numerics()` the matmuls and
transcendental functions take the shape-stable float64 path instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.config import ModelConfig
from dsv41.model import numerics
from dsv41.model.image_processor import IMAGE, IMAGE_END, IMAGE_NEW_LINE, IMAGE_START, Expanded, ImageError, ImageInput
from dsv41.model.layers import RMSNorm
from dsv41.model.trace import Trace

VISION_EPS = 1e-6


class VisionLinear(nn.Module):
    """A bf16 Linear with an optional bias, computed as one fused torch op."""

    def __init__(self, n_in: int, n_out: int, bias: bool = True, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=torch.bfloat16, device=device), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(n_out, dtype=torch.bfloat16, device=device), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not numerics.is_stable():
            return F.linear(x, self.weight, self.bias)
        y = x.double() @ self.weight.double().T
        return (y if self.bias is None else y + self.bias.double()).to(x.dtype)


class VisionNorm(RMSNorm):
    """RMSNorm with an fp32 weight (the checkpoint stores it in bf16)."""

    def __init__(self, dim: int, device=None):
        super().__init__(dim, VISION_EPS, device)
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32, device=device), requires_grad=False)


@lru_cache(8)
def rope_tables(n_h: int, n_w: int, half: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_h * n_w, 1, half] fp32: the first half/2 angles are the patch row times
    inv_freq, the rest the patch column times inv_freq, inv_freq_i = theta^(-2i/half)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half))
    rows = torch.arange(n_h).repeat_interleave(n_w)
    cols = torch.arange(n_w).repeat(n_h)
    angles = (torch.stack([rows, cols], dim=-1).float().unsqueeze(-1) * inv_freq).flatten(1)
    return angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half over the whole head: dim k pairs with dim k + head/2."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def full_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Bidirectional attention [heads, n, d] with scale d^-0.5: fp32 scores, softmax and P·V, one
    rounding (what torch's CPU SDPA computes for these inputs)."""
    if not numerics.is_stable():
        return F.scaled_dot_product_attention(q, k, v)
    scores = numerics.einsum("hqd,hkd->hqk", q.double(), k.double()) * q.size(-1) ** -0.5
    probs = torch.softmax(scores, dim=-1)
    return numerics.einsum("hqk,hkd->hqd", probs, v.double()).to(q.dtype)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, device=None):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wqkv = VisionLinear(dim, 3 * dim, device=device)
        self.wo = VisionLinear(dim, dim, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, trace: Trace | None = None,
                prefix: str = "") -> torch.Tensor:
        n = x.size(0)
        qkv = self.wqkv(x)
        q, k, v = (t.view(n, self.n_heads, self.head_dim) for t in qkv.chunk(3, dim=-1))
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = full_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1).reshape(n, -1)
        out = self.wo(o)
        if trace is not None:
            for name, value in (("wqkv", qkv), ("q_rot", q), ("k_rot", k), ("sdpa_out", o), ("attn_out", out)):
                trace.put(None, f"{prefix}{name}", value)
        return out


class VisionMLP(nn.Module):
    """SwiGLU: w1 gives gate | up; SiLU and the product are bf16 ops."""

    def __init__(self, dim: int, inter: int, device=None):
        super().__init__()
        self.w1 = VisionLinear(dim, 2 * inter, bias=False, device=device)
        self.w2 = VisionLinear(inter, dim, bias=False, device=device)

    def forward(self, x: torch.Tensor, trace: Trace | None = None, prefix: str = "") -> torch.Tensor:
        hidden = self.w1(x)
        gate, up = hidden.chunk(2, dim=-1)
        out = self.w2(numerics.elementwise(F.silu, gate) * up)
        if trace is not None:
            trace.put(None, f"{prefix}mlp_w1", hidden)
            trace.put(None, f"{prefix}mlp_out", out)
        return out


class VisionBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, inter: int, device=None):
        super().__init__()
        self.norm1 = VisionNorm(dim, device)
        self.attn = VisionAttention(dim, n_heads, device)
        self.norm2 = VisionNorm(dim, device)
        self.mlp = VisionMLP(dim, inter, device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, trace: Trace | None = None,
                prefix: str = "") -> torch.Tensor:
        h1 = self.norm1(x)
        x = x + self.attn(h1, cos, sin, trace, prefix)
        h2 = self.norm2(x)
        x = x + self.mlp(h2, trace, prefix)
        if trace is not None:
            for name, value in (("norm1", h1), ("norm2", h2), ("out", x)):
                trace.put(None, f"{prefix}{name}", value)
        return x


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int, device=None):
        super().__init__()
        self.proj = VisionLinear(3 * patch * patch, dim, device=device)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.flatten(1))


class ViT(nn.Module):
    """Full bidirectional attention over one image's patches, 2D RoPE on q and k."""

    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        v = config.vision_config
        if v.hidden_size % v.num_attention_heads or (v.hidden_size // v.num_attention_heads) % 4:
            raise ValueError(f"vision head size {v.hidden_size}/{v.num_attention_heads} must be a whole multiple "
                             "of 4 (2D RoPE rotates row and column halves)")
        self.half, self.theta = v.hidden_size // v.num_attention_heads // 2, v.rope_theta
        self.patch_embed = PatchEmbed(v.patch_size, v.hidden_size, device)
        self.blocks = nn.ModuleList(VisionBlock(v.hidden_size, v.num_attention_heads, v.intermediate_size, device)
                                    for _ in range(v.num_hidden_layers))
        self.norm = VisionNorm(v.hidden_size, device)

    def forward(self, patches: torch.Tensor, n_h: int, n_w: int, trace: Trace | None = None,
                prefix: str = "") -> torch.Tensor:
        """patches [n_h * n_w, 3, p, p] bf16 -> features [n_h * n_w, vision dim] bf16."""
        x = self.patch_embed(patches)
        cos, sin = rope_tables(n_h, n_w, self.half, self.theta)
        if trace is not None:
            trace.put(None, f"{prefix}patch_embed", x)
            trace.put(None, f"{prefix}rope_cos", cos)
            trace.put(None, f"{prefix}rope_sin", sin)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, trace, f"{prefix}block{i}.")
        features = self.norm(x)
        if trace is not None:
            trace.put(None, f"{prefix}features", features)
        return features


def unshuffle(features: torch.Tensor, n_h: int, n_w: int, r: int) -> torch.Tensor:
    """[n_h * n_w, c] features -> [ceil(n_h/r) * ceil(n_w/r), c * r * r]: the grid zero-padded at
    the bottom and right to multiples of r, each r x r cell flattened channel-major (c·r² + ky·r + kx),
    cells in row-major order."""
    c = features.size(-1)
    grid = F.pad(features.view(n_h, n_w, c).permute(2, 0, 1), (0, -n_w % r, 0, -n_h % r))
    rows, cols = grid.size(1) // r, grid.size(2) // r
    cells = grid.reshape(c, rows, r, cols, r).permute(1, 3, 0, 2, 4)
    return cells.reshape(rows * cols, c * r * r)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact (erf) GELU on the tensor's own dtype."""
    if not numerics.is_stable():
        return F.gelu(x)
    d = x.double()
    return (0.5 * d * (1 + torch.erf(d / math.sqrt(2)))).to(x.dtype)


class Aligner(nn.Module):
    """3x3 pixel-unshuffle of the feature grid, then Linear -> GELU -> Linear to the LLM width."""

    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        v = config.vision_config
        self.ratio = v.downsample_ratio
        dim = config.text_config.hidden_size
        self.w1 = VisionLinear(v.hidden_size * self.ratio**2, dim, device=device)
        self.w2 = VisionLinear(dim, dim, device=device)

    def forward(self, features: torch.Tensor, n_h: int, n_w: int, trace: Trace | None = None,
                prefix: str = "") -> torch.Tensor:
        x = unshuffle(features, n_h, n_w, self.ratio)
        hidden = self.w1(x)
        out = self.w2(gelu(hidden))
        if trace is not None:
            for name, value in (("unshuffled", x), ("w1_out", hidden), ("out", out)):
                trace.put(None, f"{prefix}{name}", value)
        return out


# --- the tower on the model, and image spans in the token stream ---------------------------------

def attach_vision(model: nn.Module, config: ModelConfig, device=None) -> None:
    """Give `model` the official vision parameters: `vision.*`, `aligner.*` and the learned span
    delimiters `image_start`, `image_end`, `image_newline` (bf16 [dim])."""
    dim = config.text_config.hidden_size
    model.vision = ViT(config, device)
    model.aligner = Aligner(config, device)
    for name in DELIMITERS.values():
        model.register_parameter(name, nn.Parameter(torch.empty(dim, dtype=torch.bfloat16, device=device),
                                                    requires_grad=False))


DELIMITERS = {IMAGE_START: "image_start", IMAGE_END: "image_end", IMAGE_NEW_LINE: "image_newline"}


@dataclass
class ImageSpan:
    """The embedding rows of one image span [n, dim] bf16, placed at positions start..start+n-1."""

    start: int
    rows: torch.Tensor

    @property
    def end(self) -> int:
        return self.start + self.rows.size(0)


def encode_image(model: nn.Module, image: ImageInput, start: int, trace: Trace | None = None,
                 prefix: str = "") -> ImageSpan:
    """One image through the ViT and the aligner: its span rows, delimiters included."""
    if getattr(model, "vision", None) is None:
        raise ImageError("this model has no vision tower (vision_config.num_hidden_layers is 0); send text only")
    plan = image.plan
    with torch.inference_mode():
        features = model.vision(image.patches, plan.n_vit_h, plan.n_vit_w, trace, f"{prefix}vit.")
        aligned = model.aligner(features, plan.n_vit_h, plan.n_vit_w, trace, f"{prefix}aligner.")
    return image_span(model, image, start, aligned)


def image_span(model: nn.Module, image: ImageInput, start: int, aligned: torch.Tensor) -> ImageSpan:
    """The span of `image` at `start` from the aligner's output rows: the delimiters around them."""
    types = image.types
    rows = torch.empty(types.numel(), aligned.size(-1), dtype=torch.bfloat16)
    for kind, name in DELIMITERS.items():
        rows[types == kind] = getattr(model, name).to(torch.bfloat16)
    rows[types == IMAGE] = aligned.to(torch.bfloat16)
    return ImageSpan(start, rows)


def encode_images(model: nn.Module, expanded: Expanded) -> list[ImageSpan]:
    return [encode_image(model, image, start) for image, start in zip(expanded.images, expanded.starts, strict=True)]


def overwrite_spans(h: torch.Tensor, spans: Sequence[ImageSpan] | None, start: int = 0) -> torch.Tensor:
    """Write the parts of `spans` that fall in positions start..start+s-1 into h [b, s, dim]."""
    for span in spans or ():
        lo, hi = max(start, span.start), min(start + h.size(1), span.end)
        if lo < hi:
            h[:, lo - start : hi - start] = span.rows[lo - span.start : hi - span.start].to(h.dtype)
    return h


def span_mask(spans: Sequence[ImageSpan], start: int, length: int, batch: int = 1) -> torch.Tensor:
    """[batch, length] True at the positions start.. that lie in an image span."""
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for span in spans:
        lo, hi = max(start, span.start), min(start + length, span.end)
        if lo < hi:
            mask[:, lo - start : hi - start] = True
    return mask
