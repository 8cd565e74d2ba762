"""Compiled loops (numba) for the CPU inference path, where the work is a few hundred floats and a
torch or numpy operator call per step of it costs more than the arithmetic.

Each loop does the float32 operations of its torch twin in the same order, so it returns the same
bits: numba keeps float32 arithmetic in float32 and, without `fastmath`, neither reorders nor
contracts it (no fused multiply-add). The one exception contracts on purpose: `_block_dots` sums a
32-product block as this machine's BLAS does (one fused multiply-add after another), which its
callers check once per shape before they use it. The tests compare every loop with its twin bit
for bit.
"""

from __future__ import annotations

import numba
import numpy as np
import torch


def serves(*tensors: torch.Tensor) -> bool:
    """Whether a loop may stand in for its twin on these tensors: on the CPU (the loops read and
    write them through numpy) and outside autograd (a loop records no graph)."""
    grad = torch.is_grad_enabled()  # once; `is_cpu`, not `device.type`: this runs before every quantized product
    return all(t.is_cpu and not (grad and t.requires_grad) for t in tensors)


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
_FP8_MAX = np.float32(448.0)
_SMALLEST_NORMAL, _SUBNORMAL_STEPS = np.float32(2.0**-6), np.float32(512.0)


@numba.njit(cache=True, nogil=True)
def _e4m3_rounded(v: float, cell: np.ndarray) -> float:
    """v clamped to ±448 and rounded to the nearest E4M3 value, ties to even (below 2^-6 in steps of
    2^-9), as torch's float8_e4m3fn cast rounds; the sign kept (-0 too)."""
    v = min(max(np.float32(v), -_FP8_MAX), _FP8_MAX)
    a = abs(v)
    if a < _SMALLEST_NORMAL:
        rounded = np.float32(np.rint(a * _SUBNORMAL_STEPS) / _SUBNORMAL_STEPS)
    else:
        cell[0] = a
        bits = cell.view(np.uint32)
        bits[0] = (bits[0] + np.uint32(0x7FFFF) + ((bits[0] >> np.uint32(20)) & np.uint32(1))) & np.uint32(0xFFF00000)
        rounded = cell[0]
    return np.float32(np.copysign(rounded, v))


@numba.njit(cache=True, nogil=True)
def _e4m3_code(rounded: float, cell: np.ndarray) -> int:
    """The E4M3 byte of a value `_e4m3_rounded` returned."""
    cell[0] = rounded
    bits = cell.view(np.uint32)[0]
    sign = (bits >> np.uint32(24)) & np.uint32(0x80)
    magnitude = abs(np.float32(rounded))
    if magnitude < _SMALLEST_NORMAL:
        return sign | np.uint32(np.rint(magnitude * _SUBNORMAL_STEPS))
    exponent = ((bits >> np.uint32(23)) & np.uint32(0xFF)) - np.uint32(127 - 7)
    return sign | (exponent << np.uint32(3)) | ((bits >> np.uint32(20)) & np.uint32(7))


_SMALLEST_NORMAL_BITS = np.uint32(0x3C800000)  # 2^-6, E4M3's smallest normal value, as float32 bits
_SUBNORMAL_SHIFTER = np.float32(2.0**14)  # its float32 ulp is 2^-9: adding it rounds to E4M3's subnormal steps


@numba.njit(cache=True, nogil=True)
def add_scaled_blocks(partials: np.ndarray, a_scale: np.ndarray, w_scale: np.ndarray, out: np.ndarray) -> None:
    """`quant._add_scaled_blocks` in one pass (a prompt chunk's quantized products; decode-sized
    ones take `block_scaled_rows`): out[m, j] = the sum from +0, in block order, of
    (partials[kb, m, j] * a_scale[kb, m]) * w_scale[kb, j] (partials [B, M, N], a_scale [B, M],
    w_scale [B, N], fp32), each product and sum rounded as the operators round them (no fused
    multiply-adds). The operators make two passes of products over every block's partials and
    one pass of sums per block."""
    zero = np.float32(0.0)
    for m in range(out.shape[0]):
        row = out[m]
        scale, products, column_scales = a_scale[0, m], partials[0, m], w_scale[0]
        for j in range(row.shape[0]):
            row[j] = zero + (products[j] * scale) * column_scales[j]
        for kb in range(1, partials.shape[0]):
            scale, products, column_scales = a_scale[kb, m], partials[kb, m], w_scale[kb]
            for j in range(row.shape[0]):
                row[j] = row[j] + (products[j] * scale) * column_scales[j]


@numba.njit(cache=True, nogil=True)
def fp8_quantize_rows(x: np.ndarray, values: np.ndarray, scales: np.ndarray) -> bool:
    """`quant.fp8_quant` of float32 rows x [rows, K], its E4M3 values written as float32 into values
    [rows, K] (C-contiguous) and its scales into scales [rows, K/32]; False (outputs unfinished) at
    the first NaN or infinity, which take the general path.

    A block's scale is amax (clamped to >= 1e-4) times 1/448, raised to a power of two by adding to
    its bits. Each value is divided by it (a product with its exact inverse), clamped to ±448 and
    rounded to E4M3, ties to even: below 2^-6 by adding and subtracting 2^14 (whose ulp is E4M3's
    subnormal step 2^-9), above by rounding the float32 bits to 3 mantissa bits. Each step is a
    loop over the block without branches between its elements, which the compiler vectorizes."""
    rows, k = x.shape
    cell = np.empty(1, np.float32)
    below = np.empty(FP8_BLOCK, np.float32)  # each value's rounding in the subnormal steps
    below_bits, value_bits = below.view(np.uint32), values.view(np.uint32)
    for r in range(rows):
        for start in range(0, k, FP8_BLOCK):
            amax, finite = np.float32(0.0), True
            for i in range(start, start + FP8_BLOCK):
                a = abs(x[r, i])
                finite &= a < np.inf
                amax = max(amax, a)
            if not finite:
                return False
            cell[0] = max(amax, np.float32(1e-4)) * np.float32(1.0 / 448.0)
            bits = cell.view(np.uint32)
            bits[0] = (bits[0] + np.uint32(0x7FFFFF)) & np.uint32(0x7F800000)
            scale = cell[0]
            scales[r, start // FP8_BLOCK] = scale
            inverse = np.float32(1.0) / scale  # a power of two: the product is the quotient
            for i in range(FP8_BLOCK):
                v = min(max(x[r, start + i] * inverse, -_FP8_MAX), _FP8_MAX)
                values[r, start + i] = v
                below[i] = (abs(v) + _SUBNORMAL_SHIFTER) - _SUBNORMAL_SHIFTER
            for i in range(FP8_BLOCK):
                b = value_bits[r, start + i]
                magnitude = b & np.uint32(0x7FFFFFFF)
                normal = (magnitude + np.uint32(0x7FFFF) + ((magnitude >> np.uint32(20)) & np.uint32(1))) \
                    & np.uint32(0xFFF00000)
                rounded = below_bits[i] if magnitude < _SMALLEST_NORMAL_BITS else normal
                value_bits[r, start + i] = (b & np.uint32(0x80000000)) | rounded
    return True


_FP4_MAX, _FP4_RECIPROCAL = np.float32(6.0), np.float32(1.0 / 6.0)  # E2M1's largest value, fp32(1/6)
_MXFP4_AMAX_FLOOR, _E4M3_SCALED_AMAX_FLOOR = np.float32(6 * 2.0**-126), np.float32(6 * 2.0**-9)


# E2M1's magnitudes are 0, .5, 1, 1.5, 2, 3, 4, 6: the midpoints between them, and which ties go up
# (to the even code: 0.75 -> 1, 1.75 -> 2, 3.5 -> 4), as `codecs.e2m1_encode` holds them
_E2M1_MIDPOINTS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
_E2M1_TIE_GOES_UP = np.array([False, True, False, True, False, True, False])


@numba.njit(cache=True, nogil=True)
def _e2m1_code(v: float, cell: np.ndarray) -> int:
    """The 4-bit E2M1 code of v (within ±6) as `codecs.e2m1_encode` finds it: the number of
    midpoints below |v| (its bucketize), one more on a midpoint whose tie goes up; the sign of v
    (-0 too) in bit 3."""
    a, code, last = abs(v), 0, _E2M1_MIDPOINTS.size
    while code < last and a > _E2M1_MIDPOINTS[code]:
        code += 1
    if code < last and a == _E2M1_MIDPOINTS[code] and _E2M1_TIE_GOES_UP[code]:
        code += 1
    cell[0] = v
    return code | ((cell.view(np.uint32)[0] >> np.uint32(28)) & np.uint32(8))


_E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                        np.float32)


@numba.njit(cache=True, nogil=True)
def fp4_quantize_rows(x: np.ndarray, block: int, e4m3_scale: bool, codes: np.ndarray, values: np.ndarray,
                      scales: np.ndarray) -> bool:
    """`quant.fp4_quant` of float32 rows x [rows, K] by blocks of `block`: each block's scale (E4M3 of
    max(amax, 6 * 2^-9) / 6 for the main KV, else the power of two at or above max(amax, 6 * 2^-126)
    times fp32(1/6)) into scales [rows, K/block], each element's E2M1 code of x / scale clamped to
    ±6 into codes [rows, K] and its dequantized value (code value times scale) into values
    [rows, K]. False (outputs unfinished) at the first NaN or infinity, which take the operators."""
    rows, k = x.shape
    cell = np.empty(1, np.float32)
    for r in range(rows):
        for start in range(0, k, block):
            amax = np.float32(0.0)
            for i in range(start, start + block):
                a = abs(x[r, i])
                if not a < np.inf:
                    return False
                amax = max(amax, a)
            if e4m3_scale:
                scale = _e4m3_rounded(max(amax, _E4M3_SCALED_AMAX_FLOOR) / _FP4_MAX, cell)
            else:  # the ceiling to a power of two: a carry out of the mantissa bumps the exponent
                cell[0] = max(amax, _MXFP4_AMAX_FLOOR) * _FP4_RECIPROCAL
                bits = cell.view(np.uint32)
                bits[0] = (bits[0] + np.uint32(0x7FFFFF)) & np.uint32(0x7F800000)
                scale = cell[0]
            scales[r, start // block] = scale
            for i in range(start, start + block):
                code = _e2m1_code(min(max(x[r, i] / scale, -_FP4_MAX), _FP4_MAX), cell)
                codes[r, i] = code
                values[r, i] = _E2M1_VALUES[code] * scale
    return True


@numba.njit(cache=True, nogil=True)
def fp8_pack_rows(x: np.ndarray, packed: np.ndarray) -> bool:
    """`layouts.pack_rows` of float32 rows x [rows, dim] in an FP8 format with one E8M0 scale per 32
    channels: packed [rows, dim + dim/32] gets the E4M3 codes, then the scales' exponent bytes (the
    scales are powers of two inside E8M0's range, so the byte is their exponent field). False
    (output unfinished) at the first NaN or infinity."""
    rows, k = x.shape
    values, scales = np.empty((rows, k), np.float32), np.empty((rows, k // FP8_BLOCK), np.float32)
    if not fp8_quantize_rows(x, values, scales):
        return False
    cell = np.empty(1, np.float32)
    for r in range(rows):
        for i in range(k):
            packed[r, i] = _e4m3_code(values[r, i], cell)
        for b in range(k // FP8_BLOCK):
            cell[0] = scales[r, b]
            packed[r, k + b] = (cell.view(np.uint32)[0] >> np.uint32(23)) & np.uint32(0xFF)
    return True


@numba.njit(cache=True, nogil=True)
def unpack_by_table(entries: np.ndarray, code_bytes: int, table: np.ndarray, values: np.ndarray) -> None:
    """`layouts.unpack_rows` on the CPU: entries uint8 [rows, code_bytes + scale bytes]; every code
    byte's dequantized value(s) looked up at index (its block's scale byte) << 8 | (code byte) in
    `codecs.scaled_code_table` (integers holding the values' bits) into values [rows, code_bytes]."""
    rows, scale_bytes = entries.shape[0], entries.shape[1] - code_bytes
    per_scale = code_bytes // scale_bytes
    for r in range(rows):
        entry, out = entries[r], values[r]
        for s in range(scale_bytes):
            # one block: its scale's 256 table entries as a view, read by the code bytes alone (this
            # inner loop compiles to vector gathers; indexing the whole table by scale | code did not)
            high = np.int32(entry[code_bytes + s]) << 8
            scaled = table[high : high + 256]
            first = s * per_scale
            for j in range(per_scale):
                out[first + j] = scaled[entry[first + j]]


@numba.njit(cache=True, nogil=True, fastmath={"contract"})
def _block_dots(a: np.ndarray, kb: int, w_t: np.ndarray, acc: np.ndarray) -> None:
    """acc[j] = sum over c of a[kb * 32 + c] * w_t[kb, c, j], c from 0 to 31, each product added by a
    fused multiply-add from +0 (the order MKL's fp32 GEMM kernels keep within a block this short).
    Four K positions a pass over acc: an element's four multiply-adds follow each other in K order
    (the contracted chain of one expression), and acc is loaded and stored a quarter as often."""
    n = acc.shape[0]
    for j in range(n):
        acc[j] = 0.0
    base = kb * FP8_BLOCK
    for c in range(0, FP8_BLOCK, 4):
        x0, x1, x2, x3 = a[base + c], a[base + c + 1], a[base + c + 2], a[base + c + 3]
        w0, w1, w2, w3 = w_t[kb, c], w_t[kb, c + 1], w_t[kb, c + 2], w_t[kb, c + 3]
        for j in range(n):
            acc[j] = acc[j] + x0 * w0[j] + x1 * w1[j] + x2 * w2[j] + x3 * w3[j]


@numba.njit(cache=True, nogil=True, fastmath={"contract"})
def _block_dots_of_four(a: np.ndarray, r: int, kb: int, w_t: np.ndarray, acc: np.ndarray) -> None:
    """`_block_dots` of rows r..r+3 of a into acc [4, N], each element's sum in the same order: a
    load of four weight rows feeds four rows' products (about half the time of four single rows
    at 12 to 48 rows of `small`'s experts, same bits)."""
    n = acc.shape[1]
    acc0, acc1, acc2, acc3 = acc[0], acc[1], acc[2], acc[3]
    for j in range(n):
        acc0[j] = acc1[j] = acc2[j] = acc3[j] = 0.0
    base = kb * FP8_BLOCK
    a0, a1, a2, a3 = a[r], a[r + 1], a[r + 2], a[r + 3]
    for c in range(0, FP8_BLOCK, 4):
        w0, w1, w2, w3 = w_t[kb, c], w_t[kb, c + 1], w_t[kb, c + 2], w_t[kb, c + 3]
        p0, p1, p2, p3 = a0[base + c], a0[base + c + 1], a0[base + c + 2], a0[base + c + 3]
        q0, q1, q2, q3 = a1[base + c], a1[base + c + 1], a1[base + c + 2], a1[base + c + 3]
        s0, s1, s2, s3 = a2[base + c], a2[base + c + 1], a2[base + c + 2], a2[base + c + 3]
        t0, t1, t2, t3 = a3[base + c], a3[base + c + 1], a3[base + c + 2], a3[base + c + 3]
        for j in range(n):
            v0, v1, v2, v3 = w0[j], w1[j], w2[j], w3[j]
            acc0[j] = acc0[j] + p0 * v0 + p1 * v1 + p2 * v2 + p3 * v3
            acc1[j] = acc1[j] + q0 * v0 + q1 * v1 + q2 * v2 + q3 * v3
            acc2[j] = acc2[j] + s0 * v0 + s1 * v1 + s2 * v2 + s3 * v3
            acc3[j] = acc3[j] + t0 * v0 + t1 * v1 + t2 * v2 + t3 * v3


@numba.njit(cache=True, nogil=True)
def block_scaled_rows(a: np.ndarray, a_scale: np.ndarray, w_t: np.ndarray, w_scale_t: np.ndarray,
                      out: np.ndarray) -> None:
    """`quant.block_scaled_matmul` of rows a [M, K] (FP8 values as float32, scales a_scale [M, K/32])
    by a weight in the loop's layout (`quant.loop_layout`: values w_t [K/32, 32, N], scales
    w_scale_t [K/32, N]) into out [M, N]: each block's dot products, times the row's scale, times
    the column's, the blocks added in K order from +0. A weight block is read once for all rows,
    four rows at a time (a row's sums are its own either way)."""
    rows, blocks, n = a.shape[0], w_t.shape[0], w_t.shape[2]
    acc = np.empty((4, n), np.float32)
    zero = np.float32(0.0)
    for kb in range(blocks):
        w_scale = w_scale_t[kb]
        r = 0
        while r < rows:
            if r + 4 <= rows:
                _block_dots_of_four(a, r, kb, w_t, acc)
                count = 4
            else:
                _block_dots(a[r], kb, w_t, acc[0])
                count = 1
            for i in range(count):
                dots, scale, o = acc[i], a_scale[r + i, kb], out[r + i]
                if kb == 0:
                    for j in range(n):
                        o[j] = (dots[j] * scale) * w_scale[j] + zero
                else:
                    for j in range(n):
                        o[j] += (dots[j] * scale) * w_scale[j]
            r += count


@numba.njit(cache=True, nogil=True)
def quantized_block_scaled_rows(x: np.ndarray, w_t: np.ndarray, w_scale_t: np.ndarray, out: np.ndarray) -> bool:
    """`block_scaled_rows` of `fp8_quantize_rows(x)` in one call (a quantized linear whose input no
    other linear shares); False (output unfinished) at a NaN or infinity, as there."""
    values = np.empty_like(x)
    scales = np.empty((x.shape[0], x.shape[1] // FP8_BLOCK), np.float32)
    if not fp8_quantize_rows(x, values, scales):
        return False
    block_scaled_rows(values, scales, w_t, w_scale_t, out)
    return True


@numba.njit(cache=True, nogil=True)
def runs_block_scaled_rows(a: np.ndarray, a_scale: np.ndarray, w_t: np.ndarray, w_scale_t: np.ndarray,
                           ends: np.ndarray, out: np.ndarray) -> None:
    """`block_scaled_rows` of rows a [R, K] (scales [R, K/32]) in runs, run e (rows ends[e-1] to
    ends[e]) by weight e of the stacked layouts w_t [E, K/32, 32, N] and w_scale_t [E, K/32, N],
    into out [R, N]: the routed experts of a batched MoE step in one call."""
    start = 0
    for e in range(ends.shape[0]):
        end = ends[e]
        if end > start:
            block_scaled_rows(a[start:end], a_scale[start:end], w_t[e], w_scale_t[e], out[start:end])
        start = end


@numba.njit(cache=True, nogil=True, inline="always")
def bf16_high_bits(word: np.uint32) -> np.uint32:
    """The bf16 nearest (ties to even) to the finite float32 with bits `word`, as its 16 bits."""
    return (word + np.uint32(0x7FFF) + ((word >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@numba.njit(cache=True, nogil=True)
def round_to_bf16(values: np.ndarray) -> None:
    """float32 values [n] rounded in place to the nearest bf16 (ties to even), as torch converts
    finite values and infinities: the low 16 bits zero (a NaN becomes 0x7FC00000, as torch's
    scalar conversion writes it; its vector code writes 0xFFFF)."""
    words = values.view(np.uint32)
    for i in range(words.shape[0]):
        if values[i] != values[i]:
            words[i] = np.uint32(0x7FC00000)
        else:
            words[i] = bf16_high_bits(words[i]) << np.uint32(16)



@numba.njit(cache=True, nogil=True)
def _add_vectors(acc: np.ndarray, x: np.ndarray, i: int, width: int) -> None:
    """acc[k] += x's vector 4 i + k, lane by lane, for the four interleaved accumulators k."""
    for k in range(4):
        base = (i * 4 + k) * width
        for lane in range(width):
            acc[k, lane] += x[base + lane]


@numba.njit(cache=True, nogil=True)
def _lanes_sum(x: np.ndarray, width: int) -> np.float32:
    """The float32 sum of x [n] in the order of torch's contiguous-row sum on the CPU: x read as
    `width`-lane vectors, four interleaved accumulators of them (each a cascade of up to four
    levels, a level taking 2^max(4, log2(n / 4 width) / 4) vectors before it passes its sum on),
    the accumulators added first to last, the scalar tail summed from +0, then the lanes added to
    it first to last. `rms_norm_rows` checks it against torch once per width and length."""
    n = x.shape[0]
    vectors = n // width
    rows = vectors // 4
    log2 = 0
    while (1 << log2) < rows:
        log2 += 1
    power = max(4, log2 // 4)
    step = 1 << power
    acc = np.zeros((4, 4, width), np.float32)  # [level, accumulator, lane]
    i = 0
    while i + step <= rows:
        for _ in range(step):
            _add_vectors(acc[0], x, i, width)
            i += 1
        for level in range(1, 4):
            for k in range(4):
                for lane in range(width):
                    acc[level, k, lane] += acc[level - 1, k, lane]
                    acc[level - 1, k, lane] = 0.0
            if i & ((step - 1) << (level * power)):
                break
    while i < rows:
        _add_vectors(acc[0], x, i, width)
        i += 1
    for level in range(1, 4):
        for k in range(4):
            for lane in range(width):
                acc[0, k, lane] += acc[level, k, lane]
    for v in range(rows * 4, vectors):
        for lane in range(width):
            acc[0, 0, lane] += x[v * width + lane]
    for k in range(1, 4):
        for lane in range(width):
            acc[0, 0, lane] += acc[0, k, lane]
    total = np.float32(0.0)
    for t in range(vectors * width, n):
        total += x[t]
    for lane in range(width):
        total += acc[0, 0, lane]
    return total


@numba.njit(cache=True, nogil=True)
def bf16_values(bits: np.ndarray, out: np.ndarray) -> None:
    """int16 [n] holding bf16 bits -> their float32 values in out [n]."""
    words = out.view(np.uint32)
    for c in range(bits.shape[0]):
        words[c] = np.uint32(np.uint16(bits[c])) << np.uint32(16)


@numba.njit(cache=True, nogil=True)
def bf16_bits(values: np.ndarray, out: np.ndarray) -> bool:
    """float32 values [n] (modified: rounded in place) -> their nearest bf16's bits in out [n] int16,
    as torch converts them. False (out unfinished) at a NaN, whose bits torch writes one way in its
    vector code and another in its scalar code."""
    for c in range(values.shape[0]):
        if values[c] != values[c]:
            return False
    round_to_bf16(values)
    words = values.view(np.uint32)
    for c in range(values.shape[0]):
        out[c] = np.int16(words[c] >> np.uint32(16))
    return True


@numba.njit(cache=True, nogil=True)
def rms_norm_row(values: np.ndarray, weight: np.ndarray, eps: float, width: int, squares: np.ndarray) -> None:
    """`layers.RMSNorm` of one row of float32 values [n] in place, before the cast to the row's
    dtype (weight [n] float32, the bf16 weight's values; squares: scratch [n]): the squares' sum
    (`_lanes_sum`), divided by n, plus eps, 1 / its square root, each value times it, then the
    weight times that: torch's float32 operations in order."""
    n = values.shape[0]
    for c in range(n):
        squares[c] = values[c] * values[c]
    mean = _lanes_sum(squares, width) / np.float32(n)
    inverse = np.float32(1.0) / np.sqrt(mean + np.float32(eps))
    for c in range(n):
        values[c] = weight[c] * (values[c] * inverse)


@numba.njit(cache=True, nogil=True)
def rms_norm_rows(x: np.ndarray, bf16: bool, weight: np.ndarray, eps: float, width: int, out: np.ndarray) -> bool:
    """`layers.RMSNorm` of rows x [R, n] into out [R, n]: both float32, or (`bf16`) both int16
    holding bf16 bits; weight [n] int16 holding the bf16 weight's bits (`rms_norm_row`, then the
    cast to bf16 for bf16 rows). False (out unfinished) where a bf16 row would hold a NaN
    (`bf16_bits`)."""
    rows, n = x.shape
    values, squares, scale = np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.float32)
    bf16_values(weight, scale)
    for r in range(rows):
        if bf16:
            bf16_values(x[r], values)
        else:
            values[:] = x[r]
        rms_norm_row(values, scale, eps, width, squares)
        if not bf16:
            out[r] = values
        elif not bf16_bits(values, out[r]):
            return False
    return True
