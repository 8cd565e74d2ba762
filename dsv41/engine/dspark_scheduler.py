"""Choosing each request's verification length from the drafter's confidence (SPEC.md §8).

For request r, the confidence head gives a raw logit per draft position. Its sigmoid c_{r,i} is
the predicted probability that draft i is accepted given draft i-1 was. The prefix survival
a_{r,j} = prod_{i<=j} c_{r,i} is then the probability that draft j is accepted, so it is also the
expected number of tokens that position adds. A verification step over R requests runs
R + (admitted drafts) tokens, and `steps_per_s(n)` gives the engine's measured step rate at n
tokens. Candidates (r, j) are taken in decreasing a, each request's positions in order, while the
expected accepted tokens per second Θ = (R + Σ admitted a) · steps_per_s(R + #admitted) still rise.
The scheduler stops at the first drop. "fixed" verifies the same length for everyone, "off" none.

A head trained on few samples is over-confident (the default model's predicts about 0.99 where
0.6 is observed), which makes `auto` verify whole blocks. `Calibration` corrects it online: per
draft position, the acceptances observed over the predicted probabilities (both counted only
where the drafts before were accepted) scale the head's next predictions.

The confidence head cannot see what drafting itself costs, nor what a request gains when the
drafter is weak in its domain. `RoundChooser` decides before drafting whether a round speculates at
all, from the output tokens per second measured for speculative and for plain rounds at each
batch size, trying the other kind now and then so both rates stay current.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence


def prefix_survival(confidence: Sequence[float], temperature: float = 1.0) -> list[float]:
    """a_j = prod_{i<=j} sigmoid(logit_i / temperature)."""
    out, a = [], 1.0
    for logit in confidence:
        a *= _sigmoid(logit / temperature)
        out.append(a)
    return out


class Calibration:
    """Online per-position correction of the confidence head: p'_i = p_i · (A_i + k) / (P_i + k),
    with A_i the drafts accepted at position i and P_i the head's predicted probabilities summed,
    over verifications that reached position i (k pseudo-counts: no correction at first)."""

    def __init__(self, prior: float = 4.0):
        self.prior = prior
        self.predicted: list[float] = []
        self.accepted: list[int] = []

    def observe(self, confidence: Sequence[float], verified: int, accepted: int) -> None:
        """One verification: `verified` drafts with these confidence logits, the first `accepted` kept."""
        reached = min(verified, accepted + 1)
        grow = reached - len(self.predicted)
        if grow > 0:
            self.predicted += [0.0] * grow
            self.accepted += [0] * grow
        for i in range(reached):
            self.predicted[i] += _sigmoid(confidence[i])
            self.accepted[i] += i < accepted

    def adjust(self, confidence: Sequence[float]) -> list[float]:
        """Calibrated confidence logits."""
        out = []
        for i, logit in enumerate(confidence):
            ratio = 1.0
            if i < len(self.predicted):
                ratio = (self.accepted[i] + self.prior) / (self.predicted[i] + self.prior)
            p = min(max(_sigmoid(logit) * ratio, 1e-6), 1 - 1e-6)
            out.append(math.log(p / (1 - p)))
        return out

    def ratios(self) -> list[float]:
        """Observed over predicted acceptance per position (1.0: calibrated)."""
        return [(a + self.prior) / (p + self.prior) for a, p in zip(self.accepted, self.predicted, strict=True)]


class RoundChooser:
    """Speculate this round or not: whichever kind of round has emitted more tokens per second
    (drafting and stepping included) at this batch size. The other kind is tried again after
    `explore` rounds, and each try that confirms it is worse doubles that wait, up to `explore`
    rounds per sequence of the batch and at most `longest` (so a change of load or of text is
    noticed within that many rounds). A try costs what its batch verifies: at batch 8 a
    speculative round costs nearly two plain ones, so trying it often would cost more than it
    finds; at batch 1 it costs about a third of a plain round and still emits a token. Each kind
    is tried first until it has a rate. A rate is decayed tokens over decayed seconds.

    A plain round always emits one token per request in about the same time, but a speculative
    one emits 1 to block + 1, so a few rounds say little about its rate: the speculative rate is
    compared as rate * (1 + optimism / sqrt(n)) after n speculative rounds at this batch size (an
    upper confidence bound). A drafter at under half the plain rate still loses after one or two
    rounds, one at 90 % of it after about 80 (optimism 1), and a few unlucky first blocks no longer
    shut speculation off for the rest of a request (docs/dspark.md)."""

    def __init__(self, explore: int = 8, longest: int = 32, decay: float = 0.95, optimism: float = 1.0):
        self.explore, self.longest, self.decay, self.optimism = explore, longest, decay, optimism
        self.sums: dict[tuple[int, bool], tuple[float, float]] = {}  # (tokens, seconds)
        self.speculated: dict[int, int] = {}  # speculative rounds observed, by batch size
        self.wait: dict[int, int] = {}  # rounds between tries of the worse kind, by batch size
        self.since: dict[int, int] = {}  # rounds since the last try
        self.trying: dict[int, bool] = {}  # the round chosen last was a try

    def rate(self, batch: int, speculated: bool) -> float | None:
        """Tokens per second of this kind of round at this batch size (None: not tried yet)."""
        got = self.sums.get((batch, speculated))
        return None if got is None else got[0] / max(got[1], 1e-9)

    def hopeful_rate(self, batch: int) -> float | None:
        """The speculative rate as compared: raised while few speculative rounds were seen."""
        spec = self.rate(batch, True)
        if spec is None:
            return None
        return spec * (1 + self.optimism / math.sqrt(max(self.speculated.get(batch, 0), 1)))

    def speculate(self, batch: int) -> bool:
        spec, plain = self.hopeful_rate(batch), self.rate(batch, False)
        if spec is None or plain is None:
            self.trying[batch] = False
            return spec is None
        best = spec >= plain
        self.since[batch] = self.since.get(batch, 0) + 1
        self.trying[batch] = self.since[batch] >= self.wait.get(batch, self.explore)
        if self.trying[batch]:
            self.since[batch] = 0
            return not best
        return best

    def observe(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        old_tokens, old_seconds = self.sums.get((batch, speculated), (0.0, 0.0))
        self.sums[(batch, speculated)] = (self.decay * old_tokens + tokens, self.decay * old_seconds + seconds)
        if speculated:
            self.speculated[batch] = self.speculated.get(batch, 0) + 1
        if self.trying.get(batch):
            spec, plain = self.hopeful_rate(batch), self.rate(batch, False)
            still_worse = (spec < plain) if speculated else (plain <= spec)
            wait = self.wait.get(batch, self.explore)
            self.wait[batch] = min(2 * wait, self.longest, self.explore * batch) if still_worse else self.explore


def _sigmoid(logit: float) -> float:
    return 1.0 / (1.0 + math.exp(-logit))


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
