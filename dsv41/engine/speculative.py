"""Greedy speculative decoding with the DSpark drafter over one sequence of an `InferenceCore`.

Each round: the drafter proposes a block after the last chosen token; the backbone verifies the
token and the drafts in one multi-token step; the longest prefix of drafts equal to the target's
argmax is accepted, plus the target's next token. When a draft is rejected the caches go back to
the checkpoint taken before the step and the accepted tokens are run again, so the caches hold
exactly what plain decoding of the accepted tokens leaves (no rejected position in any ring,
compressor state or page). The drafter's rings take only accepted positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.engine.core import InferenceCore, Sequence
from dsv41.model.dspark import Drafter, new_state


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
            n = 0
            while n < len(drafts) and drafts[n] == targets[n] and drafts[n] not in stop_ids:
                n += 1
            if n < len(drafts):
                core.rollback(seq, saved)
                logits, hidden = _run(core, seq, [out[-1], *drafts[:n]])
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
