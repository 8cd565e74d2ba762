"""One backbone layer: (Engram) -> mHC-wrapped CSA2 attention -> mHC-wrapped MoE."""

from __future__ import annotations

import torch
from torch import nn

from dsv41.config import LayerSpec, TextConfig
from dsv41.kernels import dispatch
from dsv41.model import mhc
from dsv41.model.attention import Attention, SharedAttention, SharedBatch
from dsv41.model.layers import RMSNorm
from dsv41.model.moe import MoE


class Block(nn.Module):
    def __init__(self, t: TextConfig, spec: LayerSpec, with_vision_bias: bool, device=None):
        super().__init__()
        self.spec = spec
        self.hc, self.iters, self.hc_eps, self.eps = t.hc_mult, t.hc_sinkhorn_iters, t.hc_eps, t.rms_norm_eps
        self.attn = Attention(t, spec, device)
        self.ffn = MoE(t.hidden_size, t.moe_intermediate_size, t.n_routed_experts, t.num_experts_per_tok,
                       t.routed_scaling_factor, t.scoring_func, t.swiglu_limit, with_vision_bias, device)
        self.attn_norm = RMSNorm(t.hidden_size, self.eps, device)
        self.ffn_norm = RMSNorm(t.hidden_size, self.eps, device)
        n_mix, width = (2 + self.hc) * self.hc, self.hc * t.hidden_size
        for sub in ("attn", "ffn"):
            self.register_parameter(f"hc_{sub}_fn", _fp32(device, n_mix, width))
            self.register_parameter(f"hc_{sub}_base", _fp32(device, n_mix))
            self.register_parameter(f"hc_{sub}_scale", _fp32(device, 3))
        self.engram = None  # set by the model for Engram layers

    def coefficients(self, x: torch.Tensor, sub: str,
                     rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        fn, scale, base = (getattr(self, f"hc_{sub}_{name}") for name in ("fn", "scale", "base"))
        return mhc.predict(x, fn, scale, base, self.hc, self.iters, self.hc_eps, self.eps, rows)

    def forward(
        self, x: torch.Tensor, pre_mix: torch.Tensor, table: torch.Tensor, shared: SharedAttention | SharedBatch,
        image_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, hc, dim]; pre_mix is the previous sub-layer's pre. Returns (stream, ffn pre)."""
        # a batch with several tokens of one sequence predicts each sequence's mixes as it would alone
        rows = shared.split_sizes
        attn_pre, attn_post, attn_comb = self.coefficients(x, "attn", rows)
        attn_out = self.attn(self.attn_norm(mhc.collapse(x, pre_mix)), table, shared)
        # one pass: residual update, the FFN's input collapse and its coefficient prediction
        x, ffn_in, ffn_pre, ffn_post, ffn_comb = dispatch.mhc_update(
            x, attn_out, attn_post, attn_comb, attn_pre, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base,
            self.iters, self.hc_eps, self.eps, rows)
        routing = {} if shared.trace is not None else None
        ffn_out = self.ffn(self.ffn_norm(ffn_in), image_mask, routing, rows)
        x = mhc.expand(ffn_out, x, ffn_post, ffn_comb)
        if shared.trace is not None:
            recorded = dict(attn_out=attn_out, ffn_out=ffn_out, out_h=x, out_pre_mix=ffn_pre, **routing,
                            hc_attn_pre=attn_pre, hc_attn_post=attn_post, hc_attn_comb=attn_comb,
                            hc_ffn_pre=ffn_pre, hc_ffn_post=ffn_post, hc_ffn_comb=ffn_comb)
            for name, value in recorded.items():
                shared.trace.put(self.spec.layer_id, name, value)
        return x, ffn_pre


def _fp32(device, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=torch.float32, device=device), requires_grad=False)
