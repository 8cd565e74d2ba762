"""A compiled loop (numba) for the opt-in fast prefill attention (`DSV41_FAST_ATTENTION=1`,
`torch_ops._in_place_attention`): each query's weighted sum of the keys its index table names,
read from the key table where they lie.

The reference gathers every query's keys into a copy (640 rows of 512 fp32 channels on `mini`,
1.3 MB a query) for its P.V products too, GEMMs of a query's 4 heads that wait on memory. The loop
adds weight x row for one index after another, each output channel its own sum in table order (no
reassociation; the products differ from the reference's chunked, rescaled sums only in order).
Each query's result is its own, so the queries are split over threads without changing any bit.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numba
import numpy as np
import torch


@numba.njit(cache=True, nogil=True)
def weighted_rows(weights: np.ndarray, kv: np.ndarray, idx: np.ndarray, out: np.ndarray, first: int,
                  last: int) -> None:
    """out[i, h] = sum over j of weights[i, h, j] * kv[idx[i, j]] for queries first..last-1, the
    indices in table order (weights [m, h, k], unused slots skipped: their weight is 0); fp32."""
    heads, dim = weights.shape[1], kv.shape[1]
    for i in range(first, last):
        for h in range(heads):
            for c in range(dim):
                out[i, h, c] = 0.0
        for j in range(idx.shape[1]):
            row = idx[i, j]
            if row < 0:
                continue
            key = kv[row]
            for h in range(heads):
                weight = weights[i, h, j]
                if weight != 0.0:
                    acc = out[i, h]
                    for c in range(dim):
                        acc[c] += weight * key[c]


_pools: dict[int, ThreadPoolExecutor] = {}
_pools_lock = threading.Lock()
os.register_at_fork(after_in_child=_pools.clear)  # a forked child has none of the parent's threads


def over_queries(loop, rows: int, *arrays: np.ndarray) -> list:
    """Run `loop(*arrays, first, last)` over rows 0..rows-1, split into one slice per torch thread
    (the loops release the GIL; torch's own threads are idle meanwhile); the slices' results."""
    threads = min(torch.get_num_threads(), rows)
    if threads <= 1:
        return [loop(*arrays, 0, rows)]
    with _pools_lock:
        pool = _pools.get(threads) or _pools.setdefault(
            threads, ThreadPoolExecutor(threads, thread_name_prefix="dsv41-attention"))
    bounds = [rows * t // threads for t in range(threads + 1)]
    return [done.result() for done in [pool.submit(loop, *arrays, bounds[t], bounds[t + 1]) for t in range(threads)]]
