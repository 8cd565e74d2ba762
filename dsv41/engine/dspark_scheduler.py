"""Choosing each request's verification length from the drafter's confidence (SPEC.md §8).

For request r, the confidence head gives a raw logit per draft position. Its sigmoid c_{r,i} is
the predicted probability that draft i is accepted given draft i-1 was. The prefix survival
a_{r,j} = prod_{i<=j} c_{r,i} is then the probability that draft j is accepted, so it is also the
expected number of tokens that position adds. A verification step over R requests runs
R + (admitted drafts) tokens, and `steps_per_s(n)` gives the engine's measured step rate at n
tokens. Candidates (r, j) are taken in decreasing a, each request's positions in order, while the
expected accepted tokens per second Θ = (R + Σ admitted a) · steps_per_s(R + #admitted) still rise.
The scheduler stops at the first drop. "fixed" verifies the same length for everyone, "off" none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


def prefix_survival(confidence: Sequence[float], temperature: float = 1.0) -> list[float]:
    """a_j = prod_{i<=j} sigmoid(logit_i / temperature)."""
    out, a = [], 1.0
    for logit in confidence:
        a *= 1.0 / (1.0 + math.exp(-logit / temperature))
        out.append(a)
    return out


def choose_lengths(confidence: Sequence[Sequence[float]], steps_per_s: Callable[[int], float],
                   mode: str = "auto", fixed: int = 0, temperature: float = 1.0) -> list[int]:
    """Draft tokens to verify for each request (0..len(confidence[r]))."""
    if mode == "off":
        return [0] * len(confidence)
    if mode == "fixed":
        return [min(fixed, len(c)) for c in confidence]
    if mode != "auto":
        raise ValueError(f"unknown DSpark schedule {mode!r}; use auto, fixed or off")
    survival = [prefix_survival(c, temperature) for c in confidence]
    n_requests = len(confidence)
    lengths = [0] * n_requests
    candidates = sorted(((a, r, j) for r, row in enumerate(survival) for j, a in enumerate(row)),
                        key=lambda c: (-c[0], c[1], c[2]))
    expected, admitted = float(n_requests), 0
    best = expected * steps_per_s(n_requests)
    pending = list(candidates)
    while pending:
        # the best candidate that extends its request's prefix (a is non-increasing along a row)
        pick = next((c for c in pending if c[2] == lengths[c[1]]), None)
        if pick is None:
            break
        a, r, _ = pick
        throughput = (expected + a) * steps_per_s(n_requests + admitted + 1)
        if throughput <= best:
            break
        best, expected, admitted = throughput, expected + a, admitted + 1
        lengths[r] += 1
        pending.remove(pick)
    return lengths
