"""Properties of the reference forward that every later fast path relies on."""

import pytest
import torch

from dsv41.config import Mode
from dsv41.model.reference import Sampling, forward, generate, random_model, sample_next
from dsv41.model.trace import Trace


def _ids(rng, n, vocab=320):
    return torch.randint(3, vocab, (1, n), generator=rng)


def _trace(model, ids):
    trace = Trace()
    out = forward(model, ids, trace)
    return out, trace


def _entries(trace, layer, seq_len):
    """Global entry ids a layer attended to (the trace holds them offset by the SWA length)."""
    idx = trace[f"layer{layer}.compress_topk_idxs"]
    return torch.where(idx >= 0, idx - seq_len, -1)


@pytest.mark.parametrize("cut", [16, 17, 31])
def test_logits_at_t_ignore_every_later_token(micro, rng, cut):
    # 40 tokens: past the window (8), Top-k (8) and the 4 x 4 candidate pool, so every branch is
    # truncated; odd and even cuts cover complete and incomplete ratio-2 pairs.
    a = _ids(rng, 40)
    b = a.clone()
    b[0, cut + 1 :] = _ids(rng, 40 - cut - 1)
    la, lb = forward(micro, a).logits, forward(micro, b).logits
    assert torch.equal(la[0, : cut + 1], lb[0, : cut + 1])
    assert not torch.equal(la[0, cut + 1 :], lb[0, cut + 1 :])


def test_mini_is_causal_beyond_the_128_token_window(rng):
    model = random_model("mini", seed=2)
    a = _ids(rng, 140)
    b = a.clone()
    b[0, 133:] = _ids(rng, 7)
    la, lb = forward(model, a).logits, forward(model, b).logits
    assert torch.equal(la[0, :133], lb[0, :133])


def test_swa_only_layer_sees_exactly_the_last_w_positions(micro, rng):
    w, p = micro.config.text_config.sliding_window, 20
    base = _ids(rng, 24)
    outside, inside = base.clone(), base.clone()
    outside[0, p - w] = (base[0, p - w] + 1) % 320
    inside[0, p - w + 1] = (base[0, p - w + 1] + 1) % 320
    layer0 = [_trace(micro, ids)[1]["layer0.out_h"][0, p] for ids in (base, outside, inside)]
    assert torch.equal(layer0[0], layer0[1])
    assert not torch.equal(layer0[0], layer0[2])


def test_reuse_layers_attend_with_their_producers_topk(micro, rng):
    _, trace = _trace(micro, _ids(rng, 40))
    plan = micro.plan
    for spec in plan.backbone:
        if spec.mode is Mode.REUSE:
            assert torch.equal(_entries(trace, spec.layer_id, 40), _entries(trace, spec.topk_producer, 40))
    reindex = [s.layer_id for s in plan.backbone if s.mode is Mode.REINDEX]
    full = [s.layer_id for s in plan.backbone if s.mode is Mode.FULL and s.ratio == 1]
    assert not torch.equal(_entries(trace, reindex[0], 40), _entries(trace, full[0], 40))


def test_topk_entries_are_visible_ratio_2_complete_pairs_and_ratio_1_includes_the_current_token(micro, rng):
    _, trace = _trace(micro, _ids(rng, 40))
    for spec in micro.plan.backbone:
        if spec.mode is Mode.SWA:
            continue
        topk = _entries(trace, spec.layer_id, 40)[0]
        visible = (torch.arange(1, 41) // spec.ratio).unsqueeze(-1)
        assert ((topk < visible) | (topk == -1)).all()
        if spec.ratio == 1 and spec.mode is Mode.FULL:
            # with fewer visible entries than Top-k, every visible entry is taken, the current one included
            for p in range(8):
                assert sorted(i for i in topk[p].tolist() if i >= 0) == list(range(p + 1))


def test_reindex_layers_pick_only_inside_the_candidate_pool(micro, rng):
    _, trace = _trace(micro, _ids(rng, 40))
    source = next(s.layer_id for s in micro.plan.backbone if s.candidate_source)
    pool = trace[f"layer{source}.candidates"][0]
    visible = torch.arange(1, 41)
    assert pool[torch.arange(40), visible - 1].all()  # the newest block is always in the pool
    assert (pool.sum(-1) <= 16).all() and (pool.sum(-1)[-1] == 16)
    for spec in micro.plan.backbone:
        if spec.candidate_consumer:
            topk = _entries(trace, spec.layer_id, 40)[0]
            rows, cols = torch.where(topk >= 0)
            assert pool[rows, topk[rows, cols].long()].all()


def _perturb(model, prefixes, rng):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(prefixes):
                noise = torch.randn(p.shape, generator=rng).to(p.dtype) if p.is_floating_point() else None
                if p.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
                    p.copy_((p.float() * 1.5).to(p.dtype))
                elif noise is not None:
                    p.add_(noise)
                else:
                    p.copy_(torch.randint_like(p, -100, 100))


def test_decoder_global_kv_depends_only_on_the_encoder_output(rng):
    ids = _ids(rng, 40)
    model = random_model("micro", seed=3)
    start = model.plan.decoder_start
    _, before = _trace(model, ids)
    decoder_rest = tuple(f"layers.{i}." for i in range(start + 1, len(model.layers)))
    _perturb(model, (*decoder_rest, f"layers.{start}.ffn.", f"layers.{start}.hc_ffn", "head.", "norm."), rng)
    _, after = _trace(model, ids)
    for name in ("main_kv", "index_k"):
        assert torch.equal(before[f"layer{start}.{name}"], after[f"layer{start}.{name}"])
    assert not torch.equal(before[f"layer{start + 1}.out_h"], after[f"layer{start + 1}.out_h"])
    _perturb(model, (f"layers.{start - 1}.ffn.",), rng)  # an encoder weight does move it
    _, encoder_changed = _trace(model, ids)
    assert not torch.equal(before[f"layer{start}.main_kv"], encoder_changed[f"layer{start}.main_kv"])


def test_greedy_generate_matches_argmax_of_full_forwards(micro, rng):
    prompt = _ids(rng, 6)[0].tolist()
    produced = list(generate(micro, prompt, 5))
    ids = list(prompt)
    for token in produced:
        assert token == int(forward(micro, torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(token)


def test_seeded_sampling_is_reproducible_and_top_p_truncates(micro, rng):
    prompt = _ids(rng, 5)[0].tolist()
    hot = Sampling(temperature=1.5, top_p=0.9, seed=7)
    assert list(generate(micro, prompt, 6, hot)) == list(generate(micro, prompt, 6, hot))
    logits = torch.randn(1, 320, generator=rng)
    nucleus = Sampling(temperature=1.0, top_p=1e-6, seed=1)
    gen = torch.Generator().manual_seed(0)
    assert all(int(sample_next(logits, nucleus, gen)) == int(logits.argmax()) for _ in range(20))


def test_bad_generation_inputs_are_rejected(micro):
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        Sampling(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        Sampling(top_p=0)
    with pytest.raises(ValueError, match="at least one token"):
        list(generate(micro, [], 3))
    limit = micro.config.text_config.max_position_embeddings
    with pytest.raises(ValueError, match=f"exceed the limit of {limit} tokens"):
        forward(micro, torch.zeros(1, limit + 1, dtype=torch.long))
