import msgspec
import pytest
import torch
from safetensors.torch import load_file

from dsv41.config import Mode, ModelConfig, config_from_dict, config_to_dict, load_config
from dsv41.kernels.torch_ops import select_candidate_blocks, sparse_attention
from dsv41.model.attention import Attention, ring_slots, visible_entries, window_indices
from dsv41.model.cache import DecodeCache
from dsv41.model.numerics import stable_numerics
from dsv41.model.reference import random_model
from dsv41.model.trace import Trace

from .conftest import GOLDEN


def test_window_is_exactly_the_last_w_positions_including_the_current_one():
    idx = window_indices(seq_len=20, window=8)
    for p in range(20):
        seen = sorted(i for i in idx[p].tolist() if i >= 0)
        assert seen == list(range(max(0, p - 7), p + 1))


def test_ring_slots_list_the_window_oldest_first_with_unwritten_slots_unused(rng):
    """Each decode query's ring slots hold positions p-W+1..p oldest first (slot = position mod W),
    -1 for positions before 0; full rings (their tables made once per phase) and filling ones mixed
    in one batch, and in shape-stable numerics the unused slots last."""
    window = 8
    positions = torch.cat([torch.arange(0, 20), torch.randint(20, 10**6, (12,), generator=rng)])
    for stable in (False, True):
        with stable_numerics(stable):
            for chosen in (positions, positions[positions >= window - 1], positions[:3]):
                slots = ring_slots(chosen, window)
                for p, row in zip(chosen.tolist(), slots.tolist(), strict=True):
                    seen = [q % window for q in range(p - window + 1, p + 1) if q >= 0]
                    unused = [-1] * (window - len(seen))
                    assert row == (seen + unused if stable else unused + seen), (p, stable)


def test_visible_entries_of_ratio_2_need_a_complete_pair_and_ratio_1_sees_the_current_token():
    assert visible_entries(6, 2).flatten().tolist() == [0, 1, 1, 2, 2, 3]
    assert visible_entries(4, 1).flatten().tolist() == [1, 2, 3, 4]


def test_sparse_attention_matches_official_golden_across_chunks():
    u = load_file(GOLDEN / "units.safetensors")
    out = sparse_attention(u["attn.q"], u["attn.kv"], u["attn.sink"], u["attn.topk_idxs"], 64**-0.5)
    assert torch.equal(out, u["attn.out"])


def test_sparse_attention_equals_a_dense_softmax_with_sink(rng):
    q = torch.randn(1, 2, 3, 16, generator=rng).bfloat16()
    kv = torch.randn(1, 150, 16, generator=rng).bfloat16()
    sink = torch.randn(3, generator=rng)
    idx = torch.randperm(150, generator=rng)[:130].view(1, 1, 130).repeat(1, 2, 1).int()
    idx[0, 1, 100:] = -1
    out = sparse_attention(q, kv, sink, idx, 0.25).float()
    for row in range(2):
        keys = kv[0, idx[0, row][idx[0, row] >= 0].long()].double()
        logits = q[0, row].double() @ keys.T * 0.25
        weights = torch.exp(logits) / (torch.exp(logits).sum(-1, keepdim=True) + torch.exp(sink.double())[:, None])
        assert torch.allclose(out[0, row].double(), weights @ keys, rtol=2e-2, atol=2e-2)


def test_candidate_blocks_match_official_goldens_and_keep_the_newest_block():
    u = load_file(GOLDEN / "units.safetensors")
    mask = select_candidate_blocks(u["cand.logits"], u["cand.lens"].view(1, 6, 1), 3, 4)
    assert torch.equal(mask, u["cand.mask_topk3_bs4"])
    assert torch.equal(select_candidate_blocks(u["cand.decode_logits"], 23, 3, 4),
                       u["cand.decode_mask_len23_topk3_bs4"])


def test_candidate_pool_forces_the_newest_block_even_when_it_scores_worst(rng):
    scores = torch.randn(1, 1, 40, generator=rng)
    scores[..., 36:38] = -100  # the newest (partial) block holds entries 36, 37
    scores[..., 38:] = -torch.inf  # not visible yet
    mask = select_candidate_blocks(scores, 38, 2, 4)
    assert mask[0, 0, 36:40].all() and mask.sum() == 8


def test_equal_block_scores_fall_as_the_official_top_k_has_them_and_by_the_fixed_policy_when_stable():
    scores = torch.tensor([[[0.1, 0.5, -1.0, -1.0, 0.2, 0.5, -1.0, -1.0, 0.3, 0.0, 0.0, 0.0]]])
    # blocks 0 and 1 tie at 0.5; block 2 (the newest) is always kept
    official = select_candidate_blocks(scores, 12, 2, 4)
    blocks = torch.tensor([[[0.5, 0.5, torch.inf]]]).topk(2, dim=-1).indices  # the official code's call
    assert official[0, 0].nonzero().flatten().tolist() == sorted(
        e for b in blocks.flatten().tolist() for e in range(4 * b, 4 * b + 4))
    with stable_numerics():
        narrow = select_candidate_blocks(scores, 12, 2, 4)
        wide = select_candidate_blocks(torch.nn.functional.pad(scores, (0, 20), value=-torch.inf), 12, 2, 4)
    # shape-stable numerics: the newer block wins whatever the row width
    assert narrow[0, 0].nonzero().flatten().tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert torch.equal(wide[..., :12], narrow)


# Pools of 4 blocks, and of 2 blocks: 8 slots for a top-8, so when the newest block is partial the
# reference's top-k also takes entries outside the pool and those steps fall back to masking (the
# config validator refuses such a pool; the model is built past it to test the fallback).
@pytest.mark.parametrize("blocks", [2, 4])
def test_decode_ranking_only_the_pool_equals_masking_every_entry(rng, blocks, monkeypatch):
    """A Reindex decode step on a packed cache scores and ranks only the pool's entry ids (the
    batched selection, here of one sequence); a traced step masks full-width scores the way the
    reference does. Both pick the same entries."""
    data = config_to_dict(load_config("micro"))
    data["text_config"]["candidate_topk_blocks"] = blocks
    model = random_model(msgspec.convert(data, ModelConfig) if blocks == 2 else config_from_dict(data), seed=3)
    ranked_in_pool = []
    original = Attention._select_batch

    def observe(self, parts, query):
        picked = original(self, parts, query)
        if self.spec.candidate_consumer:
            ranked_in_pool.append(picked is not None)
        return picked

    monkeypatch.setattr(Attention, "_select_batch", observe)
    prompt = torch.randint(3, 320, (1, 45), generator=rng)
    caches = [DecodeCache.allocate(model.config, 1, 80, packed=True) for _ in range(2)]
    with torch.inference_mode():
        ids = [prompt, prompt]
        for _ in range(12):
            pooled = model(ids[0], cache=caches[0]).logits[:, -1]
            masked = model(ids[1], cache=caches[1], trace=Trace()).logits[:, -1]
            assert torch.equal(pooled, masked)
            ids = [pooled.argmax(-1, keepdim=True)] * 2
    assert len(ranked_in_pool) == 11 * sum(s.mode is Mode.REINDEX for s in model.plan.backbone)
    assert all(ranked_in_pool) if blocks == 4 else 0 < sum(ranked_in_pool) < len(ranked_in_pool)


def test_bf16_projections_of_a_batch_give_each_sequence_its_bits_alone(rng):
    """The index keys and index head weights of a batch's sequences, computed in one call with
    their per-sequence sizes, equal each sequence's own call, in the official numerics: on a CPU
    with AMX, oneDNN's bf16 GEMM sometimes sums a row in another order beside other rows than alone
    (for these shapes a few batches of eight in a thousand moved an output in the last bit, which
    failed a batched decode test about once in twenty runs)."""
    from dsv41.checkpoint import load_any_config, resolve_model_dir
    from dsv41.config import Rope
    from dsv41.model.attention import Indexer
    from dsv41.model.rope import table_for

    t = load_any_config(resolve_model_dir("small") / "config.json")[0].text_config
    indexer = Indexer(t, owns_keys=True)
    with torch.no_grad():
        for p in indexer.parameters():
            p.copy_(torch.randn(p.shape, generator=rng) * 0.1)
    table = table_for(t, Rope.YARN, 64)
    for _ in range(200):
        sizes = torch.randint(1, 4, (8,), generator=rng).tolist()
        latent = torch.randn(1, sum(sizes), t.head_dim, generator=rng).bfloat16()
        x = torch.randn(1, sum(sizes), t.hidden_size, generator=rng).bfloat16()
        qr = torch.randn(1, sum(sizes), t.q_lora_rank, generator=rng).bfloat16()
        rows = table[torch.randint(0, 64, (sum(sizes),), generator=rng)]
        keys = indexer.keys(latent, rows, sizes)
        alone = [indexer.keys(piece, part) for piece, part in zip(latent.split(sizes, 1), rows.split(sizes),
                                                                  strict=True)]
        assert torch.equal(keys, torch.cat(alone, dim=1))
        weights = indexer.query(x, qr, rows, sizes)[1]
        alone = [indexer.query(*pieces)[1] for pieces in zip(x.split(sizes, 1), qr.split(sizes, 1), rows.split(sizes),
                                                               strict=True)]
        assert torch.equal(weights, torch.cat(alone, dim=1))
