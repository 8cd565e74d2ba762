"""The quality benchmark's metric functions compute what they claim (micro config, random weights)."""

from __future__ import annotations

import math

import torch

from benchmarks.ced_error import greedy
from benchmarks.quality import (
    bf16_global_kv,
    bits_per_byte,
    compare,
    continuation,
    goals,
    nats_per_char_to_bits_per_byte,
    nll,
    perplexity,
    summarise,
    windows,
)
from dsv41.engine.core import InferenceCore
from dsv41.model.numerics import stable_numerics
from dsv41.model.reference import random_model


def test_perplexity_of_a_uniform_distribution_is_the_vocabulary_size():
    vocab, n = 37, 11
    loss = nll(torch.zeros(n, vocab), torch.randint(0, vocab, (n,)))
    assert math.isclose(loss, n * math.log(vocab), rel_tol=1e-6)
    assert math.isclose(perplexity(loss, n), vocab, rel_tol=1e-6)


def test_bits_per_byte_conversions():
    assert math.isclose(bits_per_byte(100 * math.log(2), 100), 1.0)
    assert math.isclose(bits_per_byte(8 * math.log(2), 4), 2.0)
    assert math.isclose(nats_per_char_to_bits_per_byte(1.47), 1.47 / math.log(2))
    assert round(nats_per_char_to_bits_per_byte(1.47), 3) == 2.121


def test_compare_counts_agreement_and_ratio():
    ref, test = (64 * math.log(2.0), [1, 2, 3, 4], [5, 6, 7, 8]), (64 * math.log(2.2), [1, 2, 9, 4], [5, 0, 7, 8])
    row = compare(ref, test, 64)
    assert math.isclose(row["ppl_ref"], 2.0) and math.isclose(row["ppl"], 2.2)
    assert math.isclose(row["ppl_ratio"], 1.1)
    assert row["greedy_agreement"] == 0.75 and row["common_prefix"] == 2 and row["forced_agreement"] == 0.75
    rows = [{"length": 8, "tokens": 4, "nll_ref": 4.0, "nll": 4.4, "greedy_agreement": 1.0, "forced_agreement": 1.0},
            {"length": 8, "tokens": 4, "nll_ref": 4.0, "nll": 4.0, "greedy_agreement": 0.5, "forced_agreement": 0.5}]
    pooled = summarise(rows, "length")
    assert math.isclose(pooled[0]["ppl_ratio"], math.exp(0.4 / 8)) and pooled[0]["greedy_agreement"] == 0.75
    assert pooled[0]["min_agreement"] == 0.5 and pooled[0]["forced_agreement"] == 0.75


def test_windows_are_evenly_spaced_and_in_range():
    stream = torch.arange(100)
    got = windows(stream, 10, 3)
    assert [w[0].item() for w in got] == [0, 45, 90] and all(w.numel() == 10 for w in got)
    assert windows(stream, 101, 2) == []


def test_continuation_is_teacher_forced_loss_and_greedy_from_one_prefill():
    """In shape-stable numerics, where 8-token chunks and one-token steps give the bits of one
    pass over the whole sequence (in the official numerics a CPU's GEMM may sum a chunk's rows in
    another order, and on a Xeon with AMX that flipped an index choice of this model)."""
    model = random_model("micro", seed=0)
    core = InferenceCore(model, chunk_size=8)
    ids = torch.randint(3, 200, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    target = torch.randint(3, 200, (6,), generator=torch.Generator().manual_seed(2)).tolist()
    with stable_numerics():
        seq, logits = core.prefill(ids, "full", capacity=40)
        loss, tokens, forced = continuation(core, seq, logits, target)
        core.release(seq)
        with torch.inference_mode():
            oracle = model(torch.tensor([ids + target])).logits[0]
        _, reference = greedy(core, ids, "full", len(target))
    expected = nll(oracle[len(ids) - 1 : -1], torch.tensor(target))
    assert math.isclose(loss, expected, rel_tol=1e-5)
    assert forced == oracle[len(ids) - 1 : -1].argmax(-1).tolist()
    assert tokens == reference  # the rollback restored the prefill's state for the greedy run


def test_bf16_global_kv_keeps_fp4_entries_in_bf16_and_restores_the_formats():
    from dsv41.model import attention, cache

    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3))
    fp4 = attention.main_kv_qdq(x)
    swa = next(iter(cache.DecodeCache.allocate(random_model("micro", seed=0).config, 1, 16).windows.values()))
    with bf16_global_kv():
        assert torch.equal(attention.main_kv_qdq(x), x.bfloat16().float())
        assert torch.equal(attention.mxfp4_qdq(x), x.bfloat16().float())
        rows = torch.randn(1, 2, swa.fmt.dim, generator=torch.Generator().manual_seed(4))
        swa.write(slice(0, 2), rows)  # FP8 SWA entries keep their rounding
        assert not torch.equal(swa.read(slice(0, 2)).float(), rows.bfloat16().float())
    assert torch.equal(attention.main_kv_qdq(x), fp4) and not torch.equal(fp4, x.bfloat16().float())


def test_bf16_global_kv_changes_the_prefill_of_a_compressing_model():
    model = random_model("micro", seed=0)
    core = InferenceCore(model, chunk_size=8)
    ids = torch.randint(3, 200, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    seq, fp4 = core.prefill(ids, "exact", capacity=48)
    core.release(seq)
    with bf16_global_kv():
        seq, bf16 = core.prefill(ids, "exact", capacity=48)
        core.release(seq)
    assert not torch.equal(fp4, bf16)  # the compressed entries feed the logits; in bf16 they move them


def test_goals_name_what_is_met():
    summary = [{"ppl_ratio": 1.004, "greedy_agreement": 0.95}, {"ppl_ratio": 1.02, "greedy_agreement": 0.5}]
    validation = {"fp32": {"all": {"nats_per_token": 2.0}}, "exported": {"all": {"nats_per_token": 2.02}}}
    got = goals({"validation": validation, "replay_vs_exact": {"summary": summary}})
    assert got["weights_loss_increase"]["met"] and abs(got["weights_loss_increase"]["value"] - 0.01) < 1e-12
    assert not got["replay_ppl_increase"]["met"] and not got["replay_agreement"]["met"]
    assert "fp4_cache_ppl_increase" not in got
