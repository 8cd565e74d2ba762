"""Greedy speculative decoding with the DSpark drafter over one sequence of an `InferenceCore`.

Each round: the drafter proposes a block after the last chosen token; the backbone verifies the
token and the drafts in one multi-token step; the longest prefix of drafts equal to the target's
argmax is accepted, plus the target's next token. When a draft is rejected the step is truncated in
place to the accepted positions (`InferenceCore.truncate`), so the caches hold exactly what plain
decoding of the accepted tokens leaves (no rejected position in any ring, compressor state or page)
without running anything again. The drafter's rings take only accepted positions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from dsv41.engine.core import InferenceCore, Sequence
from dsv41.model.cache import checkpoint, restore, truncate
from dsv41.model.dspark import Drafter, new_state
from dsv41.model.reference import Sampling


@dataclass
class SpecStats:
    verifications: int = 0
    accepted: list[int] = field(default_factory=list)  # accepted drafts per verification

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verification, the bonus token included."""
        return (sum(self.accepted) + len(self.accepted)) / max(1, len(self.accepted))


def _run(core: InferenceCore, seq: Sequence, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    start = seq.cache.length
    x, pre_mix = core.encode_tokens_batch([seq], [tokens])
    logits, hidden = core.decode_streams_batch([seq], x, pre_mix, [start], [len(tokens)])
    return logits[0], hidden[0]


def plain_greedy(core: InferenceCore, prompt: list[int], n: int) -> list[int]:
    """n tokens of plain greedy decoding (a `full` prefill, then one-token steps): the output that
    speculative decoding at temperature 0 must reproduce."""
    seq, logits = core.prefill(prompt, mode="full")
    out = [int(logits.argmax())]
    try:
        while len(out) < n:
            out.append(int(core.step(seq, [out[-1]])[-1].argmax()))
    finally:
        core.release(seq)
    return out


@torch.inference_mode()
def greedy_speculative(core: InferenceCore, drafter: Drafter, prompt: list[int], max_new_tokens: int,
                       length: int | None = None, stop_ids: tuple[int, ...] = (),
                       stats: SpecStats | None = None) -> list[int]:
    """Temperature-0 generation with drafts of `length` tokens (default: the block size); the
    output equals plain greedy decoding of the same model (exactly so in shape-stable numerics)."""
    k = min(length or drafter.block, drafter.block)
    seq, _ = core.new_sequence(prompt, len(prompt) + max_new_tokens + k + 1)
    state = new_state(core.model.config)
    stats = stats if stats is not None else SpecStats()
    try:
        logits, hidden = _run(core, seq, prompt)
        out = [int(logits[-1].argmax())]
        while out[-1] not in stop_ids and len(out) < max_new_tokens:
            drafter.observe(state, hidden)
            room = min(k, max_new_tokens - len(out))
            drafts = drafter.draft([state], [out[-1]]).tokens[0, :room].tolist()
            saved = core.checkpoint(seq)
            logits, hidden = _run(core, seq, [out[-1], *drafts])
            targets = logits.argmax(-1).tolist()
            n = len(accept_greedy(targets, drafts, stop_ids)) - 1
            if n < len(drafts):
                core.truncate(seq, saved, seq.cache.length - len(drafts) + n)
                hidden = hidden[: n + 1]
            stats.verifications += 1
            stats.accepted.append(n)
            out += drafts[:n] + [targets[n]]
        for i, token in enumerate(out):
            if token in stop_ids:
                return out[: i + 1]
        return out[:max_new_tokens]
    finally:
        core.release(seq)


def accept_sampled(target: torch.Tensor, draft: torch.Tensor, drafts: list[int],
                   gen: torch.Generator | None = None) -> list[int]:
    """The speculative-sampling rule (temperature > 0): target [k+1, vocab] holds the target's
    probabilities after the input token and after each draft, draft [k, vocab] the probabilities
    the drafts were sampled from. Draft i is accepted with probability min(1, p_i(d)/q_i(d)); the
    first rejected one is replaced by a sample of the normalised residual max(p_i - q_i, 0), and
    when all are accepted a bonus token is sampled from the last target row. The emitted tokens are
    distributed exactly as sampling the target one token at a time."""
    out = []
    for i, token in enumerate(drafts):
        p, q = float(target[i, token]), float(draft[i, token])
        if q > 0 and float(torch.rand((), generator=gen)) * q < p:
            out.append(token)
            continue
        residual = (target[i] - draft[i]).clamp(min=0)
        total = float(residual.sum())
        row = residual / total if total > 0 else target[i]
        out.append(int(torch.multinomial(row, 1, generator=gen)))
        return out
    out.append(int(torch.multinomial(target[len(drafts)], 1, generator=gen)))
    return out


def accept_greedy(targets: list[int], drafts: list[int], stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Temperature 0: the longest prefix of drafts equal to the target's argmax (targets[i] follows
    the input token and drafts[:i]), then the target's next token. A stop token ends the block."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n] and drafts[n] not in stop_ids:
        n += 1
    return [*drafts[:n], targets[n]]


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The distribution `sample_next` draws from at temperature > 0 (softmax(logits / T), cut to the
    top-p mass), for rows logits [k, vocab]."""
    probs = torch.softmax(logits.float() / max(sampling.temperature, 1e-5), dim=-1, dtype=torch.float32)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs / probs.sum(dim=-1, keepdim=True)


# --- verification over a sequence held by a component (the encoder's or the decoder's half) ---------


@torch.inference_mode()
def rewind(seq: Sequence, start: int) -> None:
    """Put the sequence at position `start` before a step: its length already, a position inside its
    last verification step (that step is cut in place to the positions before `start`: the
    accepted ones; the rejected drafts leave every cache, nothing runs again), or the position of
    that step's checkpoint (the whole step is rolled back). Raises ValueError else."""
    if start in (-1, seq.cache.length):
        return
    saved = seq.saved
    if saved is None or not saved.length <= start < seq.cache.length:
        held = "no checkpoint" if saved is None else f"a checkpoint at position {saved.length}"
        raise ValueError(f"cannot step at position {start}: the sequence holds {seq.cache.length} positions and "
                         f"{held}")
    if start == saved.length:
        restore(seq.cache, saved)
    else:
        truncate(seq.cache, saved, start)
    seq.count_pages()
    seq.saved = None


@torch.inference_mode()
def hold_checkpoint(seq: Sequence, verify: bool) -> None:
    """Before a step: a verification step keeps a checkpoint of what it may overwrite, any other
    step lets the last one go."""
    seq.saved = checkpoint(seq.cache) if verify else None


class StepCost:
    """Seconds of a backbone step by the tokens it verifies: a + b * tokens, least squares over
    the mean time of each size seen. Seeded by timed steps at start-up and kept current from the
    steps the scheduler runs (an exponential average per size, so a change of load shows)."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.seconds: dict[int, float] = {}

    def observe(self, tokens: int, seconds: float) -> None:
        old = self.seconds.get(tokens)
        self.seconds[tokens] = seconds if old is None else self.decay * old + (1 - self.decay) * seconds

    def fit(self) -> tuple[float, float]:
        """(a, b) of the line; with one size only, a line through the origin."""
        points = list(self.seconds.items())
        if not points:
            return 1.0, 0.0
        if len(points) == 1:
            n, s = points[0]
            return 0.0, s / n
        mean_n = sum(n for n, _ in points) / len(points)
        mean_s = sum(s for _, s in points) / len(points)
        var = sum((n - mean_n) ** 2 for n, _ in points)
        b = max(0.0, sum((n - mean_n) * (s - mean_s) for n, s in points) / var)
        return max(mean_s - b * mean_n, 1e-9), b

    def steps_per_s(self, tokens: int) -> float:
        a, b = self.fit()
        return 1.0 / max(a + b * tokens, 1e-9)


class Stopwatch:
    """Seconds spent inside `with` blocks, summed."""

    def __init__(self):
        self.total = 0.0

    def __enter__(self):
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.total += time.perf_counter() - self._start
