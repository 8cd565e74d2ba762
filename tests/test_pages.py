"""Global KV in fixed-size pages: the pool, one sequence's page table, and the core's sequences
sharing one pool (pages interleaved) giving exactly what each sequence gives alone."""

import copy

import pytest
import torch

from dsv41.components.sequences import Sequences, model_core
from dsv41.engine.core import InferenceCore
from dsv41.kernels.layouts import index_k_format, main_kv_format, quantize_dequantize
from dsv41.model.pages import PagedEntries, PagePool, PagePools, PoolFull


def _prompt(rng, n):
    return torch.randint(3, 320, (n,), generator=rng).tolist()


def test_pool_hands_out_reuses_and_limits_pages():
    pool = PagePool(index_k_format(64), packed=True, page_entries=4, max_pages=5)
    first = pool.take(3)
    assert len(set(first)) == 3 and pool.pages_in_use == 3
    pool.give(first[1:2])
    assert pool.pages_in_use == 2
    again = pool.take(3)
    assert first[1] in again and pool.pages_in_use == 5
    with pytest.raises(PoolFull, match="page pool is full: 5 of 5 pages in use, 1 more asked for"):
        pool.take(1)
    assert pool.pages_in_use == 5  # a refused request takes nothing


@pytest.mark.parametrize("packed", [False, True])
def test_entries_across_page_boundaries_read_back_as_written(rng, packed):
    pools = PagePools(page_entries=4)
    fmt = main_kv_format(64)
    a, b = PagedEntries(pools.pool(fmt, packed), 40), PagedEntries(pools.pool(fmt, packed), 40)
    values = torch.randn(1, 23, 64, generator=rng).bfloat16()
    other = torch.randn(1, 23, 64, generator=rng).bfloat16()
    for rows in (slice(0, 3), slice(3, 10), slice(10, 23)):  # a and b alternate: their pages interleave
        a.write(rows, values[:, rows])
        b.write(rows, other[:, rows])
    assert len(a.pages) == len(b.pages) == 6 and set(a.pages).isdisjoint(b.pages)
    assert torch.equal(a.read(slice(0, 23)), quantize_dequantize(values, fmt))
    assert torch.equal(b.read(slice(5, 23)), quantize_dequantize(other, fmt)[:, 5:])
    ids = torch.tensor([[22, 0, -1, 7, 4]])
    assert torch.equal(a.gather(ids)[:, [0, 1, 3, 4]], a.read(slice(0, 23))[:, [22, 0, 7, 4]])
    assert a.physical(ids)[0, 2] == -1
    for rows in (slice(6, 13), slice(8, 8), slice(0, 24)):  # a span's rows (broadcast) are the per-id lookup's
        assert torch.equal(a.raw(rows), a.pool.rows[0, a.physical(torch.arange(rows.start, rows.stop))])
    stored = b.raw(slice(2, 9))
    a.put_raw(13, stored)
    assert torch.equal(a.raw(slice(13, 20)), stored) and torch.equal(a.raw(slice(0, 13)), a.raw(slice(0, 24))[:13])
    with pytest.raises(IndexError, match="entries up to 25 asked of 24 held"):
        a.read(slice(20, 25))
    with pytest.raises(ValueError, match="41 main KV entries exceed the sequence's room for 40"):
        a.write(slice(23, 41), torch.randn(1, 18, 64).bfloat16())
    a.keep(9)  # entries 0..8 need three pages
    assert len(a.pages) == 3 and torch.equal(a.read(slice(0, 9)), quantize_dequantize(values, fmt)[:, :9])


def test_rows_of_the_first_entries_from_the_page_tables_equal_a_lookup_per_id(rng):
    """`physical_of_first` (one broadcast over the page tables) names the pool rows `physical_of`
    finds id by id, for every entry each store holds; stores of different lengths, pages interleaved."""
    pools = PagePools(page_entries=4)
    fmt = index_k_format(64)
    stores = [PagedEntries(pools.pool(fmt, True), 64) for _ in range(3)]
    lengths = [int(n) for n in torch.randint(1, 40, (3,), generator=rng)]
    for step in range(max(lengths)):  # one entry each in turn: the stores' pages interleave
        for store, n in zip(stores, lengths, strict=True):
            if step < n:
                store.reserve(step + 1)
    width = max(lengths)
    ids = torch.arange(width).expand(3, -1)
    ids = torch.where(ids < torch.tensor(lengths).unsqueeze(1), ids, -1)
    want = PagedEntries.physical_of(stores, ids)
    got = PagedEntries.physical_of_first(stores, width)
    assert got.shape == want.shape
    assert torch.equal(got[ids >= 0], want[ids >= 0])


@pytest.mark.parametrize("packed", [False, True])
def test_sequences_sharing_small_pages_equal_each_sequence_alone(micro, rng, packed):
    """Pages of 2 entries, three sequences prefilled and stepped in turn (their pages interleave):
    every logit equals the same sequence run alone with pages of 128 entries."""
    shared = InferenceCore(micro, chunk_size=5, pools=PagePools(page_entries=2))
    prompts = [_prompt(rng, n) for n in (7, 19, 30)]
    steps = [_prompt(rng, 6) for _ in prompts]
    seqs, got = [], []
    for ids in prompts:
        seq, logits = shared.prefill(ids, "ced", packed=packed)
        seqs.append(seq)
        got.append([logits])
    for i in range(6):
        for seq, out, tokens in zip(seqs, got, steps, strict=True):
            out.append(shared.step(seq, [tokens[i]])[0])
    for ids, tokens, out in zip(prompts, steps, got, strict=True):
        alone = InferenceCore(micro, chunk_size=5)
        seq, logits = alone.prefill(ids, "ced", packed=packed)
        expected = [logits] + [alone.step(seq, [t])[0] for t in tokens]
        assert all(torch.equal(a, b) for a, b in zip(out, expected, strict=True))


def _expected_pages(core: InferenceCore, length: int) -> int:
    size = core.pools.page_entries
    return sum(2 * -(-(length // layer.spec.ratio) // size) for layer in core.model.layers
               if layer.spec.layer_id in {lay.spec.kv_owner for lay in core.model.layers if lay.spec.ratio})


def test_pages_in_use_follow_the_tokens_held_rollback_and_release(micro, rng):
    core = InferenceCore(micro, chunk_size=8, pools=PagePools(page_entries=4))
    seq, _ = core.prefill(_prompt(rng, 13), "ced", packed=True)
    assert seq.counters.pages_in_use == _expected_pages(core, 13) == seq.cache.pages_in_use() > 0
    other, _ = core.prefill(_prompt(rng, 21), "full", packed=True)
    assert core.pages_in_use == _expected_pages(core, 13) + _expected_pages(core, 21)
    saved = core.checkpoint(seq)
    core.step(seq, _prompt(rng, 5))  # 18 positions: the ratio-1 groups need a fifth page
    assert seq.counters.pages_in_use == _expected_pages(core, 18) > _expected_pages(core, 13)
    core.rollback(seq, saved)
    assert seq.counters.pages_in_use == _expected_pages(core, 13)
    core.release(seq)
    assert seq.counters.pages_in_use == 0 and core.pages_in_use == _expected_pages(core, 21)
    allocated = sum(p.storage.size(0) for p in core.pools.pools.values())
    reused, _ = core.prefill(_prompt(rng, 13), "ced", packed=True)  # takes the freed pages, no new ones
    assert sum(p.storage.size(0) for p in core.pools.pools.values()) == allocated
    assert core.pages_in_use == _expected_pages(core, 13) + _expected_pages(core, 21)
    core.release(reused)
    core.release(other)
    assert core.pages_in_use == 0


def test_a_dropped_component_sequence_gives_its_pages_back(micro, rng):
    clock = [0.0]
    core = InferenceCore(micro, chunk_size=8)
    sequences = Sequences(idle_s=5.0, clock=lambda: clock[0])
    for rid in (1, 2):
        sequences.add(rid, core.prefill(_prompt(rng, 11), "ced", packed=True)[0])
    held = core.pages_in_use
    release, listed = sequences.get(1).cache.release, []
    sequences.get(1).cache.release = lambda: listed.append(1 in sequences) or release()
    sequences.pop(1)  # released by its owner
    assert 0 < core.pages_in_use < held
    # listed until its pages are back: another thread never sees it gone with its pages held
    assert listed == [True] and 1 not in sequences
    clock[0] = 10.0
    assert sequences.sweep() == 1  # the other one went idle
    assert core.pages_in_use == 0


def test_a_full_pool_refuses_work_before_changing_any_state(micro, rng):
    """Pages are taken before computing: a prefill or a step that cannot get them raises PoolFull,
    holds no new state, and the same step succeeds once pages are free, equal to a run that never
    hit the limit."""
    core = InferenceCore(micro, chunk_size=8, pools=PagePools(page_entries=4))
    free = InferenceCore(micro, chunk_size=8, pools=PagePools(page_entries=4))
    ids, other, tokens = _prompt(rng, 15), _prompt(rng, 9), _prompt(rng, 3)
    seq, _ = core.prefill(ids, "ced", packed=True)
    reference, _ = free.prefill(ids, "ced", packed=True)
    for pool in core.pools.pools.values():  # every pool exactly full
        pool.max_pages = pool.pages_in_use
    held = core.pages_in_use
    with pytest.raises(PoolFull, match="page pool is full"):
        core.prefill(other, "ced", packed=True)
    assert core.pages_in_use == held
    length, counters = seq.cache.length, copy.deepcopy(seq.counters)
    with pytest.raises(PoolFull):
        core.step(seq, tokens)  # positions 15..17 need a fifth page in the ratio-1 groups
    assert seq.cache.length == length and seq.counters == counters
    for pool in core.pools.pools.values():
        pool.max_pages = None
    assert torch.equal(core.step(seq, tokens), free.step(reference, tokens))


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "many"])
def test_a_components_kv_pages_option_must_be_a_positive_integer(bad):
    class Context:  # what model_core reads before it builds anything
        def option(self, component, key, default):
            return bad if (component, key) == ("decoder", "kv_pages") else default

    with pytest.raises(ValueError, match=f"components.decoder.options.kv_pages must be a positive integer, "
                                         f"got {bad!r}"):
        model_core(Context(), "decoder")
