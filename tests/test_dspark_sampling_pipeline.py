"""Sampling (temperature > 0) with speculative decoding through the pipeline follows the target
model's distribution: the speculative-sampling rule as the dspark component applies it to real
verification rows, drafts kept and rejected alike (the rule alone is tested on a small Markov chain
in tests/test_dspark_speculative.py).

Every emitted token is checked against the row the target model gives it at its place (the
in-process core stepping the same tokens; a verification's rows differ from plain steps' by
rounding at most), by two statistics with a false-alarm rate of 0.1 % each:
* the summed log-probability of the tokens against its mean under the rows, in standard deviations
  (tokens drawn from a sharper or flatter distribution, or from the wrong one after a rejection,
  move it);
* a Kolmogorov-Smirnov test of the randomized probability integral transforms
  u = F(t - 1) + V p(t), V uniform, which are uniform on (0, 1) exactly when tokens follow their rows.
The seeds are fixed, so a run is deterministic; the slow tier also runs a rule that resamples a
rejected draft from the target row instead of the residual, and checks that it is caught."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from dsv41 import messages as m
from dsv41.components import dspark as dspark_component
from dsv41.components.runtime import new_request_id
from dsv41.engine.core import InferenceCore
from dsv41.engine.speculative import accept_sampled, target_probs
from dsv41.model.dspark import Draft
from dsv41.model.reference import Sampling, random_model, sample_next
from dsv41.pipelines.client import generate_together
from dsv41.pipelines.launch import Supervisor, with_overrides
from tests.helpers.pipelines import pipeline_for, short_dir

pytestmark = pytest.mark.timeout(600)
BLOCK, VOCAB = 4, 320  # micro's dspark_block_size and vocabulary
SAMPLING = Sampling(temperature=2.0, top_p=0.8)  # broad rows, so a context-free drafter is kept often enough
REQUESTS, NEW_TOKENS, AT_ONCE = 64, 16, 32
Z_LIMIT = 3.29  # two-sided 0.1 % of the standard normal
KS_FALSE_ALARM = 1e-3


class FixedDrafter:
    """Drafts every position from one fixed distribution `q` with the request's own generator, and
    reports it as its logits, so the rule sees exactly what the drafts were drawn from."""

    window = 8  # hidden rows it keeps back (the real drafter's ring)

    def __init__(self, q: torch.Tensor):
        self.q = q

    def observe(self, state, hidden) -> None:
        state.length += hidden.size(0)

    def draft(self, states, tokens, temperature=0.0, generators=None) -> Draft:
        b = len(states)
        drafts = torch.stack([torch.multinomial(self.q, BLOCK, replacement=True, generator=g) for g in generators])
        return Draft(drafts, (self.q.log() * temperature).expand(b, BLOCK, -1).clone(), torch.zeros(b, BLOCK))


def drafter_near_the_target(core: InferenceCore, prompts: list[list[int]]) -> FixedDrafter:
    """q: how often plain sampling in process emits each token after a few prompts, with a uniform
    floor (about a quarter of first drafts are kept)."""
    seen = torch.zeros(VOCAB)
    gen = torch.Generator().manual_seed(99)
    with torch.inference_mode():
        for prompt in prompts[:8]:
            seq, logits = core.prefill(prompt, capacity=len(prompt) + NEW_TOKENS)
            for _ in range(NEW_TOKENS):
                token = int(sample_next(logits, SAMPLING, gen))
                seen[token] += 1
                logits = core.step(seq, [token])[-1]
            core.release(seq)
    q = 0.8 * seen / seen.sum() + 0.2 / VOCAB
    return FixedDrafter(q / q.sum())


def resample_from_target(target, draft, drafts, gen=None) -> list[int]:
    """A wrong rule: a rejected draft is replaced by a sample of the target row, not of the residual."""
    for i, token in enumerate(drafts):
        if float(torch.rand((), generator=gen)) * float(draft[i, token]) >= float(target[i, token]):
            return [*drafts[:i], int(torch.multinomial(target[i], 1, generator=gen))]
    return [*drafts, int(torch.multinomial(target[len(drafts)], 1, generator=gen))]


def target_rows(core: InferenceCore, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The row the target gives each of `tokens` [n, vocab]: after the prompt, then after each token."""
    with torch.inference_mode():
        seq, last = core.prefill(prompt, capacity=len(prompt) + len(tokens))
        rows = torch.cat([last.reshape(1, -1), core.step(seq, tokens[:-1])])
        core.release(seq)
    return target_probs(rows, SAMPLING)


def log_score_z(probs: torch.Tensor, tokens: torch.Tensor) -> float:
    logs = probs.clamp(min=1e-30).log()
    mean = (probs * logs).sum(-1)
    var = (probs * logs.square()).sum(-1) - mean.square()
    return float((logs.gather(1, tokens.unsqueeze(1)).squeeze(1) - mean).sum() / var.sum().sqrt())


def ks_statistic(probs: torch.Tensor, tokens: torch.Tensor, gen: torch.Generator) -> float:
    """Largest distance between the uniform distribution and that of the randomized transforms."""
    below = (probs.cumsum(-1) - probs).gather(1, tokens.unsqueeze(1)).squeeze(1)
    u = below + torch.rand(tokens.numel(), generator=gen) * probs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    u, n = u.double().sort().values, u.numel()
    ranks = torch.arange(1, n + 1, dtype=torch.float64)
    return float(torch.maximum(ranks / n - u, u - (ranks - 1) / n).max())


def sample_through_the_pipeline(prompts: list[list[int]]) -> list[tuple[list[int], m.Finished]]:
    root = short_dir()
    spec = with_overrides(pipeline_for("thread", root / "p", block_tokens=4096),
                          model={"config": "micro", "seed": 3, "checkpoint": None}, name="sampled",
                          generation={"request_timeout_s": 120.0})
    outputs = []
    try:
        with Supervisor(spec, root / "run") as supervisor:
            for start in range(0, len(prompts), AT_ONCE):
                outputs += generate_together(supervisor.peer, [
                    m.Generate(request_id=new_request_id(), ids=m.pack_ids(prompts[i]), max_new_tokens=NEW_TOKENS,
                               stop_at_eos=False, temperature=SAMPLING.temperature, top_p=SAMPLING.top_p, seed=1 + i)
                    for i in range(start, min(start + AT_ONCE, len(prompts)))])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return outputs


@pytest.mark.parametrize("rule", [accept_sampled, pytest.param(resample_from_target, marks=pytest.mark.slow)],
                         ids=["the-rule", "resampling-from-the-target"])
def test_sampled_tokens_through_the_speculative_pipeline_follow_the_target(monkeypatch, rule):
    gen = torch.Generator().manual_seed(17)
    lengths = torch.randint(4, 40, (REQUESTS,), generator=gen).tolist()
    prompts = [torch.randint(3, 300, (n,), generator=gen).tolist() for n in lengths]
    core = InferenceCore(random_model("micro", seed=3))
    drafter = drafter_near_the_target(core, prompts)
    monkeypatch.setattr(dspark_component, "_speculation", lambda context: (drafter, "fixed", BLOCK))
    monkeypatch.setattr(dspark_component, "accept_sampled", rule)
    outputs = sample_through_the_pipeline(prompts)
    drafted = sum(done.draft_tokens for _, done in outputs)
    accepted = sum(done.accepted_tokens for _, done in outputs)
    assert all(len(tokens) == NEW_TOKENS for tokens, _ in outputs)
    assert 0.03 * drafted < accepted < 0.5 * drafted  # drafts both kept and rejected (about 6 % kept here)
    rows = torch.cat([target_rows(core, prompt, tokens) for prompt, (tokens, _) in zip(prompts, outputs, strict=True)])
    tokens = torch.tensor([t for tokens, _ in outputs for t in tokens])
    z, ks = log_score_z(rows, tokens), ks_statistic(rows, tokens, torch.Generator().manual_seed(5))
    ks_limit = math.sqrt(-math.log(KS_FALSE_ALARM / 2) / 2 / tokens.numel())
    print(f"{rule.__name__}: log-score z {z:+.2f} (limit ±{Z_LIMIT}), KS {ks:.4f} (limit {ks_limit:.4f}); "
          f"{tokens.numel()} tokens, {accepted} of {drafted} drafts kept")
    follows = abs(z) < Z_LIMIT and ks < ks_limit
    assert follows == (rule is accept_sampled)
