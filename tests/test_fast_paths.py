"""The opt-in fast GEMM (DSV41_FAST_GEMM=1) and prefill attention over shared keys
(DSV41_FAST_ATTENTION=1) on the default model, whose linears sum six or more 32-element blocks:
the logits of a prefill and of teacher-forced decode steps stay within the parity policy of the
reference numerics, and a greedy token may differ only at a near tie. (Products of FP8 and FP4
values are exact in fp32 and their sums mostly are too, so the two orders often give the same
bits; the golden data is checked in tests/test_parity.py.)"""

from __future__ import annotations

import pytest
import torch

from dsv41.checkpoint import load_model
from dsv41.engine.core import InferenceCore
from dsv41.kernels import torch_ops
from dsv41.model import layers, moe
from dsv41.model.numerics import opt_in, stable_numerics
from dsv41.parity import FLOAT_TOLERANCE, compare, top2_gap


def _logits(core: InferenceCore, prompt: list[int], forced: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        seq, logits = core.prefill(prompt, capacity=len(prompt) + len(forced) + 1, packed=True)
        rows = [logits.float()]
        rows += [core.step(seq, [token])[-1].float() for token in forced]
        core.release(seq)
    return torch.stack(rows)


def _routed_logits(core: InferenceCore, prompt: list[int], forced: list[int], monkeypatch):
    """The logits, and every router call's biased scores and chosen experts, in call order."""
    calls = []
    forward = moe.Gate.forward

    def recorded(gate, x, image_mask=None, sizes=None):
        weights, ids = forward(gate, x, image_mask, sizes)
        calls.append((gate.scores(x) + gate.bias, ids.sort(dim=-1).values, gate.topk))
        return weights, ids

    with monkeypatch.context() as patch:
        patch.setattr(moe.Gate, "forward", recorded)
        return _logits(core, prompt, forced), calls


def _first_routing_flip(want_calls, got_calls):
    """(scores the reference routed, scores the fast run routed, token, top-k) at the first router
    call whose experts differ, or None."""
    for (want_scores, want_ids, k), (got_scores, got_ids, _) in zip(want_calls, got_calls, strict=True):
        differs = (want_ids != got_ids).any(dim=-1)
        if differs.any():
            return want_scores, got_scores, int(differs.nonzero()[0]), k
    return None


# prompt tokens per case: the attention's takes three blocks of shared keys (64 queries each)
PROMPT = {"DSV41_FAST_GEMM": 40, "DSV41_FAST_ATTENTION": 150}


@pytest.mark.parametrize(("fast", "in_place"), [("DSV41_FAST_GEMM", False), ("DSV41_FAST_ATTENTION", False),
                                              ("DSV41_FAST_ATTENTION", True)])
def test_fast_path_stays_within_the_parity_policy_on_small(fast, in_place, monkeypatch, rng):
    """Three random prompts, each within the policy, or else (one of them at most) moved by an
    expert choice that flipped on a near tie: at the first router call whose experts differ, the
    flipped token's scores in the fast run are within the policy of the reference's, and the
    reference's k-th and (k+1)-th scores of it within the policy of each other. About 1 % of random
    prompts flip so with the fast GEMM, and their logits then end 1.6-9 % of the scale away (4 in
    300 seeds); with the shared-keys attention none of 30 150-token prompts left the policy (one of
    15 300-token prompts did, by such a flip)."""
    model, _ = load_model("small")
    model.eval()
    core = InferenceCore(model)
    vocab = model.config.text_config.vocab_size
    draw = lambda n: torch.randint(3, vocab, (n,), generator=rng).tolist()  # noqa: E731
    cases = [(draw(PROMPT[fast]), draw(6)) for _ in range(3)]
    wants = [_routed_logits(core, prompt, forced, monkeypatch) for prompt, forced in cases]
    monkeypatch.setenv(fast, "1")
    shared_runs = []
    if fast == "DSV41_FAST_GEMM":
        def refuse(*args):
            raise AssertionError("the block-by-block GEMM ran in fast mode")

        monkeypatch.setattr(layers, "block_scaled_matmul", refuse)
    else:
        shared = torch_ops._shared_keys_attention
        monkeypatch.setattr(torch_ops, "_shared_keys_attention", lambda *a: shared_runs.append(1) or shared(*a))
        if in_place:  # every block as one over the shared-keys limit: logits gathered, sums in place
            in_place_attention = torch_ops._in_place_attention
            monkeypatch.setattr(torch_ops, "SHARED_KEYS_LIMIT", 0)
            monkeypatch.setattr(torch_ops, "_in_place_attention",
                                lambda *a: shared_runs.append(1) or in_place_attention(*a))
    flipped_away = 0
    for (prompt, forced), (want, want_calls) in zip(cases, wants, strict=True):
        got, got_calls = _routed_logits(core, prompt, forced, monkeypatch)
        row = compare("fast", "logits", got, want)
        if not (row.passed and row.rel <= FLOAT_TOLERANCE):
            flip = _first_routing_flip(want_calls, got_calls)
            assert flip is not None, f"no expert choice flipped, yet {row.rel:.3g} of the scale away"
            want_scores, got_scores, token, k = flip
            scale = float(want_scores[token].abs().max())
            assert float((got_scores[token] - want_scores[token]).abs().max()) <= FLOAT_TOLERANCE * scale
            ranked = want_scores[token].sort(descending=True).values
            assert float(ranked[k - 1] - ranked[k]) <= FLOAT_TOLERANCE * scale
            flipped_away += 1
            continue
        flipped = got.argmax(-1) != want.argmax(-1)
        assert bool((top2_gap(want)[flipped] <= FLOAT_TOLERANCE * float(want.abs().max())).all())
    assert flipped_away <= 1, f"{flipped_away} of 3 prompts moved by a flipped expert choice"
    assert fast == "DSV41_FAST_GEMM" or shared_runs


def test_a_fast_path_switch_takes_0_or_1_and_stays_off_where_it_must(monkeypatch):
    monkeypatch.setenv("DSV41_FAST_GEMM", "yes")
    with pytest.raises(ValueError, match=r"DSV41_FAST_GEMM='yes': use 0 \(reference numerics\) or 1"):
        opt_in("DSV41_FAST_GEMM", "one GEMM per quantized linear")
    monkeypatch.setenv("DSV41_FAST_GEMM", "1")
    with torch.inference_mode():
        assert opt_in("DSV41_FAST_GEMM", "x")
        with stable_numerics():  # the exact oracle numerics win
            assert not opt_in("DSV41_FAST_GEMM", "x")
    assert not opt_in("DSV41_FAST_GEMM", "x")  # autograd on: training keeps the reference GEMM
    monkeypatch.delenv("DSV41_FAST_GEMM")
    with torch.inference_mode():
        assert not opt_in("DSV41_FAST_GEMM", "x")
