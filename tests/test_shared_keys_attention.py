"""The opt-in prefill attention over shared keys (DSV41_FAST_ATTENTION=1) against the reference
order of `sparse_attention`: the same online softmax, only the sums in another order."""

from __future__ import annotations

import pytest
import torch

from dsv41.kernels import torch_ops


def _inputs(rng, b=2, m=150, h=4, d=64, n=400, k=200):
    """Queries that read a window of 64 neighbouring rows and 136 drawn ones each (so a block's
    queries share keys, as in a prefill), some slots unused, one query with none at all; queries
    scaled up so that the chunks' maxima differ and the online rescaling matters."""
    q = (torch.randn(b, m, h, d, generator=rng) * 3).bfloat16()
    kv = torch.randn(b, n, d, generator=rng).bfloat16()
    sink = torch.randn(h, generator=rng)
    window = (torch.arange(m).view(m, 1) * (n - 64) // m + torch.arange(64)).expand(b, m, 64)
    drawn = torch.randint(0, n, (b, m, k - 64), generator=rng)
    idx = torch.cat([window, drawn], dim=-1)
    idx = torch.where(torch.rand(b, m, k, generator=rng) < 0.1, -1, idx).int()
    idx[0, 7] = -1
    return q, kv, sink, idx


def _attention(monkeypatch, fast: str, *args) -> torch.Tensor:
    monkeypatch.setenv("DSV41_FAST_ATTENTION", fast)
    with torch.inference_mode():
        return torch_ops.sparse_attention(*args, 64**-0.5)


def within_one_bf16_step_and_rarely_moved(got: torch.Tensor, want: torch.Tensor) -> None:
    step = 2.0 ** (torch.floor(torch.log2(want.float().abs().clamp_min(2**-30))) - 7)  # one bf16 step
    # an output that cancels to a millionth of its row keeps the fp32 error of the row's sums
    row = 2**-16 * want.float().abs().amax(dim=-1, keepdim=True)
    assert bool(((got.float() - want.float()).abs() <= torch.maximum(step, row)).all())
    assert float((got != want).float().mean()) <= 0.01


def test_shared_keys_move_an_output_by_one_bf16_step_at_most_and_rarely(monkeypatch, rng):
    q, kv, sink, idx = _inputs(rng)
    want = _attention(monkeypatch, "0", q, kv, sink, idx)
    calls = []
    shared = torch_ops._shared_keys_attention
    monkeypatch.setattr(torch_ops, "_shared_keys_attention", lambda *a: calls.append(1) or shared(*a))
    got = _attention(monkeypatch, "1", q, kv, sink, idx)
    assert len(calls) == q.size(0)
    within_one_bf16_step_and_rarely_moved(got, want)
    assert torch.equal(got[0, 7], want[0, 7])  # no keys: zeros, as the reference gives


def test_blocks_over_the_shared_keys_limit_go_in_place_within_one_bf16_step(monkeypatch, rng):
    """Every block over the limit: the reference's logits, the weighted sums by the compiled loop
    (on any number of threads the same bits: each query's sums are its own)."""
    q, kv, sink, idx = _inputs(rng, m=70)
    want = _attention(monkeypatch, "0", q, kv, sink, idx)
    monkeypatch.setattr(torch_ops, "SHARED_KEYS_LIMIT", 0)
    calls = []
    in_place = torch_ops._in_place_attention
    monkeypatch.setattr(torch_ops, "_in_place_attention", lambda *a: calls.append(1) or in_place(*a))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        got = _attention(monkeypatch, "1", q, kv, sink, idx)
        torch.set_num_threads(3)
        assert torch.equal(_attention(monkeypatch, "1", q, kv, sink, idx), got)
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 2 * 2 * 2  # two sequences of two blocks, twice
    within_one_bf16_step_and_rarely_moved(got, want)
    assert torch.equal(got[0, 7], want[0, 7])
    empty = idx[..., :0]  # no index at all: the sink alone, zeros
    none = _attention(monkeypatch, "0", q, kv, sink, empty)
    assert torch.equal(_attention(monkeypatch, "1", q, kv, sink, empty), none)


def test_distinct_ids_and_places_equal_torch_unique(rng):
    for n in (1, 7, 300):
        ids = torch.randint(-1, n, (int(torch.randint(1, 50, (), generator=rng)), 9), generator=rng)
        distinct, place = torch_ops.distinct_ids(ids, n)
        used = ids >= 0
        want, want_place = torch.unique(ids[used], return_inverse=True)
        assert torch.equal(distinct, want) and torch.equal(place[used], want_place)
        assert bool((place[~used] == -1).all())
    distinct, place = torch_ops.distinct_ids(torch.full((2, 3), -1), 5)
    assert distinct.numel() == 0 and bool((place == -1).all())


def test_the_switch_takes_0_or_1_only(monkeypatch, rng):
    q, kv, sink, idx = _inputs(rng, m=10)
    with pytest.raises(ValueError, match=r"DSV41_FAST_ATTENTION='on': use 0 \(reference numerics\) or 1"):
        _attention(monkeypatch, "on", q, kv, sink, idx)
