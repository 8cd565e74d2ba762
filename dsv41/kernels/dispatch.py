"""One dispatch point per kernel: Triton on CUDA tensors, the torch twin elsewhere.

`DSV41_KERNELS=triton` forces the Triton kernels (on CPU they then need TRITON_INTERPRET=1, which
is how the tests run them); `DSV41_KERNELS=torch` forces the twins.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from dsv41.kernels import torch_ops


def _backend(t: torch.Tensor) -> ModuleType:
    choice = os.environ.get("DSV41_KERNELS", "auto")
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"DSV41_KERNELS={choice!r}: use auto, triton or torch")
    if choice == "triton" or (choice == "auto" and t.is_cuda):
        from dsv41.kernels import triton_kernels

        return triton_kernels
    return torch_ops


def pack_rows(x, fmt):
    return _backend(x).pack_rows(x, fmt)


def sparse_attention_decode(q, ring, slots, main, topk, sink, scale: float, tables: dict | None = None,
                            key: object = None):
    """`tables`: where, within one step, layers that read the same Top-k entries of the same pool
    (keyed by `key`) leave and find them dequantized; the Triton kernel dequantizes as it reads and
    takes no table."""
    backend = _backend(q)
    if backend is torch_ops:
        return torch_ops.sparse_attention_decode(q, ring, slots, main, topk, sink, scale, tables, key)
    return backend.sparse_attention_decode(q, ring, slots, main, topk, sink, scale)


def index_scores(q, weights, keys, entry_ids=None):
    return _backend(q).index_scores(q, weights, keys, entry_ids)


def mhc_update(x, f, post, comb, mix, fn, scale, base, iters: int, hc_eps: float, norm_eps: float,
               rows: list[int] | None = None):
    return _backend(x).mhc_update(x, f, post, comb, mix, fn, scale, base, iters, hc_eps, norm_eps, rows)
