"""CSA2 attention over whole sequences (SPEC.md §3): an SWA branch in every layer plus, in layers
with a compress ratio, Top-k entries of a layer-shared global KV chosen by an indexer.

Full layers own a global KV group (compressor + index keys) and score it; Reindex layers rescore
their group's keys with their own query, restricted to the candidate pool; Reuse layers attend with
the Top-k of their group's latest Full/Reindex layer for the same query position.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.config import LayerSpec, Mode, TextConfig
from dsv41.model.layers import Linear, RMSNorm, Storage
from dsv41.model.quant import fp8_qdq, main_kv_qdq, mxfp4_qdq
from dsv41.model.rope import rotate

ATTENTION_CHUNK = 64  # indices per online-softmax step, as the reference kernel walks them


@dataclass
class SharedAttention:
    """What source layers hand to their consumers within one forward, keyed by source layer id."""

    main_kv: dict[int, torch.Tensor] = field(default_factory=dict)  # [b, n_entries, head_dim]
    index_k: dict[int, torch.Tensor] = field(default_factory=dict)  # [b, n_entries, index_head_dim]
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # [b, s, k] entry ids, -1 = unused
    candidates: torch.Tensor | None = None  # [b, s, n_entries] bool pool of the candidate source
    trace: dict[str, torch.Tensor] | None = None  # per-layer intermediates, recorded when not None

    def record(self, layer: int, name: str, value: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace[f"layer{layer}.{name}"] = value


def window_indices(seq_len: int, window: int) -> torch.Tensor:
    """[seq, min(seq, window)] positions each query sees in the SWA branch: p-window+1..p, -1 padded."""
    end = torch.arange(seq_len).unsqueeze(1)
    idx = (end - window + 1).clamp(min=0) + torch.arange(min(seq_len, window))
    return torch.where(idx > end, -1, idx)


def visible_entries(seq_len: int, ratio: int) -> torch.Tensor:
    """[seq, 1] number of complete compressed groups query p can see: floor((p+1)/ratio)."""
    return (torch.arange(1, seq_len + 1) // ratio).unsqueeze(-1)


def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float
) -> torch.Tensor:
    """One softmax over gathered entries plus a per-head sink; K = V.

    q [b, m, h, d] bf16, kv [b, n, d] bf16, sink [h] fp32 (added to the denominator unscaled),
    idx [b, m, k] with -1 for unused slots. Online softmax over chunks of 64 indices with the
    probabilities rounded to bf16 before P·V, as the reference kernel does. Output bf16.
    """
    b, m, h, d = q.shape
    qf, kvf = q.float(), kv.float()
    out = torch.zeros(b, m, h, d, dtype=torch.float32)
    denom = torch.zeros(b, m, h, dtype=torch.float32)
    running_max = torch.full((b, m, h), -1e30, dtype=torch.float32)
    batch = torch.arange(b).view(b, 1, 1)
    for start in range(0, idx.size(-1), ATTENTION_CHUNK):
        chunk = idx[:, :, start : start + ATTENTION_CHUNK].long()
        valid = chunk != -1
        keys = kvf[batch, chunk.clamp(min=0)] * valid.unsqueeze(-1)
        logits = torch.where(valid.unsqueeze(2), torch.einsum("bmhd,bmkd->bmhk", qf, keys), -torch.inf) * scale
        previous = running_max
        running_max = torch.maximum(previous, logits.amax(dim=-1))
        rescale = torch.exp(previous - running_max)
        probs = torch.exp(logits - running_max.unsqueeze(-1))
        denom = denom * rescale + probs.sum(dim=-1)
        pv = torch.einsum("bmhk,bmkd->bmhd", probs.to(torch.bfloat16).float(), keys)
        out = out * rescale.unsqueeze(-1) + pv
    denom = denom + torch.exp(sink.float() - running_max)
    return (out / denom.unsqueeze(-1)).to(torch.bfloat16)


def select_candidate_blocks(
    scores: torch.Tensor, visible: torch.Tensor, n_blocks: int, block_size: int
) -> torch.Tensor:
    """The hierarchical pool: per query, the `n_blocks` blocks of `block_size` entries with the best
    block-max score, the block holding its newest visible entry always kept. scores [..., n] with
    invisible entries at -inf; visible broadcasts against scores' leading dims. Returns a bool mask
    shaped like scores."""
    width = scores.size(-1)
    padded = F.pad(scores, (0, -width % block_size), value=-torch.inf)
    block_scores = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)
    total = block_scores.size(-1)
    newest = (visible - 1) // block_size
    block_scores = block_scores.masked_fill(torch.arange(total) == newest, torch.inf)
    best = block_scores.topk(min(n_blocks, total), dim=-1)
    keep = torch.zeros_like(block_scores, dtype=torch.bool).scatter_(-1, best.indices, best.values > -torch.inf)
    return keep.repeat_interleave(block_size, dim=-1)[..., :width]


class Compressor(nn.Module):
    """Builds a Full layer's global KV latents (before RoPE): ratio 1 is a plain projection; ratio
    m > 1 pools each complete, non-overlapping group of m tokens with a per-channel softmax gate."""

    def __init__(self, t: TextConfig, ratio: int, device=None):
        super().__init__()
        self.ratio = ratio
        storage = Storage.FP32 if ratio > 1 else Storage.BF16
        self.wkv = Linear(t.hidden_size, t.head_dim, storage, device)
        self.wgate = Linear(t.hidden_size, t.head_dim, Storage.FP32, device) if ratio > 1 else None
        self.norm = RMSNorm(t.head_dim, t.rms_norm_eps, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [b, s, dim] -> [b, s // ratio, head_dim]; a trailing partial group emits nothing."""
        if self.ratio == 1:
            return self.norm(self.wkv(x))
        xf = x.float()
        kv, gate = self.wkv(xf), self.wgate(xf)
        complete = x.size(1) - x.size(1) % self.ratio
        kv = kv[:, :complete].unflatten(1, (-1, self.ratio))
        gate = gate[:, :complete].unflatten(1, (-1, self.ratio))
        return self.norm((kv * gate.softmax(dim=2)).sum(dim=2).to(x.dtype))


class Indexer(nn.Module):
    """Scores global entries for each query: ReLU-ed per-head dot products of MXFP4 queries and
    keys, combined by per-token head weights. Full layers also own the index keys."""

    def __init__(self, t: TextConfig, owns_keys: bool, device=None):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = t.index_n_heads, t.index_head_dim, t.index_topk
        self.wq_b = Linear(t.q_lora_rank, self.n_heads * self.head_dim, Storage.FP8, device)
        self.weights_proj = Linear(t.hidden_size, self.n_heads, Storage.BF16, device)
        self.wk = Linear(t.head_dim, self.head_dim, Storage.BF16, device) if owns_keys else None
        self.k_norm = RMSNorm(self.head_dim, t.rms_norm_eps, device) if owns_keys else None

    def keys(self, latent: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Index keys from the pre-RoPE latent, rotated at each group's first position, MXFP4."""
        return mxfp4_qdq(rotate(self.k_norm(self.wk(latent)), table))

    def scores(self, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """[b, s, n_entries] bf16 scores, every step in bf16 as the reference computes them."""
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        q = mxfp4_qdq(rotate(q, table))
        weights = self.weights_proj(x) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        dots = torch.einsum("bshd,btd->bsht", q, keys)
        return (dots.relu() * weights.unsqueeze(-1)).sum(dim=2)


class Attention(nn.Module):
    def __init__(self, t: TextConfig, spec: LayerSpec, device=None):
        super().__init__()
        self.spec = spec
        self.n_heads, self.head_dim, self.rope_dim = t.num_attention_heads, t.head_dim, t.qk_rope_head_dim
        self.window, self.n_groups, self.o_rank = t.sliding_window, t.o_groups, t.o_lora_rank
        self.candidate_blocks, self.candidate_size = t.candidate_topk_blocks, t.candidate_block_size
        eps = t.rms_norm_eps
        self.attn_sink = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32, device=device),
                                      requires_grad=False)
        self.wq_a = Linear(t.hidden_size, t.q_lora_rank, Storage.FP8, device)
        self.q_norm = RMSNorm(t.q_lora_rank, eps, device)
        self.wq_b = Linear(t.q_lora_rank, self.n_heads * self.head_dim, Storage.FP8, device)
        self.wkv = Linear(t.hidden_size, self.head_dim, Storage.FP8, device)
        self.kv_norm = RMSNorm(self.head_dim, eps, device)
        group_in = self.n_heads * self.head_dim // self.n_groups
        self.wo_a = Linear(group_in, self.n_groups * self.o_rank, Storage.BF16, device)
        self.wo_b = Linear(self.n_groups * self.o_rank, t.hidden_size, Storage.FP8, device)
        self.compressor = Compressor(t, spec.ratio, device) if spec.mode is Mode.FULL else None
        owns_index = spec.mode in (Mode.FULL, Mode.REINDEX)
        self.indexer = Indexer(t, spec.mode is Mode.FULL, device) if owns_index else None

    def forward(self, x: torch.Tensor, table: torch.Tensor, shared: SharedAttention) -> torch.Tensor:
        """x [b, s, dim] (after attn_norm) at positions 0..s-1; table = this layer's RoPE rows."""
        b, s, _ = x.shape
        qr = self.q_norm(self.wq_a(x))
        q = rotate(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), table)
        kv = fp8_qdq(rotate(self.kv_norm(self.wkv(x)), table))
        idx = window_indices(s, self.window).int().expand(b, -1, -1)
        if self.spec.ratio:
            entries, entry_idx = self._global_branch(x, qr, table, shared)
            kv = torch.cat([kv, entries], dim=1)
            idx = torch.cat([idx, torch.where(entry_idx >= 0, entry_idx + s, -1)], dim=-1)
        o = sparse_attention(q, kv, self.attn_sink, idx, self.head_dim**-0.5)
        o = rotate(o, table, inverse=True).view(b, s, self.n_groups, -1)
        o = torch.einsum("bsgd,grd->bsgr", o, self.wo_a.weight.view(self.n_groups, self.o_rank, -1))
        return self.wo_b(o.flatten(2))

    def _global_branch(self, x, qr, table, shared: SharedAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's view of its group's global KV and the entry ids each query attends to."""
        spec, s = self.spec, x.size(1)
        ratio, layer = spec.ratio, spec.layer_id
        n_entries = s // ratio
        if spec.mode is Mode.FULL:
            latent = self.compressor(x)
            entry_table = table[: n_entries * ratio : ratio]  # an entry sits at its group's first token
            shared.index_k[layer] = self.indexer.keys(latent, entry_table)
            shared.main_kv[layer] = main_kv_qdq(rotate(latent, entry_table))
            shared.record(layer, "main_kv", shared.main_kv[layer])
            shared.record(layer, "index_k", shared.index_k[layer])
        if self.indexer is not None:
            shared.topk[layer] = self._select(x, qr, table, shared)
        entry_idx = shared.topk[spec.topk_producer]
        shared.record(layer, "topk", entry_idx)
        return shared.main_kv[spec.kv_owner][:, :n_entries], entry_idx

    def _select(self, x, qr, table, shared: SharedAttention) -> torch.Tensor:
        spec, s = self.spec, x.size(1)
        n_entries = s // spec.ratio
        if n_entries == 0:
            return torch.empty(x.size(0), s, 0, dtype=torch.int32)
        keys = shared.index_k[spec.kv_owner][:, :n_entries]
        scores = self.indexer.scores(x, qr, keys, table)
        visible = visible_entries(s, spec.ratio)
        scores = scores.masked_fill(torch.arange(n_entries) >= visible, -torch.inf)
        if spec.candidate_source:
            shared.candidates = select_candidate_blocks(scores, visible, self.candidate_blocks, self.candidate_size)
            shared.record(spec.layer_id, "candidates", shared.candidates)
        elif spec.candidate_consumer:
            scores = scores.masked_fill(~shared.candidates, -torch.inf)
        shared.record(spec.layer_id, "index_score", scores)
        k = min(self.indexer.topk, n_entries)
        picked = scores.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
        return torch.where(picked < visible, picked, -1).int()
