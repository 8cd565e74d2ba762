"""Torch twins of the Triton kernels: the same signatures and the reference's op sequence, so on
CPU they reproduce the fake-quantized reference bit for bit."""

from __future__ import annotations

import torch

from dsv41.kernels.layouts import index_k_format, main_kv_format, pack_rows, swa_format, unpack_rows
from dsv41.model.attention import sparse_attention

__all__ = ["index_scores", "pack_rows", "sparse_attention_decode"]


def _gather(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return rows[torch.arange(ids.size(0), device=ids.device).unsqueeze(-1), ids.long().clamp(min=0)]


def sparse_attention_decode(q, ring, slots, main, topk, sink, scale: float) -> torch.Tensor:
    """q [b, h, d] bf16; ring [b, W, swa bytes] with slots [b, W] (-1 unused); main [b, n, main bytes]
    with topk [b, k] entry ids (-1 unused); sink [h] fp32 -> out [b, h, d] bf16."""
    d = q.size(-1)
    window = unpack_rows(ring, swa_format(d))
    entries = unpack_rows(_gather(main, topk), main_kv_format(d))
    kv = torch.cat([window, entries], dim=1)
    local = torch.arange(topk.size(1), device=q.device) + ring.size(1)
    idx = torch.cat([slots.int(), torch.where(topk >= 0, local, -1).int()], dim=1)
    return sparse_attention(q.unsqueeze(1), kv, sink, idx.unsqueeze(1), scale).squeeze(1)


def index_scores(q, weights, keys, entry_ids=None) -> torch.Tensor:
    """q [b, hi, di] bf16 (MXFP4 values), weights [b, hi] bf16, keys [b, n_keys, 68-byte entries];
    bf16 scores [b, n] for every key, or for entry_ids [b, n] (a candidate pool)."""
    rows = keys if entry_ids is None else _gather(keys, entry_ids)
    k = unpack_rows(rows, index_k_format(q.size(-1)))
    dots = torch.einsum("bhd,btd->bht", q, k)
    return (dots.relu() * weights.unsqueeze(-1)).sum(dim=1)
