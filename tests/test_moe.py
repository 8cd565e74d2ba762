"""Routed experts grouped by expert (steps of 2..GROUPED_MAX_TOKENS tokens: batched decode, DSpark
verification, short chunks) against the per-expert loop: the same bits in every numerics mode,
including after a weight changes under the stacked-weight cache."""

from __future__ import annotations

import pytest
import torch

from dsv41.checkpoint import load_model
from dsv41.model import moe as moe_module
from dsv41.model.layers import quantize_rows
from dsv41.model.numerics import stable_numerics

from .conftest import skip_where_the_gemm_sums_blocks_otherwise


@pytest.fixture(scope="module")
def moes() -> list[moe_module.MoE]:
    model, _ = load_model("small")
    model.eval()
    return [m for m in model.modules() if isinstance(m, moe_module.MoE)]


def _both(moe: moe_module.MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = moe.gate(x)
    quantized = quantize_rows(x)
    return moe._routed_per_expert(x, weights, ids, quantized), moe._routed_grouped(x, weights, ids, quantized)


@pytest.mark.parametrize("fast_gemm", ["0", "1"])
@pytest.mark.parametrize("stable", [False, True])
def test_grouped_experts_give_the_per_expert_bits(moes, rng, monkeypatch, fast_gemm, stable):
    """Steps where every expert has tokens and steps where some have none (empty runs)."""
    monkeypatch.setenv("DSV41_FAST_GEMM", fast_gemm)
    all_in_use = set()
    with stable_numerics(stable), torch.inference_mode():
        for moe in (moes[0], moes[-1]):
            for n in (2, 7, moe_module.GROUPED_MAX_TOKENS):
                x = (torch.randn(n, moe.dim, generator=rng) * torch.rand(n, 1, generator=rng) * 4).bfloat16()
                want, got = _both(moe, x)
                assert torch.equal(want.view(torch.int32), got.view(torch.int32)), n
                all_in_use.add(torch.unique(moe.gate(x)[1]).numel() == len(moe.experts))
    assert all_in_use == {False, True}


def _with_operators(moe: moe_module.MoE, x: torch.Tensor, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(moe, "_tokens_by_loops", lambda *_: None)
        return moe(x)


@pytest.mark.parametrize("limit", [None, 0.0, 0.05])
def test_tokens_by_loops_give_the_operators_bits(moes, rng, monkeypatch, limit):
    """A decode step's tokens (1, 2, 7 and the most the loops take) through the routed and shared
    experts in the compiled loops: the bits of the operators (per expert for one token, grouped for
    more) for tokens small and large (the clamps bite), with the model's clamp, none, and a tight
    one, in the first and the last layer; and the loops (not the operators) gave them."""
    inter = moes[0].shared_experts.w1.out_features
    dim = moes[0].dim
    skip_where_the_gemm_sums_blocks_otherwise([(dim, inter), (dim, 2 * inter), (inter, dim)])
    served = []
    for moe in (moes[0], moes[-1]):
        loops = moe._tokens_by_loops
        monkeypatch.setattr(moe, "_tokens_by_loops", lambda *a, _f=loops: served.append(_f(*a)) or served[-1])
        if limit is not None:
            for expert in [*moe.experts, moe.shared_experts]:
                monkeypatch.setattr(expert, "limit", limit)
            monkeypatch.setattr(moe, "_uniform_experts", None)
        with torch.inference_mode():
            for trial in range(12):
                n = (1, 1, 2, 7, moe_module.GROUPED_MAX_TOKENS)[trial % 5]
                scale = torch.rand(1, n, 1, generator=rng) * 8
                x = (torch.randn(1, n, moe.dim, generator=rng) * scale).bfloat16()
                want, got = _with_operators(moe, x, monkeypatch), moe(x)
                assert torch.equal(want.view(torch.int16), got.view(torch.int16)), (trial, n)
    assert len(served) == 24 and all(y is not None for y in served)


def test_token_loops_hand_a_non_finite_activation_to_the_operators(moes, rng, monkeypatch):
    """A hidden activation the FP8 quantizer cannot take in the loop (an infinity from a huge
    token) makes the loops step back: the operators' result, NaN and all, comes out."""
    moe = moes[0]
    x = torch.randn(1, 3, moe.dim, generator=rng).bfloat16()
    x[0, 1, :8] = 3e38
    with torch.inference_mode():
        weights, ids = moe.gate(x.view(3, -1))
        assert moe._tokens_by_loops(weights, ids, quantize_rows(x.view(3, -1))) is None
        want, got = _with_operators(moe, x, monkeypatch), moe(x)
    assert torch.equal(want.view(torch.int16), got.view(torch.int16))


def test_forward_groups_short_steps_only_and_rebuilds_stacks_after_a_weight_change(moes, rng, monkeypatch):
    """Where the compiled loops do not serve, steps of 2 to 64 tokens take the grouped experts;
    after a weight changes, the grouped experts and the loops (which read the same stacks) both
    compute with the new weight."""
    moe = moes[1]
    calls = []
    grouped = moe._routed_grouped
    monkeypatch.setattr(moe, "_routed_grouped", lambda *a: calls.append(a[0].size(0)) or grouped(*a))
    with torch.inference_mode(), monkeypatch.context() as patch:
        patch.setattr(moe, "_tokens_by_loops", lambda *_: None)
        for n in (1, 8, moe_module.GROUPED_MAX_TOKENS + 1):
            moe(torch.randn(1, n, moe.dim, generator=rng).bfloat16())
    assert calls == [8]
    with torch.inference_mode():
        x = torch.randn(12, moe.dim, generator=rng).bfloat16()
        before = _both(moe, x)[1]
        by_loops = moe(x[None])
        w1 = moe.experts[int(moe.gate(x)[1][0, 0])].w1
        saved = w1.weight.clone()
        try:
            w1.weight.copy_(torch.roll(saved, 1, dims=0))  # another expert's worth of values
            want, got = _both(moe, x)
            assert torch.equal(want, got) and not torch.equal(got, before)
            changed = moe(x[None])
            assert torch.equal(changed, _with_operators(moe, x[None], monkeypatch))
            assert not torch.equal(changed, by_loops)
        finally:
            w1.weight.copy_(saved)
        assert torch.equal(_both(moe, x)[1], before) and torch.equal(moe(x[None]), by_loops)


def test_an_expert_changed_while_unused_is_restacked_when_a_step_routes_to_it(moes, rng, monkeypatch):
    """The stacks check only the experts a step uses: an expert whose weight changes while steps
    route around it keeps its old slice until a step routes a token to it, and that step (the
    loops, one token) computes with the new weight, as the operators do."""
    moe = moes[0]
    with torch.inference_mode():
        tokens = (torch.randn(64, moe.dim, generator=rng) * 2).bfloat16()
        routes = moe.gate(tokens)[1]
        first = tokens[:1]
        unused = next(e for e in range(len(moe.experts)) if e not in routes[0].tolist() and (routes == e).any())
        later = tokens[int((routes == unused).any(dim=1).nonzero()[0])].view(1, 1, -1)
        before_first, before_later = moe(first[None]), moe(later)
        w2 = moe.experts[unused].w2
        saved = w2.weight.clone()
        try:
            w2.weight.copy_(torch.roll(saved, 1, dims=0))
            assert torch.equal(moe(first[None]), before_first)  # not routed: nothing to recompute
            changed = moe(later)
            assert not torch.equal(changed, before_later)
            assert torch.equal(changed, _with_operators(moe, later, monkeypatch))
        finally:
            w2.weight.copy_(saved)
        assert torch.equal(moe(later), before_later)


def test_gate_scores_by_sequence_equal_each_sequence_alone(rng):
    """With `sizes`, each sequence of a multi-token batch gets the router weights and experts it
    gets alone, bit for bit; odd sizes put a sequence's last scores in the tail that torch's scalar
    code computes (whose softplus differs from the vector code's in the last bits on some CPUs)."""
    from dsv41.model.moe import Gate

    gate = Gate(64, 8, 2, 2.5, "sqrtsoftplus", False)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(8, 64, generator=rng).bfloat16())
        gate.bias.copy_(torch.randn(8, generator=rng) * 0.01)
    # (the whole batch's scores: a case in 15 differs here); equal sizes score the batch in one call
    for sizes in [[3, 64], [5, 1, 7], [64, 3], [1] * 8, [5] * 6, [2] * 33] * 10:
        x = (torch.randn(sum(sizes), 64, generator=rng) * 3).bfloat16()
        weights, ids = gate(x, sizes=sizes)
        alone = [gate(part.contiguous()) for part in x.split(sizes)]
        assert torch.equal(weights, torch.cat([w for w, _ in alone]))
        assert torch.equal(ids, torch.cat([i for _, i in alone]))
