"""The compiled index-scoring loop (`dsv41/kernels/cpu_index.py`) against the operators it stands in
for: the same bits for every key, whether the loop scores it or hands it back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsv41.kernels import cpu_index, torch_ops
from dsv41.kernels.layouts import index_k_format, pack_rows
from dsv41.model.quant import mxfp4_qdq


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _keys(rng: torch.Generator, sequences: int, n: int, dim: int, spread: int) -> torch.Tensor:
    """Packed index keys whose 32-channel blocks lie up to 2^spread apart in scale."""
    scale = torch.exp2(torch.randint(-spread, spread + 1, (sequences, n, dim // 32, 1), generator=rng).float())
    rows = (torch.randn(sequences, n, dim // 32, 32, generator=rng) * scale).flatten(-2)
    return pack_rows(rows, index_k_format(dim))


def _queries(rng: torch.Generator, b: int, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 queries, and head weights 2^-12 to 2^12 apart: their terms then need more than
    float32's 24 bits together, so the heads' summation order shows in the scores."""
    q = mxfp4_qdq(torch.randn(b, heads, dim, generator=rng) * 3).bfloat16()
    spread = torch.exp2(torch.randint(-12, 13, (b, heads), generator=rng).float())
    return q, (torch.randn(b, heads, generator=rng) * spread).bfloat16()


@pytest.mark.parametrize("heads", [1, 3, 4])
@pytest.mark.parametrize("threads", [1, 2])
def test_loop_scores_equal_the_operators(rng, heads, threads, monkeypatch):
    """Per-sequence keys and one pool expanded over the batch, whole ranges and id lists with
    unused (-1) slots, 1 and 2 threads: every score has the operators' bits, and the loop (not the
    operators' retry) scored nearly all. Up to 4 heads, the counts torch sums first to last."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(torch_ops, "INDEX_SPLIT_KEYS", 100)  # these few keys split over the threads too
    q, weights = _queries(rng, 3, heads, 128)
    for keys in (_keys(rng, 3, 700, 128, spread=2), _keys(rng, 1, 700, 128, spread=2).expand(3, -1, -1)):
        ids = torch.randint(-1, 700, (3, 900), generator=rng)
        for entry_ids in (None, ids):
            want = torch_ops._operator_index_scores(q, weights, keys, entry_ids)
            assert torch.equal(_bits(torch_ops.index_scores(q, weights, keys, entry_ids)), _bits(want))
        pool = keys[:1] if keys.stride(0) == 0 else keys
        scores, unsure = torch_ops._loop_scores(q, weights, pool, ids)  # the loop alone, no retry
        sure = unsure == 0
        assert sure.float().mean() > 0.99
        want = torch_ops._operator_index_scores(q, weights, keys, ids)
        assert torch.equal(_bits(scores[sure]), _bits(want[sure]))
    # terms of 2^25, -2^25 and ones, where another order of the heads would give other scores
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    q, weights, one_key = torch_ops._order_revealing(heads, 128, torch.Generator().manual_seed(seed))
    for n in (1, 5):
        keys = one_key[:1].expand(1, n, -1).contiguous()
        scores, unsure = torch_ops._loop_scores(q, weights, keys, torch.arange(n).expand(q.size(0), -1).contiguous())
        want = torch_ops._operator_index_scores(q, weights, keys.expand(q.size(0), -1, -1))
        assert not unsure.any() and torch.equal(_bits(scores), _bits(want))


@pytest.mark.parametrize("heads", [4, 5, 16, 32])
def test_the_loop_serves_only_where_it_sums_the_heads_in_torchs_order(rng, heads):
    """Head terms of 2^25, -2^25 and ones on random heads, where the summation order decides the
    score: wherever the probe lets the loop serve, the loop alone gives the operators' bits on
    them, at several key counts; and `index_scores` gives the operators' bits either way."""
    seed = int(torch.randint(0, 2**31, (1,), generator=rng))
    q, weights, one_key = torch_ops._order_revealing(heads, 128, torch.Generator().manual_seed(seed))
    serves = torch_ops._packed_loop_keeps_bits(heads, 128)
    for n in (1, 3, 8, 37):
        keys = one_key[:1].expand(1, n, -1).contiguous().expand(q.size(0), -1, -1)
        want = torch_ops._operator_index_scores(q, weights, keys)
        assert torch.equal(_bits(torch_ops.index_scores(q, weights, keys)), _bits(want))
        if serves:
            ids = torch.arange(n).expand(q.size(0), -1).contiguous()
            scores, unsure = torch_ops._loop_scores(q, weights, keys[:1], ids)
            assert not unsure.any() and torch.equal(_bits(scores), _bits(want))


def test_keys_the_loop_cannot_vouch_for_are_scored_by_the_operators(rng):
    """Keys whose blocks lie 2^40 apart in scale could sum inexactly in float32: the loop marks
    them, and the operators' scores take their place, bit for bit."""
    q, weights = _queries(rng, 2, 4, 128)
    near, far = _keys(rng, 1, 300, 128, spread=1), _keys(rng, 1, 300, 128, spread=40)
    keys = torch.cat([near, far], dim=1).expand(2, -1, -1)
    ids = torch.arange(600).expand(2, -1).contiguous()
    _, unsure = torch_ops._loop_scores(q, weights, keys, ids)
    assert not unsure[:, :300].any() and unsure[:, 300:].float().mean() > 0.5
    want = torch_ops._operator_index_scores(q, weights, keys)
    assert torch.equal(_bits(torch_ops.index_scores(q, weights, keys)), _bits(want))


def test_zero_heads_and_negative_dots_keep_their_bits(rng):
    """A head of zero queries, and heads whose every dot product is negative (ReLU to zero, times
    negative weights): zeros and their signs as the operators give them."""
    q, weights = _queries(rng, 2, 4, 128)
    q[0, 1] = 0
    q[1] = -q[1].abs()
    weights[1] = -weights[1].abs()
    keys = pack_rows(torch.rand(2, 500, 128, generator=rng) + 0.1, index_k_format(128))  # positive keys
    want = torch_ops._operator_index_scores(q, weights, keys)
    assert (want[1] == 0).all()
    assert torch.equal(_bits(torch_ops.index_scores(q, weights, keys)), _bits(want))


def test_scale_bounds_by_hand():
    """Queries below 2^1 in steps of 2^-1 over 4 blocks leave 13 - 2 = 11 for a key's scale spread;
    the unit 2^(-1 + s - 128) is normal from s = 3; a weight of 1 (below 2^1) caps the largest scale
    at 230 - 1 - 1. A head of zeros adds nothing; a subnormal weight raises the least scale."""
    q = np.zeros((2, 2, 128), np.float32)
    q[:, 0, :4] = [1.0, 0.5, -1.5, 0.5]
    weights = np.array([[1.0, 1.0], [2.0**-130, 1.0]], np.float32)
    bounds = np.empty((2, 3), np.int64)
    cpu_index.scale_bounds(q, weights, 4, bounds)
    assert bounds[0].tolist() == [11, 3, 228]
    # |2^-130| >= 2^-130, its lowest bit: the term's unit 2^(-1 + s - 128 - 130) is normal from s = 133
    assert bounds[1].tolist() == [11, 133, 229]


def test_non_finite_queries_and_weights_are_scored_by_the_operators(rng):
    """A NaN or infinite query value or head weight (a model that diverged) makes the loop vouch
    for nothing in that sequence: its scores are the operators', NaNs included, bit for bit, and
    the other sequence's keys are still the loop's."""
    q, weights = _queries(rng, 3, 4, 128)
    q[0, 1, 5] = float("nan")
    weights[1, 2] = float("inf")
    keys = _keys(rng, 1, 300, 128, spread=2).expand(3, -1, -1)
    _, unsure = torch_ops._loop_scores(q, weights, keys[:1], torch.arange(300).expand(3, -1).contiguous())
    assert unsure[:2].all() and not unsure[2].any()
    want = torch_ops._operator_index_scores(q, weights, keys)
    assert want[0].isnan().any()
    assert torch.equal(_bits(torch_ops.index_scores(q, weights, keys)), _bits(want))


def _products(rng: torch.Generator, b: int, s: int, heads: int, t: int) -> torch.Tensor:
    """bf16 dot products [b, s, heads, t] with negatives, zeros of both signs, and values far apart."""
    spread = torch.exp2(torch.randint(-20, 20, (b, s, heads, t), generator=rng).float())
    dots = (torch.randn(b, s, heads, t, generator=rng) * spread).bfloat16()
    dots[..., ::5] = 0.0
    dots[..., 2::9] = -0.0
    return dots


@pytest.mark.parametrize("heads", [1, 3, 4])
@pytest.mark.parametrize("threads", [1, 2])
def test_head_sums_of_several_tokens_equal_the_operators(rng, heads, threads, monkeypatch):
    """`weighted_head_sums` (a prompt chunk's or a verification's scores from its GEMM's products)
    gives the operators' ReLU, weights and head sum bit for bit: rows split over threads or not,
    products padded by the GEMM (a strided view), weights of both signs far apart, and terms of
    2^25, -2^25 and ones where another order of the heads would give other sums."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    monkeypatch.setattr(torch_ops, "HEAD_SUMS_SPLIT", 1)
    assert torch_ops._head_sums_keep_bits(heads)
    for b, s, t in ((1, 1, 7), (1, 5, 300), (2, 3, 1029)):
        dots = _products(rng, b, s, heads, t)
        weights = (torch.randn(b, s, heads, generator=rng) * torch.exp2(torch.randint(-8, 9, (b, s, heads),
                                                                                       generator=rng))).bfloat16()
        padded = torch.cat([dots, torch.zeros(b, s, heads, 5, dtype=torch.bfloat16)], dim=-1)[..., :t]
        for products in (dots, padded):
            want = torch_ops._operator_head_sums(products, weights)
            assert torch.equal(_bits(torch_ops.weighted_head_sums(products, weights)), _bits(want)), (b, s, t)
    ones = torch.ones(1, 32, heads, 3, dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,), generator=rng)))
    weights = torch.ones(1, 32, heads)
    for row in range(32):
        chosen = torch.randperm(heads, generator=generator)[:2]
        weights[0, row, chosen[0]], weights[0, row, chosen[-1]] = 2.0**25, -(2.0**25)
    want = torch_ops._operator_head_sums(ones, weights.bfloat16())
    assert torch.equal(_bits(torch_ops.weighted_head_sums(ones, weights.bfloat16())), _bits(want))


def test_head_sums_with_non_finite_products_or_weights_are_the_operators(rng):
    """An infinite or NaN product or head weight (a model that diverged): the loop hands the call
    back (a NaN's sign and payload are the hardware's, which torch's vector code and the loop need
    not share), and the scores are the operators', NaNs and infinities bit for bit."""

    def loop_takes(dots: torch.Tensor, weights: torch.Tensor) -> bool:
        return torch_ops._loop_head_sums(dots, weights, split=False) is not None

    dots = _products(rng, 1, 4, 4, 200)
    weights = torch.randn(1, 4, 4, generator=rng).bfloat16()
    assert loop_takes(dots, weights)
    for row, head, key, value in ((1, 2, 17, "inf"), (3, 0, 5, "nan")):
        bad = dots.clone()
        bad[0, row, head, key] = float(value)
        assert not loop_takes(bad, weights)
        want = torch_ops._operator_head_sums(bad, weights)
        assert not want.isfinite().all()
        assert torch.equal(_bits(torch_ops.weighted_head_sums(bad, weights)), _bits(want))
    weights[0, 2, 1] = float("nan")
    assert not loop_takes(dots, weights)
    want = torch_ops._operator_head_sums(dots, weights)
    assert torch.equal(_bits(torch_ops.weighted_head_sums(dots, weights)), _bits(want))
