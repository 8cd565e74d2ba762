"""`selection.untied_topk` (one top-k and a comparison pass) against what it stands in for: a
second top-k of k + 1 for the tie test, and the fixed-policy set for rows without a tie; and
`selection.official_pick` (torch's pick of a mostly -inf row, made by `cpu_topk` from the scored
places alone) against torch's top-k of the built row."""

from __future__ import annotations

import pytest
import torch

from dsv41.kernels import cpu_topk, selection
from dsv41.kernels.selection import official_pick, official_topk, topk_entries, untied_topk


def _tied_by_second_topk(scores: torch.Tensor, k: int) -> torch.Tensor:
    if scores.size(-1) <= k:
        return torch.zeros(scores.shape[:-1], dtype=torch.bool)
    best = scores.float().topk(k + 1, dim=-1).values
    return (best[..., k - 1] == best[..., k]) & best[..., k].isfinite()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("levels", [7, 40, 100_000])
def test_untied_topk_matches_a_second_topk_and_the_fixed_policy(rng, levels, dtype):
    """Rows drawn from few values (ties everywhere) to many (ties rare), some with a tail of
    unused entries at -inf (a tie there is no tie), k below and above the row width; bf16 rows
    (compared by their bits) and float32 ones (by value)."""
    for width, k in ((300, 17), (300, 299), (300, 300), (50, 64), (4096, 512)):
        scores = (torch.randint(0, levels, (6, width), generator=rng).float() / levels - 0.5).to(dtype)
        scores[1, width // 2 :] = -torch.inf
        scores[2, :] = -torch.inf
        scores[3, k // 2 :] = -torch.inf
        ids, tied = untied_topk(scores, k)
        assert torch.equal(tied, _tied_by_second_topk(scores, k)), (width, k)
        assert ids.shape == (6, min(k, width)) and (ids.diff(dim=-1) > 0).all()
        fixed = topk_entries(scores, min(k, width))
        for row in (~tied).nonzero().flatten().tolist():
            # one set, unless the ties lie at -inf (unused entries, any of which callers mask)
            kept = scores[row, ids[row]]
            assert torch.equal(kept.sort().values, scores[row, fixed[row]].sort().values)
            if bool(kept.isfinite().all()):
                assert torch.equal(ids[row], fixed[row])
    assert tied.any() or levels > 1000  # the few-valued rows do have ties


def test_a_tied_rows_pick_is_the_official_pick_of_that_row_alone(rng):
    """Rows of a batch with ties at the k-th place: the ids untied_topk returns for each are what
    `official_topk` picks on that row alone (the official row, as wide as the batch's)."""
    scores = (torch.randint(0, 30, (4, 5000), generator=rng).float() / 30).bfloat16()
    # a row's k-th place may fall on a level's last entry; make the next best equal to it
    order = scores.float().topk(513, dim=-1).indices
    rows = torch.arange(4)
    scores[rows, order[:, 512]] = scores[rows, order[:, 511]]
    ids, tied = untied_topk(scores, 512)
    assert tied.all()
    for row in range(4):
        assert torch.equal(ids[row], official_topk(scores[row : row + 1].clone(), 512)[0])


def test_ties_at_zero_count_both_zeros():
    """bf16 scores compare by their bits: +0 and -0 must still count as one value (a k-th place
    at zero tied with a -0 outside the k best)."""
    scores = torch.tensor([[3.0, 0.0, 2.0, -0.0, -1.0], [3.0, -0.0, 2.0, -1.0, 0.0]]).bfloat16()
    ids, tied = untied_topk(scores, 3)
    assert tied.tolist() == [True, True]
    assert torch.equal(tied, _tied_by_second_topk(scores, 3))
    untied = torch.tensor([[3.0, 0.0, 2.0, -1.0, -2.0]]).bfloat16()
    assert not untied_topk(untied, 3)[1].any()


def _built_row(scores: torch.Tensor, positions: torch.Tensor, width: int) -> torch.Tensor:
    row = torch.full((1, width), -torch.inf, dtype=scores.dtype)
    row[0, positions] = scores
    return row


@pytest.mark.parametrize("levels", [3, 20, 5000])
def test_official_pick_from_the_scored_places_is_torchs_pick_of_the_built_row(rng, levels, monkeypatch):
    """Rows of few score levels (the k-th place tied in nearly every row) to many, scored at every
    place (a full-range row) or at a few ascending ones (a candidate pool, its unused ids -1 last),
    with -inf, +0 and -0 among the scores: the loop's pick is the ids torch's top-k keeps on the
    row built in full, for k where torch ranks by partial sort (k * 64 <= width) and below it,
    where the row is built and ranked by torch."""
    assert selection._sparse_pick_matches_torch()  # this machine's torch picks as the loop does
    calls = []
    loop = cpu_topk.sparse_row_pick
    monkeypatch.setattr(cpu_topk, "sparse_row_pick", lambda *a: calls.append(a[2]) or loop(*a))
    for width, scored, k in ((4096, 4096, 64), (40000, 40000, 512), (70001, 3000, 512), (40000, 700, 512),
                             (9000, 9000, 512), (9000, 900, 512)):
        positions = torch.randperm(width, generator=rng)[:scored].sort().values
        scores = (torch.randint(0, levels, (scored,), generator=rng).float() / levels - 0.5).bfloat16()
        scores[torch.randint(0, scored, (scored // 50,), generator=rng)] = -torch.inf
        scores[torch.randint(0, scored, (scored // 50,), generator=rng)] = -0.0
        want = official_topk(_built_row(scores, positions, width), k)[0]
        padded = torch.cat([positions, torch.full((7,), -1)])
        got = official_pick(torch.cat([scores, torch.zeros(7).bfloat16()]), padded, width, k)
        assert torch.equal(got, want), (width, scored, k)
        if scored == width:
            assert torch.equal(official_pick(scores, None, width, k), want)
    assert True in calls and False in calls  # both kinds of row went through the loop
    assert len(calls) == 6  # ... and only where torch ranks by partial sort


def test_official_pick_hands_back_rows_the_loop_cannot_rank(rng):
    """A NaN among the scores, or positions that do not ascend: the loop declines, and the pick is
    torch's on the built row all the same."""
    width, k = 40000, 512
    positions = torch.randperm(width, generator=rng)[:5000].sort().values
    scores = torch.randn(5000, generator=rng).bfloat16()
    scores[1234] = torch.nan
    assert selection._loop_pick(scores, positions, k) is None
    want = official_topk(_built_row(scores, positions, width), k)[0]
    assert torch.equal(official_pick(scores, positions, width, k), want)
    scores[1234] = 0.5
    shuffled = positions.clone()
    shuffled[[10, 11]] = shuffled[[11, 10]]
    assert selection._loop_pick(scores, shuffled, k) is None
    assert selection._loop_pick(scores, positions, k) is not None
