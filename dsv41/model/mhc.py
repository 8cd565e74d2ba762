"""Single-pass mHC: the residual stream as `hc` copies, mixed by predicted coefficients (SPEC.md §6).

Each sub-layer predicts (pre, post, comb) from the stream entering it. It uses its own post and comb
for its update, but collapses its input with the pre-mix predicted by the sub-layer before it; that
one-step shift is what lets the real kernels fuse update, collapse and prediction into one pass.
"""

from __future__ import annotations

from functools import cache

import torch

from dsv41.kernels import cpu_loops
from dsv41.model import numerics


def sinkhorn_split(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float,
    rows: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split raw mixes [..., (2+hc)*hc] into pre [..., hc], post [..., hc] and a doubly stochastic
    comb [..., hc, hc] (rows i = source copy, cols j = destination copy), all fp32. `rows`: as
    `predict` takes them; each sequence's gates are then computed as alone (torch's sigmoid over
    these hc-wide slices takes vector or scalar code by an element's place in the whole tensor, and
    the two differ in the last bit on some CPUs); the Sinkhorn iterations are per row anyway.

    With DSV41_FAST_MHC=1 an inference call (no autograd, official numerics) runs it compiled
    (`torch.compile`, inductor): about 120 small operators become one kernel, and comb moves by
    a few fp32 ulps (docs/performance.md)."""
    args = (mixes, scale, base, numerics.scalar(eps), numerics.scalar(2.0), hc, iters)
    if numerics.opt_in("DSV41_FAST_MHC", "compiled Sinkhorn"):
        return _compiled_split()(*args)
    if rows is None:
        pre, post, comb = _gates(*args[:-1])
    elif len(set(rows)) == 1:  # sequences of equal token counts (a decode step): one pass, each as alone
        pre, post, comb = _gates(*args[:-1], tokens_each=rows[0])
    else:
        pres, posts, combs = zip(*(_gates(part, *args[1:-1]) for part in mixes.split(rows, dim=-2)), strict=True)
        pre, post, comb = torch.cat(pres, dim=-2), torch.cat(posts, dim=-2), torch.cat(combs, dim=-3)
    if hc <= FIRST_TO_LAST_SUMS and cpu_loops.serves(comb):
        return pre, post, _normalize_in_place(comb, eps, iters)
    return pre, post, _normalize(comb, args[3], iters)


@cache
def _compiled_split():
    return torch.compile(_split, fullgraph=True)


def _split(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: torch.Tensor, two: torch.Tensor,
    hc: int, iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    pre, post, comb = _gates(mixes, scale, base, eps, two, hc)
    return pre, post, _normalize(comb, eps, iters)


def _gates(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: torch.Tensor, two: torch.Tensor, hc: int,
    tokens_each: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pre, post and the comb's exponentials (before its row and column normalisation).
    `tokens_each`: mixes hold sequences of this many tokens each, and each one's gates come out as
    alone (mixes [1, s, ...]: the sigmoid and exp take each sequence's values as their own run)."""
    m, scale, base = mixes.float(), scale.float(), base.float()
    run = None if tokens_each is None else tokens_each * hc

    def apply(fn, x: torch.Tensor, width: int) -> torch.Tensor:
        return numerics.elementwise(fn, x) if run is None else numerics.elementwise_runs(fn, x, run * width)

    pre = apply(torch.sigmoid, m[..., :hc] * scale[0] + base[:hc], 1) + eps
    post = two * apply(torch.sigmoid, m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc], 1)
    logits = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    return pre, post, apply(torch.exp, logits - logits.amax(dim=-1, keepdim=True), hc)


def _normalize(comb: torch.Tensor, eps: torch.Tensor, iters: int) -> torch.Tensor:
    """The Sinkhorn iterations: rows, then columns, normalised `iters` times (fp32 throughout)."""
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


# torch sums up to this many float32 values first to last (as the compiled loop does); wider rows
# it sums in another order on some CPUs, so those keep the torch iterations
FIRST_TO_LAST_SUMS = 4


def _normalize_in_place(comb: torch.Tensor, eps: float, iters: int) -> torch.Tensor:
    """`_normalize` for inference on the CPU, as one compiled loop over the matrices
    (`cpu_loops.sinkhorn_normalize`: the same float32 operations in the same order, so the same
    bits). Through torch or numpy the 6 * iters operator calls on 4x4 matrices were most of an mHC
    sub-layer's time; the loop takes about 5 µs for a batch of four."""
    comb = comb.contiguous()
    cpu_loops.sinkhorn_normalize(comb.view(-1, *comb.shape[-2:]).numpy(), eps, iters)
    return comb


def predict(
    x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
    hc: int, iters: int, hc_eps: float, norm_eps: float, rows: list[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coefficients from the stream x [b, s, hc, d]: one RMS statistic over all hc*d values of a
    token, projected by fn [(2+hc)*hc, hc*d] (norm weights are folded into fn), then split.
    `rows`: the token counts of a batch's sequences along s; each sequence's coefficients are then
    computed as alone: an fp32 GEMM's sums change with its row count, and the gates' sigmoids over
    hc-wide slices take vector or scalar code by the element's place in the whole tensor (whose
    last bits differ on some CPUs)."""
    flat = x.flatten(2).float()
    mean_square = numerics.mean(numerics.wide(flat).square(), -1).float()
    rsqrt = numerics.elementwise(torch.rsqrt, mean_square + numerics.scalar(norm_eps))
    mixes = numerics.linear(flat, fn, rows)
    return sinkhorn_split(mixes * rsqrt, scale, base, hc, iters, hc_eps, rows)


def collapse(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """[b, s, hc, d] weighted by pre [b, s, hc] -> [b, s, d], summed in fp32."""
    return torch.sum(numerics.wide(pre.unsqueeze(-1) * x.float()), dim=2).to(x.dtype)


def expand(out: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """New stream copy j = post_j * out + sum_i comb[i, j] * residual_i, stored in out's dtype."""
    mixed = torch.sum(numerics.wide(comb.unsqueeze(-1) * residual.unsqueeze(-2)), dim=2).float()
    return (post.unsqueeze(-1) * out.unsqueeze(-2) + mixed).type_as(out)


def first_pre_mix(x: torch.Tensor, hc: int) -> torch.Tensor:
    """The one-hot mix (copy 0) that collapses the replicated embedding for layer 0."""
    pre = x.new_zeros(x.size(0), x.size(1), hc, dtype=torch.float32)
    pre[:, :, 0] = 1.0
    return pre
