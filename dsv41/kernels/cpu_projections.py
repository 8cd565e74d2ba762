"""A compiled loop (numba) for an attention layer's inputs on the CPU: from the layer's input rows
to its low-rank query, its rotated query heads and its rotated KV row, with the bits of the
operators (`Attention.forward`'s first four lines).

Those lines are about forty small operators a token: the input's FP8 quantization and the wq_a
and wkv products side by side, the query's RMSNorm, its FP8 quantization and the wq_b product,
the KV row's RMSNorm, and both rotations, each with its conversions to bf16. Here each float32
operation runs as the operators run it, in the same order: the block-scaled products by
`cpu_loops.block_scaled_rows` (checked against the GEMM once per shape, `quant.loop_serves`), the
norms by `cpu_loops.rms_norm_row` (torch's sum order, checked once per length), the rotations as
torch's complex product (each product rounded, then their sum; `rotation_keeps_bits` checks it
once per table width), every cast to bf16 where the operators cast.
"""

from __future__ import annotations

import numba
import numpy as np

from dsv41.kernels.cpu_loops import (
    bf16_bits,
    bf16_values,
    block_scaled_rows,
    fp8_quantize_rows,
    rms_norm_row,
    round_to_bf16,
)


@numba.njit(cache=True, nogil=True)
def rotate_pairs(values: np.ndarray, first: int, table: np.ndarray) -> None:
    """values[first:] (float32, in place) as complex pairs (a, b) times table [pairs, 2] (c, d):
    (a c - b d, a d + b c), each product rounded, then their sum, as torch multiplies complex64."""
    for i in range(table.shape[0]):
        a, b = values[first + 2 * i], values[first + 2 * i + 1]
        c, d = table[i, 0], table[i, 1]
        values[first + 2 * i] = a * c - b * d
        values[first + 2 * i + 1] = a * d + b * c


@numba.njit(cache=True, nogil=True)
def rotate_rows(x: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
    """Rows x [R, n] float32 with their last 2 x pairs channels rotated by table row r % S of table
    [S, pairs, 2] (complex64 as pairs), into out [R, n]: `rotate_pairs` row by row, unrounded (the
    check of the complex product against torch's)."""
    pairs = table.shape[1]
    for r in range(x.shape[0]):
        out[r] = x[r]
        rotate_pairs(out[r], x.shape[1] - 2 * pairs, table[r % table.shape[0]])


@numba.njit(cache=True, nogil=True)
def rotate_bf16_rows(x: np.ndarray, table: np.ndarray, repeat: int, conjugate: bool, out: np.ndarray) -> bool:
    """`rope.rotate` of bf16 rows x [R, n] (int16 bits) into out [R, n] (bits): row r's last
    2 x pairs channels times table row (r // repeat) % S of table [S, pairs] (complex64;
    `conjugate`: its conjugate, as torch multiplies by a resolved conjugate), by `rotate_pairs`,
    rounded to bf16; the other channels as they are. False (out unfinished) at a NaN, whose bf16
    bits torch writes two ways."""
    rows, n = x.shape
    pairs = table.shape[1]
    first = n - 2 * pairs
    values = np.empty(2 * pairs, np.float32)
    turn = np.empty((pairs, 2), np.float32)
    sign = np.float32(-1.0) if conjugate else np.float32(1.0)
    for r in range(rows):
        row = table[(r // repeat) % table.shape[0]]
        for i in range(pairs):
            turn[i, 0] = row[i].real
            turn[i, 1] = sign * row[i].imag
        bf16_values(x[r, first:], values)
        rotate_pairs(values, 0, turn)
        if not bf16_bits(values, out[r, first:]):
            return False
        out[r, :first] = x[r, :first]
    return True


@numba.njit(cache=True, nogil=True)
def attention_inputs(x: np.ndarray, wa_t: np.ndarray, wa_scale_t: np.ndarray, q_weight: np.ndarray,
                     kv_weight: np.ndarray, eps: float, q_width: int, kv_width: int, wb_t: np.ndarray,
                     wb_scale_t: np.ndarray, table: np.ndarray, heads: int, qr_out: np.ndarray, q_out: np.ndarray,
                     kv_out: np.ndarray) -> bool:
    """An attention layer's inputs from its bf16 input rows, all as int16 holding bf16 bits.

    x [R, dim]; wa_t and wa_scale_t: wq_a and wkv side by side in the loop's layout
    (`quant.loop_layout`); q_weight [q_rank] and kv_weight [D]: the norms' bf16 weights (bits);
    q_width and kv_width: their lengths' sum widths (`layers.norm_sum_width`); wb_t and
    wb_scale_t: wq_b in the loop's layout; table [S, pairs, 2]: the rotation of row r is table
    row r % S. Per row: the input quantized (`quantize_rows`) and multiplied by wq_a and wkv, cast
    to bf16; the query part normed and cast (qr_out [R, q_rank]); that quantized and multiplied by
    wq_b, cast, each of its `heads` heads' last channels rotated and cast (q_out [R, heads x D]);
    the KV part normed, cast, rotated and cast (kv_out [R, D]). False (outputs unfinished) at a
    NaN or infinity a quantization or a bf16 cast cannot take as the operators do: the operators
    then run."""
    rows, dim = x.shape
    q_rank, head_dim = q_weight.shape[0], kv_weight.shape[0]
    pairs = table.shape[1]
    # every row's step before the next step of any row: each product then reads its weight once
    # for all rows (`block_scaled_rows`); a row's operations and their order are its own either way
    row, scales = np.empty((rows, dim), np.float32), np.empty((rows, dim // 32), np.float32)
    values = np.empty((rows, dim), np.float32)
    both = np.empty((rows, q_rank + head_dim), np.float32)
    low, low_values, low_scales = np.empty((rows, q_rank), np.float32), np.empty((rows, q_rank), np.float32), \
        np.empty((rows, q_rank // 32), np.float32)
    q = np.empty((rows, heads * head_dim), np.float32)
    kv = np.empty(head_dim, np.float32)
    q_scale, kv_scale = np.empty(q_rank, np.float32), np.empty(head_dim, np.float32)
    squares = np.empty(max(q_rank, head_dim), np.float32)
    bf16_values(q_weight, q_scale)
    bf16_values(kv_weight, kv_scale)
    for r in range(rows):
        bf16_values(x[r], row[r])
    if not fp8_quantize_rows(row, values, scales):
        return False
    block_scaled_rows(values, scales, wa_t, wa_scale_t, both)
    for r in range(rows):
        round_to_bf16(both[r])
        low[r] = both[r, :q_rank]
        rms_norm_row(low[r], q_scale, eps, q_width, squares[:q_rank])
        if not bf16_bits(low[r], qr_out[r]):
            return False
    if not fp8_quantize_rows(low, low_values, low_scales):
        return False
    block_scaled_rows(low_values, low_scales, wb_t, wb_scale_t, q)
    for r in range(rows):
        position = table[r % table.shape[0]]
        round_to_bf16(q[r])
        for h in range(heads):
            rotate_pairs(q[r], (h + 1) * head_dim - 2 * pairs, position)
        kv[:] = both[r, q_rank:]
        rms_norm_row(kv, kv_scale, eps, kv_width, squares[:head_dim])
        round_to_bf16(kv)
        rotate_pairs(kv, head_dim - 2 * pairs, position)
        if not bf16_bits(q[r], q_out[r]) or not bf16_bits(kv, kv_out[r]):
            return False
    return True
