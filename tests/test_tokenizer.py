"""The trained byte-level BPE of the small model, the byte stand-in, and streaming detokenization."""

from __future__ import annotations

import json
import random
import shutil

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dsv41.config import load_config
from dsv41.model.engram import EngramHasher, token_map_from_tokenizer
from dsv41.model.tokenizer import (
    BOS,
    MODELS_DIR,
    Detokenizer,
    byte_tokenizer,
    decode,
    encode,
    load_tokenizer,
    token_bytes,
)
from dsv41.model.train_tokenizer import ADDED_TOKENS, CORPUS_FILES, NORMALIZED, train
from tests.conftest import SHARED

CORPUS = SHARED / "data" / "corpus"
COMPRESSED_VOCAB = 2929  # what the small model's config must set as engram_compressed_vocab_size


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("small", 4096)


@pytest.fixture(scope="module")
def table(tok):
    return token_bytes(tok)


def _mixed_text(rng: random.Random, corpus: str) -> str:
    """Pieces the tokenizer has rarely or never seen next to ones it knows well."""
    pieces = [
        lambda: chr(rng.randrange(0x10000, 0x110000)),  # astral plane (no surrogates there)
        lambda: rng.choice("aeoAEO") + "".join(chr(rng.randrange(0x300, 0x370)) for _ in range(rng.randrange(1, 4))),
        lambda: "".join(chr(rng.randrange(0x4E00, 0xA000)) for _ in range(rng.randrange(1, 6))),
        lambda: rng.choice(["😀", "👩‍👩‍👧", "🇫🇷", "✓", "€", "ß", "ǅ", "ﬁ", "Å", "\ufffd", "\u200b", "\x00"]),
        lambda: "".join(rng.choice(" \t\n\r\u3000\xa0\f\v") for _ in range(rng.randrange(1, 12))),
        lambda: corpus[(at := rng.randrange(len(corpus) - 300)):at + rng.randrange(1, 300)],
        lambda: str(rng.randrange(10**9)),
    ]
    return "".join(rng.choice(pieces)() for _ in range(rng.randrange(1, 30)))


@pytest.fixture(scope="module")
def corpus() -> str:
    if not CORPUS.is_dir():
        pytest.skip(f"the training corpus is not at {CORPUS}")
    return "".join((CORPUS / name).read_text(encoding="utf-8")[:200_000] for name in CORPUS_FILES)


def test_protocol_tokens_have_fixed_ids_and_encode_to_one_id(tok):
    added = tok.get_added_tokens_decoder()
    assert tok.get_vocab_size(with_added_tokens=True) == 4096
    for i, (content, special) in enumerate(ADDED_TOKENS):
        assert tok.token_to_id(content) == i
        assert (added[i].content, added[i].special, added[i].normalized) == (content, special, content in NORMALIZED)
        assert tok.encode(f"x{content}y", add_special_tokens=False).ids[1:-1] == [i]
    assert [tok.token_to_id(s) for s in (BOS, "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>")] == [0, 1, 2]
    assert decode(tok, list(range(17))) == "".join(content for content, special in ADDED_TOKENS if not special)
    assert len(ADDED_TOKENS) == 17 and len(added) == 17  # nothing else is matched as a whole string


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_round_trips(text):
    """Except the text of the special tokens (BOS, EOS, PAD, image), which decode drops."""
    assume(not any(content in text for content, special in ADDED_TOKENS if special))
    tok = load_tokenizer("small", 4096)
    assert decode(tok, encode(tok, text)) == text
    assert decode(tok, encode(tok, text, bos=False)) == text


def test_mixed_scripts_code_and_whitespace_round_trip(tok, corpus):
    rng = random.Random(41)
    for _ in range(300):
        text = _mixed_text(rng, corpus)
        ids = encode(tok, text)
        assert ids[0] == 0 and ids.count(0) == 1
        assert decode(tok, ids) == text


def test_bos_is_added_once(tok):
    assert encode(tok, BOS + "hi") == encode(tok, "hi") == [0, *encode(tok, "hi", bos=False)]
    assert encode(tok, "") == [0] and encode(tok, "", bos=False) == []


def test_the_bpe_learned_the_corpus(tok):
    """Frequent words of both corpora are single tokens (the merges were learned, not left empty)."""
    for word in ("Ġthe", "Ġreturn", "Ġself", "KING", "ĠĠĠ"):
        assert tok.token_to_id(word) is not None, word
    assert len(encode(tok, "    def __init__(self):\n        return None\n", bos=False)) < 16


def _check_stream(table: list[bytes], ids: list[int]) -> list[str]:
    """Pieces of a streamed decode, checking after every token that what was shown is the longest
    complete-character prefix of the bytes so far."""
    detok, pieces, consumed = Detokenizer(table), [], b""
    for i in ids:
        pieces.append(detok.push(i))
        consumed += table[i]
        shown = "".join(pieces).encode()
        held = consumed[len(shown):]
        assert consumed.startswith(shown) and len(held) < 4
        if held:
            with pytest.raises(UnicodeDecodeError):
                held.decode()
    pieces.append(detok.flush())
    return pieces


def test_streamed_text_never_splits_a_character(tok, table, corpus):
    rng = random.Random(7)
    waited = 0
    for _ in range(100):
        text = _mixed_text(rng, corpus)
        ids = encode(tok, text)
        pieces = _check_stream(table, ids)
        assert "".join(pieces) == text and pieces[-1] == ""
        waited += pieces.count("")
    emoji = encode(tok, "😀🇫🇷", bos=False)
    assert len(emoji) > 2 and _check_stream(table, emoji)[:len(emoji)].count("") >= 2  # bytes spread over tokens
    assert waited > 0


@pytest.mark.parametrize("which", ["small", "stand-in"])
def test_streamed_text_equals_decode_for_any_ids(which):
    """Random ids: special tokens, and single bytes that may never complete a character."""
    tok = load_tokenizer("small", 4096) if which == "small" else byte_tokenizer(320)
    table, rng = token_bytes(tok), random.Random(3)
    single = [i for i, b in enumerate(table) if len(b) == 1]
    for _ in range(300):
        ids = [rng.randrange(len(table)) if rng.random() < 0.5 else rng.choice(single) for _ in range(20)]
        detok = Detokenizer(table)
        assert "".join([*(detok.push(i) for i in ids), detok.flush()]) == decode(tok, ids)


def test_load_tokenizer_finds_the_file_beside_a_config(tmp_path):
    assert load_tokenizer("mini", 320) is byte_tokenizer(320)  # built-in configs have none
    assert load_tokenizer(str(tmp_path / "config.json"), 320) is byte_tokenizer(320)  # no such file
    shutil.copy(MODELS_DIR / "small" / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text("{}")
    for where in (tmp_path, str(tmp_path / "config.json")):
        assert load_tokenizer(where, 4096).get_vocab_size() == 4096
    with pytest.raises(ValueError, match="has 4096 tokens but the model's vocab_size is 4100"):
        load_tokenizer(tmp_path, 4100)


def test_engram_map_from_the_tokenizer(tok):
    token_map, count = token_map_from_tokenizer(tok)
    assert count == COMPRESSED_VOCAB and len(token_map) == 4096 and max(token_map) == count - 1
    # case, accents and a leading space fold away; whitespace runs all fold to one space
    folded = [("the", "The", "ĠThe", "Ġthe"), ("return", "Ġreturn", "ĠReturn"), ("Ġ", "Ċ", "ĉ", "ĠĠĠ", "ĠĠĠĠĠĠĠ")]
    for group in folded:
        assert len({token_map[tok.token_to_id(t)] for t in group}) == 1, group
    assert token_map[tok.token_to_id("the")] != token_map[tok.token_to_id("Ġ")]
    assert len({token_map[i] for i in range(17)}) == 17  # each protocol token keeps its own id
    mini = load_config("mini").text_config
    t = msgspec.structs.replace(mini, vocab_size=4096, engram_compressed_vocab_size=COMPRESSED_VOCAB)
    assert EngramHasher.build(t, token_map).pad_id == token_map[2]


def test_training_is_deterministic_and_sets_the_token_flags(tmp_path, corpus):
    (tmp_path / "a.txt").write_text(corpus[:100_000], encoding="utf-8")
    first, second = (train([tmp_path / "a.txt"], vocab_size=600).to_str() for _ in range(2))
    assert first == second
    data = json.loads(first)
    assert len(data["model"]["vocab"]) == 600 and [e["id"] for e in data["added_tokens"]] == list(range(17))
    assert {e["content"] for e in data["added_tokens"] if e["special"]} == {
        "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>", "<｜deepseek_image｜>"}


@pytest.mark.slow
def test_the_stored_tokenizer_is_what_training_writes(corpus):
    tok = train([CORPUS / name for name in CORPUS_FILES])
    assert json.loads(tok.to_str()) == json.loads((MODELS_DIR / "small" / "tokenizer.json").read_text())
