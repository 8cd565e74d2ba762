"""One-row bf16 products as oneDNN's CPU matmul sums them, many rows in one compiled loop (numba).

Why: a batched step multiplies each sequence's attention output by the bf16 projection `wo_a` in
a GEMM of its own, as alone (a GEMM's sums can change with its row count), and torch spends about
35 µs around each such call, of which oneDNN computes about 5: 96 calls, 3.8 ms of a batch-8
`small` step, and 128 µs a layer of a `mini` step.

The order. A product of two bf16 values is exact in float32, so a row's result depends only on
the order in which its K products are added. oneDNN adds them in a fixed pattern that its kernel,
picked by shape, keeps. Measured with order-revealing values (2^20, -2^20 and 2^-10 among zeros,
whose sum is 2^-10 or 0 by the order they are added in), the AMX kernel of a [g, 1, K] x [g, K, N]
bmm with N >= 64 sums each block of 32 products in two interleaved accumulators (the even and odd
places, each from +0), adds the two, and adds each block's sum to the row's total from +0. The
kernels it picks at N = 4 and N = 32 sum in other orders, outside this family. Where the CPU
has AVX-512 bf16 dot products but no AMX (a Zen 4 EPYC), the kernel adds the products one by one
into one accumulator a column, each pair of places odd before even (the dot-product instruction's
order), over blocks of 512 products, each block's sum added to the row's total from +0. Where the
CPU has AVX-512 without bf16 (an Ice Lake-class Xeon), oneDNN's bmm emulates those dot products:
16 vector lanes, lane i taking places 2i and 2i + 1 of every 32 (odd first), each from +0, then
the lanes added as a tree (lane i + lane i + 8; then pairs i, i + 1; then i + 2; then i + 4).
`products` computes the family (`lanes` accumulators over blocks of `block` products, a pair of
places per accumulator or one, pairs in place order or odd first, the accumulators added in turn
or as a tree); `find_order` tells which member, if any, this machine's kernel is at a shape.

Exactness. A bf16 value of at least 2^e is a multiple of 2^(e - 7), so where a row's smallest
nonzero |value| is at least 2^a and the weight's at least 2^b, every product and partial sum is a
multiple of 2^(a + b - 14): with a + b >= -112 a nonzero one is a normal float32, and the flush of
denormals to zero that both kernels apply never applies. The weight's nonzero magnitudes must lie
in [2^-56, 2^56) (`row_floor` refuses it otherwise) and the row's below 2^56, so no sum of up to
2^15 products reaches float32's largest; the row's floor is 2^(-112 - b) for the weight's smallest
b, and never below 2^-126 (a bf16 denormal input would be flushed). `products` refuses a row
outside its range; the GEMM then computes it.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from dsv41.kernels.cpu_loops import bf16_high_bits, bf16_values
from dsv41.model import numerics

SMALLEST, LARGEST = 2.0**-56, 2.0**56  # every nonzero weight magnitude within [SMALLEST, LARGEST)
SMALLEST_NORMAL = 2.0**-126
# the largest weight (values) the loop takes: `mini`'s `wo_a` (2 x 128 x 1,024), whose GEMM costs about
# what torch's call around it does; the official `wo_a` (8 x 1,024 x 4,096) is 128 times that, a
# GEMM of about a millisecond whose work outweighs the call
MOST_WEIGHTS = 1 << 18
# (lanes, block, odd_first, paired, tree) tried in turn (`products` says what each means); a block as
# long as K is one pass over it
CANDIDATE_ORDERS = tuple((lanes, block, odd_first, False, ()) for lanes, block, odd_first in (
    (2, 32, False), (1, 512, True), (1, 0, True), (4, 0, False), (1, 0, False), (2, 0, False), (8, 0, False),
    (1, 32, False), (4, 32, False), (8, 32, False), (2, 64, False), (4, 64, False))) + (
    (16, 0, True, True, (8, 1, 2, 4)),)  # AVX-512 without bf16: oneDNN's bmm, its dot products emulated


@numba.njit(cache=True, nogil=True, inline="always")
def _add_place(values: np.ndarray, w: np.ndarray, g: int, c: int, lane: int, widened: np.ndarray,
               accs: np.ndarray) -> None:
    """Place c's products of every row added into accumulator `lane` (widened[0] is scratch)."""
    words = widened.view(np.uint32)
    for j in range(w.shape[2]):
        words[0, j] = np.uint32(np.uint16(w[g, c, j])) << np.uint32(16)
    for r in range(accs.shape[0]):
        value = values[r, g, c]
        for j in range(w.shape[2]):
            accs[r, lane, j] += value * widened[0, j]


@numba.njit(cache=True, nogil=True)
def _lanes_four_a_pass(values: np.ndarray, w: np.ndarray, g: int, first: int, last: int, lanes: int, spread: int,
                       swap: int, widened: np.ndarray, accs: np.ndarray) -> None:
    """`products`' sums of places first..last-1 into its accumulators, one accumulator at a time:
    lane L's q-th place is first + (q // spread) * lanes * spread + L * spread + q % spread (first
    a multiple of lanes * spread; its product is place ^ swap's, which stays in lane L), its four
    next products added one after another per pass as with one accumulator."""
    rows, n = accs.shape[0], w.shape[2]
    words = widened.view(np.uint32)
    width = lanes * spread
    for lane in range(lanes):
        full = (last - first) // width
        count = full * spread + max(0, min(spread, last - (first + full * width + lane * spread)))
        for q in range(0, count - count % 4, 4):
            c0 = (first + (q // spread) * width + lane * spread + q % spread) ^ swap
            c1 = (first + ((q + 1) // spread) * width + lane * spread + (q + 1) % spread) ^ swap
            c2 = (first + ((q + 2) // spread) * width + lane * spread + (q + 2) % spread) ^ swap
            c3 = (first + ((q + 3) // spread) * width + lane * spread + (q + 3) % spread) ^ swap
            for j in range(n):  # indexed, not sliced: a view costs as much as a row's sums
                words[0, j] = np.uint32(np.uint16(w[g, c0, j])) << np.uint32(16)
            for j in range(n):
                words[1, j] = np.uint32(np.uint16(w[g, c1, j])) << np.uint32(16)
            for j in range(n):
                words[2, j] = np.uint32(np.uint16(w[g, c2, j])) << np.uint32(16)
            for j in range(n):
                words[3, j] = np.uint32(np.uint16(w[g, c3, j])) << np.uint32(16)
            for r in range(rows):
                v0, v1, v2, v3 = values[r, g, c0], values[r, g, c1], values[r, g, c2], values[r, g, c3]
                for j in range(n):
                    accs[r, lane, j] = ((((accs[r, lane, j] + v0 * widened[0, j]) + v1 * widened[1, j])
                                         + v2 * widened[2, j]) + v3 * widened[3, j])
        for q in range(count - count % 4, count):
            _add_place(values, w, g, (first + (q // spread) * width + lane * spread + q % spread) ^ swap, lane,
                       widened, accs)


@numba.njit(cache=True, nogil=True)
def products(x: np.ndarray, w: np.ndarray, lanes: int, block: int, odd_first: bool, paired: bool,
             tree: np.ndarray, floor: float, out: np.ndarray) -> bool:
    """out[r, g] = the bf16 bits of x[r, g] @ w[g] for bf16 bits x int16 [R, G, K] and w int16
    [G, K, N], out int16 [R, G, N]: per block of `block` products along K (0: all K), product c
    added into accumulator c % lanes from +0 (with `paired`, (c // 2) % lanes: the two places of a
    pair share one, as a dot product's vector lanes take them), in place order or with `odd_first`
    each pair 2i + 1 before 2i (K even); the accumulators added first to last, or, with `tree`
    (int64 strides, powers of two covering lanes - 1), level by level: at stride s every lane i
    still in (no bit of an earlier stride set) without bit s takes lane i + s, lane 0 holding the
    sum; each block's sum added to the total from +0, the total rounded to bf16 (ties to even).
    Each weight row is widened once for all R rows (the weight is read once, as bf16). False (out
    unfinished) where a row holds a nonzero magnitude outside [floor, LARGEST) (`row_floor` of the
    weight)."""
    rows, groups, k = x.shape
    swap = 1 if odd_first else 0
    spread = 2 if paired else 1
    n = w.shape[2]
    block = k if block == 0 else block
    values = np.empty((rows, groups, k), np.float32)
    for r in range(rows):
        for g in range(groups):
            bf16_values(x[r, g], values[r, g])
            for c in range(k):
                magnitude = abs(values[r, g, c])
                if magnitude != 0.0 and not (floor <= magnitude < LARGEST):  # a NaN fails both
                    return False
    widened = np.empty((4, n), np.float32)
    widened_words = widened.view(np.uint32)
    accs = np.empty((rows, lanes, n), np.float32)
    totals = np.empty((rows, n), np.float32)
    words = totals.view(np.uint32)
    zero = np.float32(0.0)
    for g in range(groups):
        totals[:] = zero
        for first in range(0, k, block):
            accs[:] = zero
            last = min(k, first + block)
            rest = first  # the first place the one-at-a-time loop below takes
            # one accumulator: four places a pass, their products added one after another (kept apart
            # from the lane-by-lane pass below, which gives the same sums: `mini`'s one row 31 against 46 µs)
            if lanes == 1:
                for place in range(first, last - 3, 4):
                    for i in range(4):
                        for j in range(n):  # indexed, not sliced: a view costs as much as a row's sums
                            widened_words[i, j] = np.uint32(np.uint16(w[g, (place + i) ^ swap, j])) << np.uint32(16)
                    for r in range(rows):
                        v0, v1 = values[r, g, place ^ swap], values[r, g, (place + 1) ^ swap]
                        v2, v3 = values[r, g, (place + 2) ^ swap], values[r, g, (place + 3) ^ swap]
                        for j in range(n):
                            accs[r, 0, j] = ((((accs[r, 0, j] + v0 * widened[0, j]) + v1 * widened[1, j])
                                              + v2 * widened[2, j]) + v3 * widened[3, j])
                    rest = place + 4
            elif (spread == 2 or not swap) and first % (lanes * spread) == 0:
                # lane by lane (a lane's sums do not depend on the others'), four of its places a pass
                _lanes_four_a_pass(values, w, g, first, last, lanes, spread, swap, widened, accs)
                rest = last
            for place in range(rest, last):
                _add_place(values, w, g, place ^ swap, ((place ^ swap) // spread) % lanes, widened, accs)
            for r in range(rows):
                if len(tree):
                    taken = 0
                    for stride in tree:
                        for lane in range(lanes):
                            if lane & (taken | stride) == 0:
                                for j in range(n):
                                    accs[r, lane, j] += accs[r, lane + stride, j]
                        taken |= stride
                    for j in range(n):
                        totals[r, j] += accs[r, 0, j]
                    continue
                for j in range(n):
                    part = accs[r, 0, j]
                    for lane in range(1, lanes):
                        part += accs[r, lane, j]
                    totals[r, j] += part
        for r in range(rows):
            for j in range(n):
                out[r, g, j] = np.int16(bf16_high_bits(words[r, j]))
    return True


def row_floor(w: torch.Tensor) -> float | None:
    """The smallest nonzero row magnitude `products` takes exactly with weight w: 2^(-112 - b) for its
    smallest nonzero magnitude in [2^b, 2^(b + 1)), at least 2^-126; None where a nonzero |value| of
    w lies outside [SMALLEST, LARGEST) or w is not finite."""
    magnitude = w.float().abs()
    nonzero = magnitude[magnitude != 0]
    if not (bool(torch.isfinite(magnitude).all()) and bool(((nonzero >= SMALLEST) & (nonzero < LARGEST)).all())):
        return None
    if nonzero.numel() == 0:
        return SMALLEST_NORMAL
    return max(SMALLEST_NORMAL, 2.0 ** (-112 - int(torch.floor(torch.log2(nonzero.min())))))


Order = tuple[int, int, bool, bool, tuple[int, ...]]  # (lanes, block, odd_first, paired, tree) of `products`


@functools.cache
def find_order(path: str, groups: int, k: int, n: int, threads: int) -> Order | None:
    """The member of `CANDIDATE_ORDERS` whose sums equal this machine's one-row bf16 GEMM
    [groups, 1, k] x [groups, k, n] (`path` "grouped": `numerics.grouped_projection` of one token;
    "linear", one group: `numerics.linear` of one token [1, 1, k]) on order-revealing rows (2^20,
    -2^20 and 2^-10 at random places of each column, half of them within one block of 32), random
    rows of spread magnitudes and a zero row against negative weights; None where none does (the
    GEMM then stays). The kernel is picked by shape and thread count, not by value, so this is
    decided once per shape."""
    generator = torch.Generator().manual_seed(0)
    weights, rows = [], []  # rows [g, k], weights [g, n, k] as `numerics.grouped_projection` takes them
    for _ in range(4):
        w = torch.zeros(groups, n, k)
        for g in range(groups):
            for j in range(n):
                if j % 2:
                    start = int(torch.randint(0, max(1, k // 32), (), generator=generator)) * 32
                    places = start + torch.randperm(min(32, k), generator=generator)[:3]
                else:
                    places = torch.randperm(k, generator=generator)[:3]
                w[g, j, places] = torch.tensor([2.0**20, -(2.0**20), 2.0**-10])
        weights.append(w.bfloat16())
        rows.append(torch.ones(groups, k).bfloat16())
        spread = torch.exp2(torch.randint(-6, 7, (groups, k), generator=generator).float())
        weights.append((torch.randn(groups, n, k, generator=generator) * 0.05).bfloat16())
        rows.append((torch.randn(groups, k, generator=generator) * spread).bfloat16())
    weights.append(-weights[1].abs())
    rows.append(torch.zeros(groups, k).bfloat16())
    with torch.inference_mode():
        wanted = [_gemm(path, x, w) for x, w in zip(rows, weights, strict=True)]
        for order in CANDIDATE_ORDERS:
            lanes, block, odd_first = order[:3]
            if k < block or (block and k % block) or (odd_first and k % 2):
                continue
            if all(_loop_equals(x, w, order, want) for x, w, want in zip(rows, weights, wanted, strict=True)):
                return order
    return None


def run(x: np.ndarray, w: np.ndarray, order: Order, floor: float, out: np.ndarray) -> bool:
    """`products` in `order` (as `find_order` returns it)."""
    lanes, block, odd_first, paired, tree = order
    return products(x, w, lanes, block, odd_first, paired, _strides(tree), floor, out)


@functools.cache
def _strides(tree: tuple[int, ...]) -> np.ndarray:
    return np.array(tree, np.int64)


def _gemm(path: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The GEMM that `path` names, of one row x [g, k] by w [g, n, k] -> [g, n]."""
    groups, k = x.shape
    if path == "grouped":
        return numerics.grouped_projection(x.view(1, 1, groups, k), w).view(groups, -1)
    if path == "linear" and groups == 1:
        return numerics.linear(x.view(1, 1, k), w[0]).view(1, -1)
    raise ValueError(f"no one-row GEMM {path!r} of {groups} groups")


def layout(w: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [g, N, K] as `products` reads it: its bits, int16 [g, K, N]."""
    return w.transpose(1, 2).contiguous().view(torch.int16)


def _loop_equals(x: torch.Tensor, w: torch.Tensor, order: Order, want: torch.Tensor) -> bool:
    """Whether `products` of one row x [g, K] by w [g, N, K] in the given order gives want [g, N]."""
    out = torch.empty(1, w.size(0), w.size(1), dtype=torch.bfloat16)
    return run(x.contiguous().view(torch.int16).unsqueeze(0).numpy(), layout(w).numpy(), order, row_floor(w),
               out.view(torch.int16).numpy()) and torch.equal(out[0], want)
