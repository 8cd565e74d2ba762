"""Compiled loops (numba) for the CPU inference path, where the work is a few hundred floats and a
torch or numpy operator call per step of it costs more than the arithmetic.

Each loop does the float32 operations of its torch twin in the same order, so it returns the same
bits: numba keeps float32 arithmetic in float32 and, without `fastmath`, neither reorders nor
contracts it (no fused multiply-add). The tests compare every loop with its twin bit for bit.
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def sinkhorn_normalize(comb: np.ndarray, eps: float, iters: int) -> None:
    """`mhc._normalize` in place on float32 comb [n, hc, hc]: per matrix, every row divided by its
    sum (+ eps after the first division), then every column by its sum + eps, `iters` times; a row
    or column summed first to last, as torch and numpy sum hc values."""
    n, hc, _ = comb.shape
    eps = np.float32(eps)  # a float64 eps would widen every sum it meets
    sums = np.empty(hc, np.float32)
    for m in range(n):
        c = comb[m]
        for step in range(iters):
            for i in range(hc):
                total = c[i, 0]
                for j in range(1, hc):
                    total += c[i, j]
                sums[i] = total + eps if step else total
            for i in range(hc):
                for j in range(hc):
                    c[i, j] = c[i, j] / sums[i] + eps if not step else c[i, j] / sums[i]
            for j in range(hc):
                sums[j] = c[0, j]
            for i in range(1, hc):
                for j in range(hc):
                    sums[j] += c[i, j]
            for j in range(hc):
                sums[j] += eps
            for i in range(hc):
                for j in range(hc):
                    c[i, j] /= sums[j]

