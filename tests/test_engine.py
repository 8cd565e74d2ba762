"""The inference core against the oracle. Paths are compared in shape-stable numerics
(`model/numerics.py`), where a position's result does not depend on its chunk, so equality is exact."""

import msgspec
import pytest
import torch

from dsv41.engine.core import InferenceCore, PromptChunk
from dsv41.model.numerics import stable_numerics
from dsv41.model.reference import random_model


@pytest.fixture(scope="module")
def mini():
    return random_model("mini", seed=5)


def _prompt(rng, n):
    return torch.randint(3, 320, (n,), generator=rng).tolist()


def _oracle(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("n", [5, 8, 23, 61])
def test_full_and_exact_prefill_give_the_reference_logits_and_continuation(micro, rng, n):
    core = InferenceCore(micro, chunk_size=6)
    ids, more = _prompt(rng, n), _prompt(rng, 5)
    with stable_numerics():
        ref = _oracle(micro, ids + more)
        for mode in ("full", "exact"):
            seq, last = core.prefill(ids, mode)
            assert torch.equal(last, ref[n - 1]), mode
            assert torch.equal(core.step(seq, more[:2]), ref[n : n + 2]), mode
            for i, token in enumerate(more[2:]):
                assert torch.equal(core.step(seq, [token])[0], ref[n + 2 + i]), mode


def test_greedy_continuations_of_full_and_exact_match_the_reference(micro, rng):
    core = InferenceCore(micro, chunk_size=16)
    ids = _prompt(rng, 40)
    with stable_numerics():
        expected, seq_ids = [], list(ids)
        for _ in range(12):
            seq_ids.append(int(_oracle(micro, seq_ids)[-1].argmax()))
            expected.append(seq_ids[-1])
        for mode in ("full", "exact"):
            seq, logits = core.prefill(ids, mode)
            got = []
            for _ in range(12):
                got.append(int(logits.argmax()))
                logits = core.step(seq, [got[-1]])[0]
            assert got == expected, mode


def test_ced_equals_the_reference_when_the_prompt_fits_the_window(micro, rng):
    ids = _prompt(rng, micro.config.text_config.sliding_window)
    with stable_numerics():
        seq, last = InferenceCore(micro, chunk_size=3).prefill(ids, "ced")
        assert torch.equal(last, _oracle(micro, ids)[-1])


@pytest.mark.slow  # shape-stable numerics on mini take about a minute per 140-token forward
def test_mini_prefill_past_the_window_is_exact_in_chunks_of_127_128_129(mini, rng):
    ids = _prompt(rng, 140)
    with stable_numerics():
        ref = _oracle(mini, ids)[-1]
        for chunk in (127, 128, 129):
            _, last = InferenceCore(mini, chunk_size=chunk).prefill(ids, "full")
            assert torch.equal(last, ref), chunk


@pytest.mark.parametrize("chunk", [1, 2, 5, 8, 9])
def test_chunked_prefill_equals_one_shot(micro, rng, chunk):
    ids = _prompt(rng, 29)  # odd: a half ratio-2 pair is pending at most chunk boundaries
    with stable_numerics():
        ref = _oracle(micro, ids)[-1]
        _, last = InferenceCore(micro, chunk_size=chunk).prefill(ids, "full")
        assert torch.equal(last, ref)


def test_ced_counts_w_decoder_layer_tokens_per_layer_and_exact_the_staircase(mini, rng):
    ids = _prompt(rng, 300)
    core = InferenceCore(mini, chunk_size=150)
    seq, _ = core.prefill(ids, "ced")
    assert seq.counters.decoder_layer_tokens == 128 * 20 == seq.counters.replayed_layer_tokens
    assert seq.counters.encoder_layer_tokens == 300 * 20
    seq, _ = core.prefill(ids, "exact")
    # layer 20 + j runs from max(0, n - W - (19 - j)(W - 1)): here every layer from 0 down to
    # position 300 - 128 - 127 = 45 at layer 38
    starts = [max(0, 300 - 128 - (19 - j) * 127) for j in range(20)]
    assert seq.counters.decoder_layer_tokens == sum(300 - s for s in starts)


def test_verifying_k_tokens_equals_k_single_steps_and_rollback_forgets_them(micro, rng):
    core = InferenceCore(micro, chunk_size=8)
    ids, draft = _prompt(rng, 21), _prompt(rng, 4)
    with stable_numerics():
        seq_a, _ = core.prefill(ids, "full")
        together = core.step(seq_a, draft)
        seq_b, _ = core.prefill(ids, "full")
        one_by_one = torch.stack([core.step(seq_b, [t])[0] for t in draft])
        assert torch.equal(together, one_by_one)
        seq, _ = core.prefill(ids, "full")
        saved = core.checkpoint(seq)
        core.step(seq, draft)  # verified, then all rejected
        core.rollback(seq, saved)
        after_rollback = core.step(seq, [draft[0] ^ 1, 7, 9])
        fresh, _ = core.prefill(ids, "full")
        assert torch.equal(after_rollback, core.step(fresh, [draft[0] ^ 1, 7, 9]))


def test_bad_requests_are_refused(micro):
    core = InferenceCore(micro)
    with pytest.raises(ValueError, match="unknown prefill mode 'fast'"):
        core.prefill([1, 2], "fast")
    with pytest.raises(ValueError, match="at least one token"):
        core.prefill([], "ced")
    with pytest.raises(ValueError, match="exceeds the context limit of 8"):
        core.prefill(list(range(3, 12)), "ced", capacity=8)
    with pytest.raises(ValueError, match="chunk size must be at least 1"):
        InferenceCore(micro, chunk_size=0)


def test_encoder_replay_from_stored_blocks(micro, rng):
    from dsv41.model.cache import export_blocks
    from dsv41.storage.blockfmt import BlockLayout

    core, layout = InferenceCore(micro, chunk_size=5), BlockLayout.of(micro.config, 4)
    ids = _prompt(rng, 30)
    with stable_numerics():
        seq, plain = core.prefill(ids, "ced", packed=True)
        # a prefix within the window: replay rebuilds the encoder's SWA state exactly
        blocks = export_blocks(seq.cache, layout, 0, 2)
        hit, logits = core.prefill_from_prefix(ids, blocks, layout)
        assert torch.equal(logits, plain)
        assert export_blocks(hit.cache, layout, 0, 2) == blocks  # cached global KV never rewritten
        assert hit.counters.encoder_layer_tokens == 30 * 4  # 8 replayed + 22 new, 4 encoder layers
        # a longer prefix: bounded replay of its last W tokens, cached entries byte-identical
        blocks = export_blocks(seq.cache, layout, 0, 5)
        hit, logits = core.prefill_from_prefix(ids, blocks, layout)
        assert export_blocks(hit.cache, layout, 0, 5) == blocks
        assert hit.counters.encoder_layer_tokens == (8 + 10) * 4
        assert torch.isfinite(logits).all()
        more = core.step(hit, [5, 6])  # and decoding continues from the rebuilt state
        assert more.shape == (2, 320) and torch.isfinite(more).all()
    with pytest.raises(ValueError, match="needs a longer prompt"):
        core.prefill_from_prefix(ids[:8], export_blocks(seq.cache, layout, 0, 2), layout)


def test_counters_of_scored_entries_and_bytes_held(micro, rng):
    core = InferenceCore(micro, chunk_size=64)
    seq, _ = core.prefill(_prompt(rng, 40), "ced")
    t = micro.config.text_config
    scored = seq.counters.indexer_scored
    assert scored["full"] == 40 * 20  # one chunk: 40 queries x 20 ratio-2 entries (the causal mask comes after)
    assert scored["full, pool source"] == 8 * 40  # the replayed last W queries over 40 ratio-1 entries
    assert scored["reindex"] <= 8 * t.candidate_topk_blocks * t.candidate_block_size
    # this cache holds bf16 rows (micro: 64-d main KV, 32-d index key, 64-d ring rows)
    assert seq.cache.global_kv_bytes_held() == (40 // 2 + 40) * (64 + 32) * 2
    assert seq.cache.swa_bytes_held() == 8 * 8 * 64 * 2
    packed, _ = core.prefill(_prompt(rng, 40), "ced", packed=True)  # packed entries: FP4 + scales, FP8 rings
    entry = (64 // 2 + 64 // 16) + (32 // 2 + 32 // 32)
    assert packed.cache.global_kv_bytes_held() == (40 // 2 + 40) * entry
    assert packed.cache.swa_bytes_held() == 8 * 8 * (64 + 2)


def test_a_second_request_reuses_the_first_ones_stored_global_kv(micro, rng, tmp_path):
    from dsv41.engine.prefix_cache import CachedPrefill
    from dsv41.storage.blockfmt import BlockLayout
    from dsv41.storage.policy import PrefixCachePolicy
    from dsv41.storage.prefix import Fingerprint
    from dsv41.storage.store import GlobalKVStore, StoreConfig
    from dsv41.storage.swa_pool import SWAPool

    layout = BlockLayout.of(micro.config, 4)
    store = GlobalKVStore(tmp_path / "kv", layout, StoreConfig(capacity_bytes=2**24))
    policy = PrefixCachePolicy(store, SWAPool(2**20), Fingerprint.of(micro.config, "seed-1"), block_size=4)
    cached = CachedPrefill(InferenceCore(micro, chunk_size=6), policy)
    turn1 = _prompt(rng, 22)
    turn2 = turn1 + _prompt(rng, 9)
    try:
        with stable_numerics():
            first = cached.prefill(turn1)
            assert first.cached_tokens == 0 and first.stored_blocks == 5  # 5 complete blocks of 4
            second = cached.prefill(turn2)
            assert second.cached_tokens == 20 and second.stored_blocks == 2
            # the loaded blocks are byte-identical to what the first request computed
            assert store.get_copy(policy.keys(turn2)[4]) == store.get_copy(policy.keys(turn1)[4])
            # the first request pooled the encoder rings at position 20: no replay, and exact
            assert second.sequence.counters.encoder_layer_tokens == 11 * 4
            assert torch.equal(second.logits, cached.core.prefill(turn2, "ced", packed=True)[1])
            # a suffix shorter than W needs encoder outputs of the prefix: encoder replay instead
            third = cached.prefill(turn2 + _prompt(rng, 2))
            assert third.cached_tokens == 28 and third.sequence.counters.encoder_layer_tokens == (8 + 5) * 4
            restarted = CachedPrefill(cached.core, PrefixCachePolicy(store, SWAPool(2**20), policy.fingerprint, 4))
            fourth = restarted.prefill(turn1 + _prompt(rng, 12))  # an empty pool (a restart, a TTL): replay
            assert fourth.cached_tokens == 20 and fourth.sequence.counters.encoder_layer_tokens == (8 + 14) * 4
        other = PrefixCachePolicy(store, SWAPool(2**20), policy.fingerprint, block_size=8)
        with pytest.raises(ValueError, match="block layout does not match"):
            CachedPrefill(InferenceCore(micro), other)
    finally:
        store.close()


@pytest.mark.parametrize("packed", [False, True])
def test_one_step_batched_over_sequences_of_different_lengths_equals_separate_steps(micro, rng, packed):
    """Prompts shorter and longer than W, one to three tokens each (several sequences extending
    their windows by verification-sized steps in the same batch, beside one-token steps), eight
    rounds of greedy decoding; afterwards every SWA ring holds the same bytes."""
    core = InferenceCore(micro, chunk_size=16)
    prompts = [_prompt(rng, n) for n in (5, 13, 40)]
    with stable_numerics():
        alone = [core.prefill(ids, "ced", packed=packed) for ids in prompts]
        batched = [core.prefill(ids, "ced", packed=packed) for ids in prompts]
        next_tokens = [[int(logits.argmax())] for _, logits in alone]
        for round_ in range(8):
            step = [tokens + _prompt(rng, (round_ + i) % 3) for i, tokens in enumerate(next_tokens)]
            expected = [core.step(seq, tokens) for (seq, _), tokens in zip(alone, step, strict=True)]
            got = core.step_batch([seq for seq, _ in batched], step)
            for e, g in zip(expected, got, strict=True):
                assert torch.equal(e, g), f"round {round_}: max diff {(e - g).abs().max()}"
            next_tokens = [[int(e[-1].argmax())] for e in expected]
    for (a, _), (b, _) in zip(alone, batched, strict=True):
        assert a.cache.length == b.cache.length and a.counters == b.counters
        for layer, ring in a.cache.windows.items():
            assert torch.equal(ring.data, b.cache.windows[layer].data), layer


@pytest.mark.parametrize("packed", [False, True])
def test_one_token_steps_batched_equal_each_alone_in_default_numerics(micro, rng, packed):
    """The official numerics (not shape-stable): four sequences stepping one token each as one
    batch get the logits each gets alone, bit for bit, over twenty greedy rounds. The fp32 GEMMs
    (mHC mixes, router, head) run per sequence: a single row is summed in another order than
    beside others on some CPUs (MKL on AVX2), which moved every logit in the last bits."""
    _one_token_steps_batched_equal_each_alone(micro, rng, packed)


@pytest.mark.parametrize("seed", [1623182245, 6])
def test_one_token_steps_batched_equal_each_alone_at_seeds_that_failed_on_an_amx_cpu(micro, seed):
    """The seeds that exposed two row-count dependences on an AMX Xeon: a one-row FP8 block GEMM
    summed by MKL's matrix-vector kernel (1623182245, round 1 off by 0.57), and an attention table
    cut to a batch's widest row (6, round 3 off by 0.67). Fixed inputs, packed caches."""
    _one_token_steps_batched_equal_each_alone(micro, torch.Generator().manual_seed(seed), packed=True)


def _one_token_steps_batched_equal_each_alone(micro, rng, packed: bool) -> None:
    core = InferenceCore(micro, chunk_size=16)
    prompts = [_prompt(rng, n) for n in (9, 21, 30, 44)]
    alone = [core.prefill(ids, "ced", capacity=80, packed=packed)[0] for ids in prompts]
    batched = [core.prefill(ids, "ced", capacity=80, packed=packed)[0] for ids in prompts]
    tokens = _prompt(rng, len(prompts))
    for round_ in range(20):
        expected = [core.step(seq, [token]) for seq, token in zip(alone, tokens, strict=True)]
        got = core.step_batch(batched, [[token] for token in tokens])
        for i, (e, g) in enumerate(zip(expected, got, strict=True)):
            assert torch.equal(e, g), f"round {round_}, sequence {i}: max diff {(e - g).abs().max()}"
        tokens = [int(e[-1].argmax()) for e in expected]


def test_batched_decode_entries_and_selection_equal_the_per_sequence_path(rng, monkeypatch):
    """A batch writes its new global entries for all sequences at once (`Attention._emit_batch_entries`,
    one token each or several), and one decode token per sequence selects its index entries for
    the whole batch (`Attention._select_batch`); in default numerics that must store and pick what
    the per-sequence path does, rows tied at the k-th place included (they take the official top-k
    of their own row), so the logits and the scored-entry counters are the same bits."""
    from dsv41.checkpoint import load_model
    from dsv41.model import attention

    model, _ = load_model("small")
    model.eval()
    core = InferenceCore(model)
    vocab = model.config.text_config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=rng).tolist() for n in (4, 60, 130, 170, 210, 260)]
    extra_seed = int(torch.randint(0, 2**31, (1,), generator=rng))  # the tokens added in odd rounds

    def run() -> tuple[list[torch.Tensor], list[dict]]:
        seqs = [core.prefill(ids, capacity=320, packed=True) for ids in prompts]
        tokens = [[int(logits.argmax())] for _, logits in seqs]
        rows, extra = [], torch.Generator().manual_seed(extra_seed)
        for round_ in range(8):  # odd rounds step 1-3 tokens per sequence, as a verification does
            tokens = [ids + torch.randint(3, vocab, ((round_ + i) % 3 * (round_ % 2),), generator=extra).tolist()
                      for i, ids in enumerate(tokens)]
            out = core.step_batch([seq for seq, _ in seqs], tokens)
            rows += out
            tokens = [[int(logits[-1].argmax())] for logits in out]
        counters = [dict(seq.counters.indexer_scored) for seq, _ in seqs]
        for seq, _ in seqs:
            core.release(seq)
        return rows, counters

    tied_rows = []
    official_pick = attention.Attention._official_pick
    monkeypatch.setattr(attention.Attention, "_official_pick",
                        lambda self, *a: tied_rows.append(1) or official_pick(self, *a))
    batched = run()
    assert tied_rows, "no row was tied at the k-th place: the test lost its point"
    monkeypatch.setattr(attention.Attention, "_select_batch", lambda self, parts, query: None)

    def emit_one_by_one(self, x, table, parts, sizes):
        for part, mine in zip(parts, x.split(sizes, dim=1), strict=True):
            self._produce_entries(mine, table, part)

    monkeypatch.setattr(attention.Attention, "_emit_batch_entries", emit_one_by_one)
    alone = run()
    assert batched[1] == alone[1]
    for got, want in zip(batched[0], alone[0], strict=True):
        assert torch.equal(got, want)


def test_decode_picks_made_from_the_scored_entries_equal_torchs_picks_of_full_rows(micro, rng, monkeypatch):
    """Past k * 64 entries (512 on `micro`) a decode step's picks come from `cpu_topk`'s loop over
    the scored entries (a Full layer's row and a Reindex layer's candidate pool), not from torch's
    top-k of the full-width row. Batched steps of three long sequences must give the logits of
    each sequence stepped alone with torch ranking every full row."""
    from dsv41.kernels import cpu_topk, selection
    from dsv41.model import attention

    core = InferenceCore(micro)
    prompts = [_prompt(rng, n) for n in (1040, 1100, 1180)]

    def run() -> list[torch.Tensor]:
        seqs = [core.prefill(ids, capacity=len(ids) + 8, packed=True)[0] for ids in prompts]
        rows, tokens = [], [[3 + i] for i in range(len(seqs))]
        for _ in range(4):
            out = core.step_batch(seqs, tokens)
            rows += out
            tokens = [[int(logits[-1].argmax())] for logits in out]
        for seq in seqs:
            core.release(seq)
        return rows

    dense = []
    loop = cpu_topk.sparse_row_pick
    monkeypatch.setattr(cpu_topk, "sparse_row_pick", lambda *a: dense.append(a[2]) or loop(*a))
    with torch.inference_mode():
        picked = run()
        assert True in dense and False in dense, "no Full row or no candidate pool went through the loop"
        monkeypatch.setattr(attention.Attention, "_select_batch", lambda self, parts, query: None)
        monkeypatch.setattr(attention, "sparse_pick_serves", lambda *a: False)
        monkeypatch.setattr(selection, "sparse_pick_serves", lambda *a: False)  # a tied pool's row built too
        dense.clear()
        ranked = run()
    assert not dense
    for got, want in zip(picked, ranked, strict=True):
        assert torch.equal(got, want)


def _assert_same_bits(alone: list, batched: list, alone_seqs: list, batched_seqs: list) -> None:
    """Every output, counter and SWA ring of the batched run is the alone run's, bit for bit."""
    for want, got in zip(alone, batched, strict=True):
        assert torch.equal(want, got), f"max diff {(want.float() - got.float()).abs().max()}"
    for a, b in zip(alone_seqs, batched_seqs, strict=True):
        assert a.counters == b.counters
        for layer, ring in a.cache.windows.items():
            assert torch.equal(ring.data, b.cache.windows[layer].data), layer


def _drive_prefills(core: InferenceCore, prompts: list[list[int]], modes: list[str], batched: bool):
    """CED/exact prefills of `prompts` driven chunk by chunk: each prompt's chunks alone, one prompt
    after another, or every prompt's next chunk in one `encode_chunks` batch; then the decoder
    replays and three batched decode steps. Returns the logits and the sequences."""
    seqs, steps, done = [], [], {}
    for ids, mode in zip(prompts, modes, strict=True):
        seq, _ = core.new_sequence(ids, len(ids) + 8, packed=True)
        seqs.append(seq)
        steps.append(core.encode_prompt_steps(seq, torch.tensor([ids]), mode == "exact"))
    pending = {i: next(gen) for i, gen in enumerate(steps)}
    while pending:
        keys = list(pending) if batched else [next(iter(pending))]
        for key, result in zip(keys, core.encode_chunks([pending[k] for k in keys]), strict=True):
            try:
                pending[key] = steps[key].send(result)
            except StopIteration as finished:
                done[key] = finished.value
                del pending[key]
    logits = [core.decoder_replay(seq, *done[i], len(prompts[i])) for i, seq in enumerate(seqs)]
    for round_ in range(3):
        logits += core.step_batch(seqs, [[3 + round_ + i] for i in range(len(seqs))])
    return logits, seqs


@pytest.mark.parametrize("chunk", [16, 64])
def test_prompt_chunks_of_several_prefills_in_one_batch_equal_each_prompt_alone(rng, chunk):
    """The encoder runs the pending chunks of several prompts as one batch (first chunks, later
    ones whose entries are written as a batch, prompts of one chunk beside prompts of many, ced and
    exact). In default numerics the logits, the SWA rings and the counters are the same bits as
    prefilling each prompt alone."""
    _check_prompt_chunks(rng, chunk)


def test_prompt_chunks_in_one_batch_on_the_prompts_that_showed_the_gates_place_dependence():
    """The prompts of seed 866239529: on an AVX-512 CPU, with the mHC and Engram gates computed over
    the whole batch, their third 64-token chunk beside a 3-token one got other last bits than alone
    (torch's sigmoid takes vector or scalar code by an element's place; docs/engine.md)."""
    _check_prompt_chunks(torch.Generator().manual_seed(866239529), 64)


def _check_prompt_chunks(rng: torch.Generator, chunk: int) -> None:
    from dsv41.checkpoint import load_model

    model, _ = load_model("small")
    model.eval()
    core = InferenceCore(model, chunk_size=chunk)
    vocab = model.config.text_config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=rng).tolist() for n in (9, 58, 131, 200)]
    modes = ["ced", "exact", "ced", "ced"]
    with torch.inference_mode():
        alone, alone_seqs = _drive_prefills(core, prompts, modes, batched=False)
        batched, batched_seqs = _drive_prefills(core, prompts, modes, batched=True)
    _assert_same_bits(alone, batched, alone_seqs, batched_seqs)


def test_a_batch_of_prompt_chunks_takes_one_per_sequence_and_a_replay_alone(micro, rng):
    core = InferenceCore(micro, chunk_size=8)
    ids = _prompt(rng, 20)
    seq, _ = core.new_sequence(ids, 40)
    chunk = next(core.encode_prompt_steps(seq, torch.tensor([ids]), False))
    with pytest.raises(ValueError, match="one chunk per sequence"):
        core.encode_chunks([chunk, chunk])
    other, _ = core.new_sequence(ids, 40)
    replay = PromptChunk(other, torch.tensor([ids]), 0, 8, 0, replay=True)
    with pytest.raises(ValueError, match="a replay alone"):
        core.encode_chunks([chunk, replay])


def test_decoder_replays_of_several_prompts_in_one_batch_equal_each_alone(rng):
    """`ced` decoder replays of prompts shorter and longer than W run as one batch: each prompt's
    logits, DSpark input, SWA rings and counters are the bits of its replay alone, and the decode
    steps after them agree; an `exact` replay (a staircase of starts) is refused in a batch."""
    from dsv41.checkpoint import load_model
    from dsv41.engine.core import Replay

    model, _ = load_model("small")
    model.eval()
    core = InferenceCore(model, chunk_size=64)
    vocab = model.config.text_config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=rng).tolist() for n in (5, 58, 130, 200)]

    def run(batched: bool):
        seqs, encoded, out = [], [], []
        with torch.inference_mode():
            for ids in prompts:
                seq, _ = core.new_sequence(ids, len(ids) + 8, packed=True)
                seqs.append(seq)
                encoded.append(core.encode_prompt(seq, torch.tensor([ids]), False))
            replays = [Replay(seq, *enc, len(ids)) for seq, enc, ids in zip(seqs, encoded, prompts, strict=True)]
            if batched:
                results = core.decoder_replays(replays)
            else:
                results = []
                for r in replays:
                    targets: list[torch.Tensor] = []
                    results.append((core.decoder_replay(r.seq, r.x, r.pre_mix, r.starts, r.n, targets), targets))
            for logits, targets in results:
                out += [logits, core.replay_hidden(targets)]
            for round_ in range(2):
                out += core.step_batch(seqs, [[3 + round_ + i] for i in range(len(seqs))])
        return out, seqs

    alone, alone_seqs = run(False)
    batched, batched_seqs = run(True)
    _assert_same_bits(alone, batched, alone_seqs, batched_seqs)
    seq, _ = core.new_sequence(prompts[3], 220, packed=True)
    exact = Replay(seq, *core.encode_prompt(seq, torch.tensor([prompts[3]]), True), len(prompts[3]))
    with pytest.raises(ValueError, match="each starting every layer at once"):
        core.decoder_replays([exact])


def test_warm_up_leaves_no_pages_and_changes_no_result(micro, rng):
    from dsv41.model.pages import PagePools

    ids = _prompt(rng, 40)
    cold = InferenceCore(micro)
    seq, expected = cold.prefill(ids, packed=True)
    expected_step = cold.step(seq, [7])
    warm = InferenceCore(micro)
    stepped: list[int] = []
    step = warm.step
    warm.step = lambda seq, tokens: stepped.append(len(tokens)) or step(seq, tokens)
    warm.warm_up()
    del warm.step
    # a decode step and a DSpark verification's step: the first request's loops are compiled before it
    assert stepped == [1, micro.config.text_config.dspark_block_size + 1]
    assert warm.pages_in_use == 0
    seq, logits = warm.prefill(ids, packed=True)
    assert torch.equal(logits, expected) and torch.equal(warm.step(seq, [7]), expected_step)
    tiny = InferenceCore(micro, pools=PagePools(max_pages=1))
    tiny.warm_up()  # a pool too small for the throwaway sequence is left alone
    assert tiny.pages_in_use == 0
    text = msgspec.structs.replace(micro.config.text_config, max_position_embeddings=8, dspark_block_size=8)
    short = InferenceCore(random_model(msgspec.structs.replace(micro.config, text_config=text)))
    calls: list[str] = []
    short.prefill = lambda *args, **kwargs: calls.append("prefill")
    short.step = lambda seq, tokens: calls.append("step")
    short.warm_up()  # a context too short for a prompt and a verification is left alone too
    assert calls == [] and short.pages_in_use == 0


def test_prompt_chunks_and_replays_beside_a_decode_step_equal_each_alone(rng):
    """Continuous batching's mixed pass: the pending prompt chunks run in the encoder pass of a
    batched decode step (`encode_batch`), and the finished prompts' decoder replays in its decoder
    pass (`decode_batch`). In default numerics every step's logits and DSpark input, every
    replay's, the SWA rings and the counters are the bits of the same work run apart."""
    from dsv41.checkpoint import load_model
    from dsv41.engine.core import Replay

    model, _ = load_model("small")
    model.eval()
    vocab = model.config.text_config.vocab_size
    decoding_prompts = [torch.randint(3, vocab, (n,), generator=rng).tolist() for n in (9, 70, 33)]
    new_prompts = [torch.randint(3, vocab, (n,), generator=rng).tolist() for n in (40, 130, 5)]
    first_tokens = torch.randint(3, vocab, (len(decoding_prompts),), generator=rng).tolist()

    def run(mixed: bool):
        core = InferenceCore(model, chunk_size=64)
        out = []
        with torch.inference_mode():
            decoding = [core.prefill(ids, "ced", capacity=len(ids) + 16, packed=True)[0] for ids in decoding_prompts]
            prefilling, pending = [], {}
            for i, ids in enumerate(new_prompts):
                seq, _ = core.new_sequence(ids, len(ids) + 8, packed=True)
                steps = core.encode_prompt_steps(seq, torch.tensor([ids]), False)
                prefilling.append((seq, steps))
                pending[i] = next(steps)
            tokens = [[t] for t in first_tokens]
            for _ in range(4):
                keys = list(pending)
                starts = [seq.cache.length for seq in decoding]
                if mixed:
                    results, (x, pre_mix) = core.encode_batch([pending[k] for k in keys], decoding, tokens)
                else:
                    results = core.encode_chunks([pending[k] for k in keys]) if keys else []
                    x, pre_mix = core.encode_tokens_batch(decoding, tokens)
                replays = []
                for key, result in zip(keys, results, strict=True):
                    try:
                        pending[key] = prefilling[key][1].send(result)
                    except StopIteration as finished:
                        del pending[key]
                        seq = prefilling[key][0]
                        replays.append(Replay(seq, *finished.value, len(new_prompts[key])))
                sizes = [1] * len(decoding)
                if mixed:
                    replayed, (logits, hidden) = core.decode_batch(replays, decoding, x, pre_mix, starts, sizes)
                else:
                    replayed = core.decoder_replays(replays) if replays else []
                    logits, hidden = core.decode_streams_batch(decoding, x, pre_mix, starts, sizes)
                for replay_logits, targets in replayed:
                    out += [replay_logits, core.replay_hidden(targets)]
                out += logits + hidden
                tokens = [[int(step[-1].argmax())] for step in logits]
        return out, decoding + [seq for seq, _ in prefilling]

    apart, apart_seqs = run(False)
    mixed, mixed_seqs = run(True)
    assert len(apart) == 4 * 2 * len(decoding_prompts) + 2 * len(new_prompts)  # every prompt finished
    _assert_same_bits(apart, mixed, apart_seqs, mixed_seqs)
