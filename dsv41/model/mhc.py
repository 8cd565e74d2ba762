"""Single-pass mHC: the residual stream as `hc` copies, mixed by predicted coefficients (SPEC.md §6).

Each sub-layer predicts (pre, post, comb) from the stream entering it. It uses its own post and comb
for its update, but collapses its input with the pre-mix predicted by the sub-layer before it; that
one-step shift is what lets the real kernels fuse update, collapse and prediction into one pass.
"""

from __future__ import annotations

from functools import cache

import torch

from dsv41.model import numerics


def sinkhorn_split(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split raw mixes [..., (2+hc)*hc] into pre [..., hc], post [..., hc] and a doubly stochastic
    comb [..., hc, hc] (rows i = source copy, cols j = destination copy), all fp32.

    With DSV41_FAST_MHC=1 an inference call (no autograd, official numerics) runs it compiled
    (`torch.compile`, inductor): about 120 small operators become one kernel, and comb moves by
    a few fp32 ulps (docs/performance.md)."""
    args = (mixes, scale, base, numerics.scalar(eps), numerics.scalar(2.0), hc, iters)
    if numerics.opt_in("DSV41_FAST_MHC", "compiled Sinkhorn"):
        return _compiled_split()(*args)
    return _split(*args)


@cache
def _compiled_split():
    return torch.compile(_split, fullgraph=True)


def _split(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, eps: torch.Tensor, two: torch.Tensor,
    hc: int, iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, scale, base = mixes.float(), scale.float(), base.float()
    pre = numerics.elementwise(torch.sigmoid, m[..., :hc] * scale[0] + base[:hc]) + eps
    post = two * numerics.elementwise(torch.sigmoid, m[..., hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = (m[..., 2 * hc :] * scale[2] + base[2 * hc :]).unflatten(-1, (hc, hc))
    comb = numerics.elementwise(torch.exp, logits - logits.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def predict(
    x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
    hc: int, iters: int, hc_eps: float, norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Coefficients from the stream x [b, s, hc, d]: one RMS statistic over all hc*d values of a
    token, projected by fn [(2+hc)*hc, hc*d] (norm weights are folded into fn), then split."""
    flat = x.flatten(2).float()
    mean_square = numerics.mean(numerics.wide(flat).square(), -1).float()
    rsqrt = numerics.elementwise(torch.rsqrt, mean_square + numerics.scalar(norm_eps))
    return sinkhorn_split(numerics.linear(flat, fn) * rsqrt, scale, base, hc, iters, hc_eps)


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
