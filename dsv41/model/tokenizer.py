"""The byte-level tokenizer of the built-in configs, built with `tokenizers`.

Ids 0/1/2 are BOS/EOS/PAD as in the release, ids 3..258 are the 256 bytes, and reserved special
tokens fill the vocabulary up to the config's vocab_size. It stands in until a real BPE tokenizer
file is loaded; the Engram compressed map is built from it by the official rule.
"""

from __future__ import annotations

from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜pad｜>")
BYTE_OFFSET = len(SPECIALS)


def _byte_symbols() -> list[str]:
    """The printable stand-in character of each byte value, as byte-level BPE tokenizers use."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in kept:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


@lru_cache(maxsize=4)
def byte_tokenizer(vocab_size: int) -> Tokenizer:
    if vocab_size < BYTE_OFFSET + 256:
        raise ValueError(f"a byte-level tokenizer needs vocab_size >= {BYTE_OFFSET + 256}, got {vocab_size}")
    vocab = {sym: BYTE_OFFSET + b for b, sym in enumerate(_byte_symbols())}
    vocab.update({name: i for i, name in enumerate(SPECIALS)})
    reserved = [f"<｜reserved_{i}｜>" for i in range(BYTE_OFFSET + 256, vocab_size)]
    vocab.update({name: BYTE_OFFSET + 256 + i for i, name in enumerate(reserved)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([*SPECIALS, *reserved])
    return tok


def encode(tok: Tokenizer, text: str, bos: bool = True) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False).ids
    return [0, *ids] if bos else ids


def decode(tok: Tokenizer, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)
