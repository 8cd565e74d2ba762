"""Decode with caches: packed byte caches read back exactly what the fake-quant caches hold."""

import pytest
import torch

from dsv41.model.cache import DecodeCache
from dsv41.model.decode import cached_generate
from dsv41.model.reference import random_model


def test_packed_caches_give_identical_logits_and_64_greedy_tokens(micro, rng):
    for _ in range(3):
        prompt = torch.randint(3, 320, (int(torch.randint(1, 30, (1,), generator=rng)),), generator=rng).tolist()
        caches = [DecodeCache.allocate(micro.config, 1, len(prompt) + 64, packed=p) for p in (False, True)]
        ids = [torch.tensor([prompt])] * 2
        with torch.inference_mode():
            for _ in range(64):
                plain, packed = (micro(i, cache=c).logits[:, -1] for i, c in zip(ids, caches, strict=True))
                assert torch.equal(plain, packed)
                ids = [plain.argmax(-1, keepdim=True)] * 2


def test_mini_packed_decode_matches_fake_quant_decode(rng):
    model = random_model("mini", seed=4)
    prompt = torch.randint(3, 320, (150,), generator=rng).tolist()  # past the 128-token window
    assert list(cached_generate(model, prompt, 12, packed=True)) == list(cached_generate(model, prompt, 12))


def test_filling_a_cache_does_not_change_the_forward(micro, rng):
    # Decode steps themselves are checked bit for bit against the official decode (test_parity).
    ids = torch.randint(3, 320, (1, 21), generator=rng)
    with torch.inference_mode():
        cached = micro(ids, cache=DecodeCache.allocate(micro.config, 1, 32, packed=True)).logits
        assert torch.equal(cached, micro(ids).logits)


def test_a_cache_refuses_positions_beyond_its_capacity_and_loses_nothing(micro):
    cache = DecodeCache.allocate(micro.config, 1, 4)
    with torch.inference_mode():
        micro(torch.tensor([[5, 6, 7]]), cache=cache)
        with pytest.raises(ValueError, match="positions up to 5 exceed the limit of 4 tokens"):
            micro(torch.tensor([[5, 6]]), cache=cache)
        assert cache.length == 3
        micro(torch.tensor([[8]]), cache=cache)
        with pytest.raises(ValueError, match="exceed the limit of 4 tokens"):
            micro(torch.tensor([[9]]), cache=cache)
    assert cache.length == 4


def test_layers_reading_the_same_top_k_entries_dequantize_them_once_per_step(micro, rng, monkeypatch):
    """A decode step unpacks each (KV owner, Top-k producer) pair's entries once and the other layers
    of the pair take that table: one table per pair, and the logits are the bits of every layer
    unpacking its own."""
    from dsv41.kernels import torch_ops

    unpack = torch_ops.sparse_attention_decode
    seen: list[dict] = []

    def own_tables(q, ring, slots, main, topk, sink, scale, tables=None, key=None):
        return unpack(q, ring, slots, main, topk, sink, scale)

    def watched(q, ring, slots, main, topk, sink, scale, tables=None, key=None):
        seen.append(tables)
        return unpack(q, ring, slots, main, topk, sink, scale, tables, key)

    prompt = torch.randint(3, 320, (1, 40), generator=rng)
    token = torch.randint(3, 320, (1, 1), generator=rng)
    logits = []
    for fn in (own_tables, watched):
        monkeypatch.setattr(torch_ops, "sparse_attention_decode", fn)
        cache = DecodeCache.allocate(micro.config, 1, 48, packed=True)
        with torch.inference_mode():
            micro(prompt, cache=cache)
            logits.append(micro(token, cache=cache).logits)
    assert torch.equal(logits[0], logits[1])
    # (None, None): the SWA-only layers
    pairs = {(layer.attn.spec.kv_owner, layer.attn.spec.topk_producer) for layer in micro.layers}
    assert len(seen) == len(micro.layers) > len(pairs)
    assert all(t is seen[0] for t in seen) and set(seen[0]) == pairs
