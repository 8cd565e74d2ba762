import json

import torch
from safetensors.torch import load_file

from dsv41.config import config_from_dict, config_to_dict, load_config
from dsv41.model.engram import EngramHasher, compressed_token_map, hash_multipliers, table_primes, table_rows

from .conftest import GOLDEN


def test_prime_layout_reproduces_the_official_table_sizes():
    t = load_config("official").text_config
    assert table_rows(t) == [384006168, 384016682] == t.engram_num_embeddings
    primes = table_primes(t.engram_vocab_size, 2, 4, 8)
    assert primes[0][0][:3] == [16000057, 16000079, 16000081]
    assert primes[1][2][-1] == 16000889


def test_official_multipliers_and_primes_match_goldens():
    u = load_file(GOLDEN / "units.safetensors")
    assert torch.equal(hash_multipliers([1, 14], 4, 99092), u["engram.official_multipliers_layers_1_14"])
    assert hash_multipliers([1], 4, 99092)[0].tolist() == [76632096046245, 4839876093313, 35959672319349,
                                                           73987337458391]
    assert torch.equal(torch.tensor(table_primes(16_000_000, 2, 4, 8)), u["engram.official_primes"])


def test_compressed_map_merges_tokens_that_normalise_alike():
    decoded = ["The", "the", " THE", "\t", " ", "  \n", "Café", "cafe", "ﬁ", "fi", "\u200b", "\ufffd", "\ufffd"]
    raw = [*decoded[:11], "<0xE4>", "<0xB8>"]
    mapping, size = compressed_token_map(decoded, raw)
    # the/THE merge (lowercase + strip); whitespace-only tokens merge into " " (protected, not
    # stripped to ""); accents and ligatures fold; a zero-width space normalises to "" and keeps
    # its own text; partial UTF-8 pieces are keyed by their raw token and stay distinct.
    assert mapping == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4, 5, 6]
    assert size == 7


def test_golden_stub_tokenizer_compresses_exactly_as_the_official_map():
    stub = json.loads((GOLDEN / "tokenizer_stub.json").read_text())
    raw = [stub["raw_token_for_ufffd"].get(str(i), tok) for i, tok in enumerate(stub["tokens"])]
    mapping, size = compressed_token_map(stub["tokens"], raw)
    assert size == 120
    assert mapping == stub["token_map"]
    assert torch.equal(torch.tensor(mapping), load_file(GOLDEN / "io.safetensors")["engram.token_map"])


def _micro_hasher() -> tuple[EngramHasher, list[int]]:
    d = config_to_dict(load_config("micro"))
    d["text_config"]["engram_compressed_vocab_size"] = 7
    t = config_from_dict(d).text_config
    token_map = [i % 7 for i in range(t.vocab_size)]
    return EngramHasher.build(t, token_map), token_map


def _expected_rows(hasher: EngramHasher, compressed: list[int | None], p: int) -> list[int]:
    """Row ids at position p by the rule, with None marking a dead (image) token."""
    looked, blocked = [], False
    for k in range(4):
        blocked = blocked or p - k < 0 or compressed[p - k] is None
        looked.append(hasher.pad_id if blocked else compressed[p - k])
    rows = []
    for layer in range(hasher.multipliers.size(0)):
        mult = hasher.multipliers[layer].tolist()
        products = [c * m for c, m in zip(looked, mult, strict=True)]
        rolling, col = products[0], 0
        for order in range(1, 4):
            rolling ^= products[order]
            for prime in hasher.primes[layer, order - 1].tolist():
                rows.append(rolling % prime + int(hasher.offsets[layer, col]))
                col += 1
    return rows


def test_hash_ids_follow_the_rule_with_dead_positions(rng):
    hasher, token_map = _micro_hasher()
    ids = torch.randint(0, 320, (1, 12), generator=rng)
    live = torch.ones(1, 12, dtype=torch.bool)
    live[0, 5:7] = False  # an image span breaks every n-gram across it
    got = hasher(ids, live)
    compressed = [token_map[i] if ok else None for i, ok in zip(ids[0].tolist(), live[0].tolist(), strict=True)]
    for p in range(12):
        assert got[0, p].flatten().tolist() == _expected_rows(hasher, compressed, p)
    assert got.shape == (1, 12, 2, 6)


def test_engram_gates_of_a_batch_equal_each_sequence_alone(rng):
    """With `sizes`, each sequence's gated streams are the bits it gets alone: unequal sizes gate
    one sequence at a time, equal ones (a decode step) in one call with each sequence's gates as a
    run of their own (torch's sigmoid takes vector or scalar code by an element's place)."""
    from dsv41.checkpoint import load_any_config, resolve_model_dir
    from dsv41.model.engram import Engram

    t = load_any_config(resolve_model_dir("small") / "config.json")[0].text_config
    engram = Engram(t, 0)
    with torch.no_grad():
        for p in engram.parameters():
            p.copy_((torch.randn(p.shape, generator=rng) * 0.2).to(p.dtype))
    n_cols = (t.engram_max_ngram_size - 1) * t.engram_n_heads
    for sizes in ([1] * 9, [3] * 5, [2, 5, 1]):
        x = (torch.randn(1, sum(sizes), t.hc_mult, t.hidden_size, generator=rng) * 2).bfloat16()
        looked = torch.randn(1, sum(sizes), n_cols, t.engram_head_dim, generator=rng).bfloat16()
        batched = engram(x, looked, sizes=sizes)
        alone = [engram(part_x.contiguous(), part_rows.contiguous())
                 for part_x, part_rows in zip(x.split(sizes, 1), looked.split(sizes, 1), strict=True)]
        assert torch.equal(batched, torch.cat(alone, dim=1)), sizes
