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



FP8_BLOCK = 32  # activation values per power-of-two scale


@numba.njit(cache=True, nogil=True)
def fp8_quantize_rows(x: np.ndarray, values: np.ndarray, scales: np.ndarray) -> bool:
    """`quant.fp8_quant` of float32 rows x [rows, K], its E4M3 values written as float32 into values
    [rows, K] and its scales into scales [rows, K/32]; False (outputs unfinished) at the first NaN
    or infinity, which take the general path. Per block: amax clamped to >= 1e-4, the power-of-two
    ceiling of amax * (1/448) by adding to its bits, each value divided by it, clamped to ±448 and
    rounded to E4M3 to nearest even (below 2^-6 in steps of 2^-9)."""
    rows, k = x.shape
    floor, reciprocal, top = np.float32(1e-4), np.float32(1.0 / 448.0), np.float32(448.0)
    smallest_normal, steps = np.float32(2.0**-6), np.float32(512.0)
    cell = np.empty(1, np.float32)
    bits = cell.view(np.uint32)
    for r in range(rows):
        for start in range(0, k, FP8_BLOCK):
            amax = np.float32(0.0)
            for i in range(start, start + FP8_BLOCK):
                a = abs(x[r, i])
                if not a < np.inf:
                    return False
                amax = max(amax, a)
            cell[0] = max(amax, floor) * reciprocal
            bits[0] = (bits[0] + np.uint32(0x7FFFFF)) & np.uint32(0x7F800000)
            scale = cell[0]
            scales[r, start // FP8_BLOCK] = scale
            for i in range(start, start + FP8_BLOCK):
                v = min(max(x[r, i] / scale, -top), top)
                a = abs(v)
                if a < smallest_normal:
                    rounded = np.float32(np.rint(a * steps) / steps)
                else:
                    cell[0] = a
                    bits[0] = (bits[0] + np.uint32(0x7FFFF) + ((bits[0] >> np.uint32(20)) & np.uint32(1))) \
                        & np.uint32(0xFFF00000)
                    rounded = cell[0]
                values[r, i] = np.float32(np.copysign(rounded, v))
    return True
