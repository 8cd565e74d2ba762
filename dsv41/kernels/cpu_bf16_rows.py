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
kernels it picks at N = 4 and N = 32 sum in other orders, outside this family. `products`
computes the family (`lanes` accumulators over blocks of `block` products); `find_order` tells
which member, if any, this machine's kernel is at a shape.

Exactness. Where every nonzero |value| of a row and of the weight lies in [2^-56, 2^56), each
product and partial sum is a normal float32 (a multiple of 2^-126 below 2^124), so the flush of
denormals to zero that the AMX kernel applies never applies. `products` refuses rows outside that
range and `weight_in_range` weights; the GEMM then computes them.
"""

from __future__ import annotations

import functools

import numba
import numpy as np
import torch

from dsv41.kernels.cpu_loops import bf16_high_bits, bf16_values
from dsv41.model import numerics

SMALLEST, LARGEST = 2.0**-56, 2.0**56  # every nonzero magnitude within [SMALLEST, LARGEST)
# the largest weight (values) the loop takes: `mini`'s `wo_a` (2 x 128 x 1,024), whose GEMM costs about
# what torch's call around it does; the official `wo_a` (8 x 1,024 x 4,096) is 128 times that, a
# GEMM of about a millisecond whose fp32 copy would hold 134 MB a layer
MOST_WEIGHTS = 1 << 18
# (lanes, block) pairs tried in turn; a block as long as K is one pass over it
CANDIDATE_ORDERS = ((2, 32), (4, 0), (1, 0), (2, 0), (8, 0), (1, 32), (4, 32), (8, 32), (2, 64), (4, 64))


@numba.njit(cache=True, nogil=True)
def products(x: np.ndarray, w: np.ndarray, lanes: int, block: int, out: np.ndarray) -> bool:
    """out[r, g] = the bf16 bits of x[r, g] @ w[g] for bf16 bits x int16 [R, G, K] and bf16 values
    w float32 [G, K, N], out int16 [R, G, N]: per block of `block` products along K (0: all K),
    product c added into accumulator c % lanes from +0, the accumulators added first to last, each
    block's sum added to the total from +0, the total rounded to bf16 (ties to even). False
    (out unfinished) where a row holds a value outside the exact range."""
    rows, groups, k = x.shape
    n = w.shape[2]
    block = k if block == 0 else block
    values = np.empty(k, np.float32)
    accs = np.empty((lanes, n), np.float32)
    total = np.empty(n, np.float32)
    words = total.view(np.uint32)
    zero = np.float32(0.0)
    for r in range(rows):
        for g in range(groups):
            bf16_values(x[r, g], values)
            for c in range(k):
                magnitude = abs(values[c])
                if magnitude != 0.0 and not (SMALLEST <= magnitude < LARGEST):  # a NaN fails both
                    return False
            total[:] = zero
            weight = w[g]
            for first in range(0, k, block):
                accs[:] = zero
                for c in range(first, min(k, first + block)):
                    value, acc, row = values[c], accs[c % lanes], weight[c]
                    for j in range(n):
                        acc[j] += value * row[j]
                for j in range(n):
                    part = accs[0, j]
                    for lane in range(1, lanes):
                        part += accs[lane, j]
                    total[j] += part
            for j in range(n):
                out[r, g, j] = np.int16(bf16_high_bits(words[j]))
    return True


def weight_in_range(w: torch.Tensor) -> bool:
    """Whether every nonzero |value| of weight w lies in the range `products` computes exactly."""
    magnitude = w.float().abs()
    nonzero = magnitude[magnitude != 0]
    return bool(torch.isfinite(magnitude).all()) and bool(((nonzero >= SMALLEST) & (nonzero < LARGEST)).all())


@functools.cache
def find_order(path: str, groups: int, k: int, n: int, threads: int) -> tuple[int, int] | None:
    """The (lanes, block) of `CANDIDATE_ORDERS` whose sums equal this machine's one-row bf16 GEMM
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
        for lanes, block in CANDIDATE_ORDERS:
            if k < block or (block and k % block):
                continue
            if all(_loop_equals(x, w, lanes, block, want) for x, w, want in zip(rows, weights, wanted, strict=True)):
                return lanes, block
    return None


def _gemm(path: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The GEMM that `path` names, of one row x [g, k] by w [g, n, k] -> [g, n]."""
    groups, k = x.shape
    if path == "grouped":
        return numerics.grouped_projection(x.view(1, 1, groups, k), w).view(groups, -1)
    if path == "linear" and groups == 1:
        return numerics.linear(x.view(1, 1, k), w[0]).view(1, -1)
    raise ValueError(f"no one-row GEMM {path!r} of {groups} groups")


def layout(w: torch.Tensor) -> torch.Tensor:
    """A bf16 weight [g, N, K] as `products` reads it: float32 [g, K, N]."""
    return w.float().transpose(1, 2).contiguous()


def _loop_equals(x: torch.Tensor, w: torch.Tensor, lanes: int, block: int, want: torch.Tensor) -> bool:
    """Whether `products` of one row x [g, K] by w [g, N, K] in the given order gives want [g, N]."""
    out = torch.empty(1, w.size(0), w.size(1), dtype=torch.bfloat16)
    return products(x.contiguous().view(torch.int16).unsqueeze(0).numpy(), layout(w).numpy(), lanes, block,
                    out.view(torch.int16).numpy()) and torch.equal(out[0], want)
