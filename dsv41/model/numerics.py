"""Official numerics by default; shape-stable numerics on request.

The official op sequence is deterministic but not shape-invariant: BLAS picks a different
summation order for a one-row GEMM (GEMV) than for many rows, and torch's reductions pick theirs
by shape, so the same position computed in a 1-token chunk and in a 37-token chunk can differ in
the last bit. That is what `dsv41 parity` must reproduce, so it stays the default.

Inside `stable_numerics()` every matmul becomes exact float64 products summed along a contiguous
last dimension (an order fixed by the reduced length alone), and reductions accumulate in
float64; each result is rounded once to the dtype the official code produces. Results then
depend only on the values, not on how many rows or which chunk they came in: chunked prefill,
replay, verification and the oracle can be compared exactly. It is slower and uses more memory:
a tool for tests and measurements on small models.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache

import torch
import torch.nn.functional as F

_stable = False


@contextmanager
def stable_numerics(on: bool = True) -> Iterator[None]:
    global _stable
    previous, _stable = _stable, on
    try:
        yield
    finally:
        _stable = previous


def is_stable() -> bool:
    """Whether shape-stable numerics are on (callers that lay out work by shape ask this)."""
    return _stable


def opt_in(variable: str, what: str) -> bool:
    """Whether environment variable `variable` (0, the default, or 1) turns on the fast path `what`.
    Fast paths leave the official numerics (last bits move; docs/performance.md), so they apply only
    to inference (no autograd) outside shape-stable numerics."""
    choice = os.environ.get(variable, "0")
    if choice not in ("0", "1"):
        raise ValueError(f"{variable}={choice!r}: use 0 (reference numerics) or 1 ({what})")
    return choice == "1" and not _stable and not torch.is_grad_enabled()


@cache
def scalar(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`value` as a 0-dim tensor, made once. Torch wraps a Python number operand in a tensor and
    converts it to the other operand's dtype on every call (four extra operator calls, the largest
    share of a small op's cost); a 0-dim tensor of that dtype gives the same result without them.
    Use it only with operands of `dtype`: beside another dtype it would promote differently."""
    with torch.inference_mode(False):  # usable where autograd records too
        return torch.tensor(value, dtype=dtype)


def mean(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t.mean(dim, keepdim=True). On the CPU torch computes an fp32/fp64 mean as the sum divided by
    the count, which this does without the Python-number divisor; elsewhere it is torch's mean."""
    if t.device.type != "cpu" or t.dtype not in (torch.float32, torch.float64):
        return t.mean(dim, keepdim=True)
    return t.sum(dim, keepdim=True).div_(scalar(t.size(dim), t.dtype))


def wide(t: torch.Tensor) -> torch.Tensor:
    """The tensor to accumulate a reduction in: itself, or float64 in stable mode."""
    return t.double() if _stable else t


def linear(x: torch.Tensor, w: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
    """x @ w.T. `rows`: the token counts of a batch's sequences along x's second-to-last axis,
    each multiplied as alone (a GEMM's sums for one row change with the rows beside it): as one
    batched fp32 GEMM when they are equal and this machine gives each matrix of it the bits of its
    own GEMM, else one GEMM per sequence."""
    if rows is not None:
        if _as_batch_keeps_bits(x, w, rows):
            return _linear_as_batch(x, w, len(rows))
        return torch.cat([linear(part, w) for part in x.split(rows, dim=-2)], dim=-2)
    if not _stable:
        return F.linear(x, w)
    return _contract_last(x.double().unsqueeze(-2) * w.double(), torch.promote_types(x.dtype, w.dtype))


def _linear_as_batch(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """`linear` of n equal sequences as one bmm, each sequence one matrix of it."""
    flat = x.reshape(n, -1, x.size(-1))
    return torch.bmm(flat, w.t().expand(n, -1, -1)).reshape(*x.shape[:-1], w.size(0))


def _as_batch_keeps_bits(x: torch.Tensor, w: torch.Tensor, rows: list[int]) -> bool:
    """Whether `linear` may run a batch of equal sequences as one batched GEMM: outside stable mode,
    fp32 on the CPU, one batch row of x, and this machine's BLAS giving every matrix of the batched
    GEMM the bits of its own GEMM (checked once per shape). Not bf16: on a CPU with AMX, oneDNN's
    bf16 GEMM gave a sequence other bits inside a batched GEMM than alone in about 1 % of random
    batches at the index projections' shapes, which a check on a few random batches cannot rule out."""
    if _stable or len(rows) < 2 or len(set(rows)) != 1 or x.device.type != "cpu" or x.shape[:-2].numel() != 1:
        return False
    if x.dtype != torch.float32 or w.dtype != torch.float32:
        return False
    return _batch_gives_alone_bits(tuple(w.shape), rows[0], torch.get_num_threads())


@cache
def _batch_gives_alone_bits(w_shape: tuple[int, int], tokens: int, threads: int) -> bool:
    """Compare the batched GEMM with per-sequence GEMMs on random values, at two batch sizes: MKL
    picks its fp32 kernel by shape, not by value, so equal bits here mean equal bits always."""
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(w_shape, generator=generator)
    for count in (2, 9):
        x = torch.randn(1, count * tokens, w_shape[1], generator=generator)
        each = torch.cat([linear(part, w) for part in x.split(tokens, dim=1)], dim=1)
        if not torch.equal(_linear_as_batch(x, w, count), each):
            return False
    return True


def einsum(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A two-operand einsum that contracts exactly one index."""
    if not _stable:
        return torch.einsum(equation, a, b)
    inputs, out = equation.split("->")
    contracted = (set(inputs) - set(out) - {","}).pop()
    products = torch.einsum(f"{inputs}->{out}{contracted}", a.double(), b.double())  # exact, no sums
    return _contract_last(products, torch.promote_types(a.dtype, b.dtype))


def grouped_projection(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [b, s, g, d] . w [g, r, d] over d -> [b, s, g, r]: einsum("bsgd,grd->bsgr") with the same
    bits. Outside stable mode it makes the one `bmm` torch's einsum reduces this to ([g, b*s, d] @
    [g, d, r], the operands in the layouts einsum gives them) without einsum's parsing and permutes,
    which cost about as much as the product at decode sizes (the output projection `wo_a`, once
    per sequence of a batch: 450 against 240 us a layer for a batch of 8 on `small`)."""
    if _stable:
        return einsum("bsgd,grd->bsgr", x, w)
    b, s, g, d = x.shape
    y = torch.bmm(x.reshape(b * s, g, d).transpose(0, 1), w.transpose(1, 2))
    return y.transpose(0, 1).reshape(b, s, g, w.size(1))


def dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [n, m, d] . b [n, t, d] over d -> [n, m, t]: einsum("nmd,ntd->nmt") with the same bits.
    Outside stable mode it calls bmm on b's transposed view: torch's einsum takes a path for bf16
    operands of this shape that is 10-20x slower on the CPU (64K index keys: 18 ms against 1 ms)
    and gives the same result (tests/test_numerics_constants.py).

    The product runs over steady shapes, a column's value not depending on how many columns there
    are: oneDNN builds a matmul for every new shape, and a decode step's key count grows by one a
    step, so unpadded every step paid for building one (about 2 ms of a `small` component's step,
    most of it fresh pages). The keys are taken in whole granules (1/32 of the key count's power of
    two, at least 64): where the products are fewer bytes than the keys (m < d, one sequence), the
    leading whole granules are multiplied where they lie and the rest, padded with zero keys to one
    granule, apart (joining the two results copies them); otherwise the keys are padded to whole
    granules (one copy of them). Padding to the next power of two would copy up to twice the keys
    (6 ms of 9 at 32K keys); a view of a batch's leading rows is not a batch of the stride oneDNN's
    fast path takes (32,768 of 32,772 keys took 11 ms against 0.6 ms)."""
    if _stable:
        return einsum("nmd,ntd->nmt", a, b)
    n, m, t = b.size(0), a.size(1), b.size(1)
    granule = max(64, 1 << max(0, t.bit_length() - 5))
    whole = t - t % granule
    if whole == t:
        return torch.bmm(a, b.transpose(1, 2))
    if n > 1 or m >= b.size(2) or not whole:
        return torch.bmm(a, F.pad(b, (0, 0, 0, whole + granule - t)).transpose(1, 2))[..., :t]
    rest = F.pad(b[:, whole:], (0, 0, 0, whole + granule - t))
    leading = b[0, :whole].unsqueeze(0)  # the batch stride of a tensor of `whole` rows
    return torch.cat([torch.bmm(a, leading.transpose(1, 2)), torch.bmm(a, rest.transpose(1, 2))[..., : t - whole]],
                     dim=-1)


def bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Batched a @ b; in stable mode exact (used for 32-wide blocks of FP8 products)."""
    return torch.bmm(a, b) if not _stable else torch.bmm(a.double(), b.double()).to(a.dtype)


def _contract_last(products: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Sum over the last, contiguous dimension: its order depends only on that length, not on how
    many rows there are (a GEMM's does)."""
    return products.contiguous().sum(-1).to(dtype)


def elementwise(fn, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """fn(x) for a transcendental fn (exp, sigmoid, rsqrt, silu, softmax, ...). Torch computes them
    with vector code for most elements and scalar code for a tensor's tail, whose results can
    differ in the last bit, so in stable mode they run in float64 and round once."""
    if not _stable:
        return fn(x, *args, **kwargs)
    return fn(x.double(), *args, **kwargs).to(x.dtype)


def elementwise_runs(fn, x: torch.Tensor, run: int) -> torch.Tensor:
    """`elementwise(fn, x)` with every `run` consecutive elements of x (in row-major order) computed
    as if they were a tensor of their own: a batch's sequences, each as alone. Torch's loop over a
    contiguous tensor takes vector code for whole vectors from the start and scalar code for the
    tail, so an element's code (and on some CPUs its last bit) depends on its place in the whole
    tensor. Here the runs sit in rows one element apart, which torch cannot fuse into one loop:
    each run is its own loop from its first element, as in a tensor of `run` elements."""
    if _stable or x.numel() <= run:
        return elementwise(fn, x)
    flat = x.reshape(-1, run)
    gapped = torch.empty(flat.size(0), run + 1, dtype=x.dtype, device=x.device)[:, :run]
    gapped.copy_(flat)
    return fn(gapped).reshape(x.shape)
