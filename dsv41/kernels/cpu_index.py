"""A compiled loop (numba) that scores packed MXFP4 index keys where they lie: the unpack, the
per-head dot products, ReLU, head weights and head sum of `torch_ops.index_scores` in one pass,
without writing the unpacked keys out. At long contexts a decode step scores every key of its
full-range indexers (512K a layer at 1M tokens on `mini`), which the operators did at about
100 ns a key.

Why it gives the operators' bits. An E2M1 code times its power-of-two scale, times a bf16 query
value, is exact in float32, and so is every partial sum of such products when they are all
multiples of one unit and their absolute sum stays below 2^24 units: then every summation order,
the BLAS's and this loop's vectorized one alike, gives the exact dot product, rounded once to bf16
as the bf16 GEMM rounds its result. `scale_bounds` turns each query head's largest magnitude and
finest unit into limits on a key's scale bytes, and each key is checked against them before its
score is trusted; a key that fails (a spread of more than about 2^13 between its blocks' products,
or values near float32's subnormal range) is marked, and its caller scores it with the operators.
After the dot products the loop rounds as the operators do: ReLU, times the head weight rounded
to bf16, the heads summed in float32 first to last from +0, rounded to bf16. That is torch's order
for up to 4 heads at every key count; from 5 heads torch's order depends on the key count (it
reads the heads 4 at a time), so the caller's probe at first use keeps the operators there.
"""

from __future__ import annotations

import numba
import numpy as np

from dsv41.kernels.cpu_loops import bf16_high_bits

SCALE_BLOCK = 32  # channels per E8M0 scale byte
_ABSENT = -100_000  # the exponent range of values that are all zero


@numba.njit(cache=True, nogil=True)
def _exponent_range(x: np.ndarray) -> tuple[int, int]:
    """(e, f) with every |value| of float32 x below 2^e and every value a multiple of 2^f;
    (_ABSENT, -_ABSENT) when all are zero."""
    top, bottom = _ABSENT, -_ABSENT
    for word in x.view(np.uint32):
        word &= np.uint32(0x7FFFFFFF)
        if word == 0:
            continue
        exponent, mantissa = np.int64(word >> np.uint32(23)), np.int64(word & np.uint32(0x7FFFFF))
        if exponent == 0:  # subnormal: no implicit bit
            exponent = 1
        else:
            mantissa |= 1 << 23
        top = max(top, exponent - 126)  # |v| < 2^(exponent - 127 + 1)
        trailing = 0
        while not mantissa & 1:
            mantissa >>= 1
            trailing += 1
        bottom = min(bottom, exponent - 150 + trailing)  # the lowest set bit's weight
    return top, bottom


@numba.njit(cache=True, nogil=True)
def scale_bounds(q: np.ndarray, weights: np.ndarray, dim_blocks: int, bounds: np.ndarray) -> None:
    """What a key's E8M0 scale bytes (smallest s0, largest s1) must meet for `packed_index_scores`
    to trust its score, per sequence of float32 queries q [b, heads, dim] (C-contiguous) and head
    weights [b, heads]: bounds[i] = (most s1 - s0, least s0, most s1).

    With a query head's values below 2^top and multiples of 2^bottom, and a key's values (E2M1
    codes, multiples of 1/2, at most 6, times 2^(s - 127)), every product is a multiple of
    2^(bottom + s0 - 128) and the absolute sum of all of them is below
    2^(log2(blocks) + 5 + top + s1 - 124). Every partial sum is then exact in float32 when that
    sum stays below 2^24 units; the unit must be a normal float32, and so must the smallest
    nonzero head term (the unit times the head's weight)."""
    b, heads, _ = q.shape
    spread_limit = 24 - 9 - int(np.ceil(np.log2(dim_blocks)))
    for i in range(b):
        gap, least, most = spread_limit, 1, 254
        for h in range(heads):
            top, bottom = _exponent_range(q[i, h])
            if top == _ABSENT:
                continue  # a head of zeros: its dot products are exact zeros
            gap = min(gap, spread_limit - (top - bottom))
            least = max(least, 2 - bottom)
            most = min(most, 230 - top)
            weight_top, weight_bottom = _exponent_range(weights[i, h : h + 1])
            if weight_top != _ABSENT:  # 2^weight_bottom <= |w| < 2^weight_top
                least = max(least, 2 - bottom - min(weight_bottom, 0))
                most = min(most, 230 - top - max(weight_top, 0))
        bounds[i, 0], bounds[i, 1], bounds[i, 2] = gap, least, most


TILE = 64  # keys unpacked per pass, then scored together (16 to 128 measured the same)


@numba.njit(cache=True, nogil=True)
def _round_to_bf16(words: np.ndarray, count: int) -> None:
    """float32 bits words[:count] rounded to the nearest bf16 (ties to even) in place, low half zero."""
    for i in range(count):
        words[i] = bf16_high_bits(words[i]) << np.uint32(16)


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _tile_dots(q: np.ndarray, values: np.ndarray, count: int, dots: np.ndarray) -> None:
    """dots[h, t] = sum over c of q[h, c] * values[t, c] for the first `count` keys, in any order
    the compiler likes (vectors): only trusted where every order gives the exact sum. Four heads
    over two keys at a time, so each load of a key's or a query's values feeds several products
    (a tile of `mini`'s 4 heads: 18 against 29 ns a key one head and key at a time)."""
    heads, dim = q.shape
    grouped = heads - heads % 4
    for h in range(0, grouped, 4):
        q0, q1, q2, q3 = q[h], q[h + 1], q[h + 2], q[h + 3]
        for t in range(0, count - 1, 2):
            v, u = values[t], values[t + 1]
            a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
            for c in range(dim):
                x, y = v[c], u[c]
                a0 += q0[c] * x
                a1 += q1[c] * x
                a2 += q2[c] * x
                a3 += q3[c] * x
                b0 += q0[c] * y
                b1 += q1[c] * y
                b2 += q2[c] * y
                b3 += q3[c] * y
            dots[h, t], dots[h + 1, t], dots[h + 2, t], dots[h + 3, t] = a0, a1, a2, a3
            dots[h, t + 1], dots[h + 1, t + 1], dots[h + 2, t + 1], dots[h + 3, t + 1] = b0, b1, b2, b3
        if count % 2:
            _head_dots(q, values, h, h + 4, count - 1, count, dots)
    _head_dots(q, values, grouped, heads, 0, count, dots)


@numba.njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _head_dots(q: np.ndarray, values: np.ndarray, first_head: int, last_head: int, first: int, last: int,
               dots: np.ndarray) -> None:
    """`_tile_dots` of heads first_head..last_head-1 and keys first..last-1, one by one."""
    for t in range(first, last):
        for h in range(first_head, last_head):
            total = np.float32(0.0)
            for c in range(q.shape[1]):
                total += q[h, c] * values[t, c]
            dots[h, t] = total


@numba.njit(cache=True, nogil=True)
def _tile_scores(dots: np.ndarray, dot_words: np.ndarray, weights: np.ndarray, count: int, total: np.ndarray) -> None:
    """The operators' steps after the dot products, each a loop across the tile's keys (vector
    code): each dot rounded to bf16, ReLU, times its head weight rounded to bf16, the heads summed
    first to last from +0 into total [TILE] float32, whose bits the caller checks and rounds.
    dots [heads, TILE] with dot_words its uint32 view."""
    heads = dots.shape[0]
    zero = np.float32(0.0)
    for t in range(count):
        total[t] = zero
    for h in range(heads):
        row, words, weight = dots[h], dot_words[h], weights[h]
        _round_to_bf16(words, count)
        for t in range(count):
            row[t] = max(row[t], zero) * weight
        _round_to_bf16(words, count)
        for t in range(count):
            total[t] += row[t]


@numba.njit(cache=True, nogil=True)
def packed_index_scores(q: np.ndarray, weights: np.ndarray, bounds: np.ndarray, keys: np.ndarray, ids: np.ndarray,
                        pairs: np.ndarray, out: np.ndarray, unsure: np.ndarray, first: int, last: int) -> None:
    """Scores of keys ids[:, first:last]: q [b, heads, dim] float32 (bf16 values), weights [b, heads]
    float32 (bf16 values), their `scale_bounds`,
    keys uint8 [b or 1, rows, dim/2 + dim/32] (E2M1 codes two a byte, even channel low, then E8M0
    scale bytes), ids [b, n] rows (-1 reads row 0, as the operators do; callers mask it), pairs:
    `codecs.scaled_code_table` for these entries in float32 (a code byte's two values under a scale
    byte, as one int64). Writes bf16 bits into out [b, n] (uint16) and 1 into unsure [b, n] for a
    key whose exactness could not be shown (its out is then unset)."""
    b, heads, dim = q.shape
    code_bytes, blocks = dim // 2, dim // SCALE_BLOCK
    per_scale = code_bytes // blocks
    values = np.empty((TILE, dim), np.float32)
    pair_values = values.view(np.int64)  # [TILE, dim / 2]: a code byte's two values at once
    dots = np.empty((heads, TILE), np.float32)
    dot_words = dots.view(np.uint32)
    total = np.empty(TILE, np.float32)
    total_words = total.view(np.uint32)
    smallest = np.empty(TILE, np.int64)
    largest = np.empty(TILE, np.int64)
    for i in range(b):
        pool = keys[min(i, keys.shape[0] - 1)]
        for start in range(first, last, TILE):
            count = min(TILE, last - start)
            for t in range(count):
                entry, unpacked = pool[max(ids[i, start + t], 0)], pair_values[t]
                low, high = 255, 0
                for j in range(blocks):
                    scale = np.int64(entry[code_bytes + j])
                    low, high = min(low, scale), max(high, scale)
                    # the scale's 256 table entries as a view, read by the code bytes alone (vector
                    # gathers, as in `cpu_loops.unpack_by_table`)
                    scaled = pairs[scale << 8 : (scale << 8) + 256]
                    first_byte = j * per_scale
                    for p in range(per_scale):
                        unpacked[first_byte + p] = scaled[entry[first_byte + p]]
                smallest[t], largest[t] = low, high
            _tile_dots(q[i], values, count, dots)
            _tile_scores(dots, dot_words, weights[i], count, total)
            gap, least, most = bounds[i, 0], bounds[i, 1], bounds[i, 2]
            for t in range(count):
                magnitude = total_words[t] & np.uint32(0x7FFFFFFF)
                if (largest[t] - smallest[t] <= gap and smallest[t] >= least and largest[t] <= most
                        and (magnitude == 0 or magnitude >= np.uint32(0x00800000))):  # not subnormal
                    out[i, start + t] = np.uint16(bf16_high_bits(total_words[t]))
                else:
                    unsure[i, start + t] = 1


@numba.njit(cache=True, nogil=True)
def weighted_head_sums(dots: np.ndarray, weights: np.ndarray, out: np.ndarray, first: int, last: int) -> bool:
    """Index scores from bf16 dot products a GEMM already made (a prompt chunk's or a verification's
    queries against unpacked keys): for rows first..last-1 of dots uint16 [rows, heads, t] (bf16
    bits) and weights float32 [rows, heads] (bf16 values), out uint16 [rows, t] gets the bf16 bits
    of the operators' ReLU, times the head weight rounded to bf16, the heads summed in float32
    first to last from +0, rounded to bf16 (`_tile_scores`' steps, one pass over the products
    where the operators make five over tensors of every query's heads and keys: 268 MB for 512
    queries of 4 heads over 64K keys). False, with out unfinished, where a product or a head
    weight is not finite: the operators then give their NaNs."""
    heads, t = dots.shape[1], dots.shape[2]
    total = np.empty(t, np.float32)
    total_words = total.view(np.uint32)
    term = np.empty(t, np.float32)
    term_words = term.view(np.uint32)
    zero = np.float32(0.0)
    for r in range(first, last):
        total[:] = zero
        for h in range(heads):
            weight = weights[r, h]
            if not np.isfinite(weight):
                return False
            row = dots[r, h]
            non_finite = False
            for j in range(t):
                bits = np.uint32(row[j])
                non_finite |= (bits & np.uint32(0x7F80)) == np.uint32(0x7F80)
                term_words[j] = bits << np.uint32(16)
            if non_finite:
                return False
            for j in range(t):
                term[j] = max(term[j], zero) * weight
            _round_to_bf16(term_words, t)
            for j in range(t):
                total[j] += term[j]
        for j in range(t):
            out[r, j] = np.uint16(bf16_high_bits(total_words[j]))
    return True
