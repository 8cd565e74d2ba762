"""Text <-> token ids through `tokenizers`: a model's tokenizer.json, or a byte-level stand-in.

A model directory in the Hugging Face layout (a checkpoint folder, the folder of a config.json, or a
built-in model under `dsv41/models/`) brings its own `tokenizer.json`; configs without one (the
built-in `mini`, `micro`, `official` names) get the byte-level stand-in: ids 0/1/2 are BOS/EOS/PAD
as in the release, ids 3..258 are the 256 bytes, and reserved special tokens fill the vocabulary up
to the config's vocab_size. Both are byte-level, so text is shown only once its UTF-8 is complete
(`Detokenizer`).
"""

from __future__ import annotations

import codecs
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from dsv41.config import BUILTIN_CONFIGS

# Protocol tokens of the release (SPEC.md §11), by their text.
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
SYSTEM = "<｜System｜>"
IMAGE = "<｜deepseek_image｜>"
DSML = "｜DSML｜"

SPECIALS = (BOS, EOS, PAD)
BYTE_OFFSET = len(SPECIALS)
MODELS_DIR = Path(__file__).resolve().parent.parent / "models"


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


def model_dir(model: str | Path) -> Path | None:
    """Where a model's files live: a built-in model's folder (names come first, as in
    `load_config`), a directory itself, or the folder of a config file; None when there is none."""
    name = str(model)
    if name in BUILTIN_CONFIGS or name == Path(name).name and (MODELS_DIR / name).is_dir():
        return MODELS_DIR / name if (MODELS_DIR / name).is_dir() else None
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    return path.parent if path.is_file() else None


@lru_cache(maxsize=8)
def load_tokenizer(model: str | Path, vocab_size: int) -> Tokenizer:
    """The tokenizer.json of `model` (see `model_dir`), else the byte stand-in of `vocab_size`."""
    folder = model_dir(model)
    if folder is None or not (folder / "tokenizer.json").is_file():
        return byte_tokenizer(vocab_size)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise ValueError(f"{folder / 'tokenizer.json'} has {size} tokens but the model's vocab_size is {vocab_size}")
    return tok


def encode(tok: Tokenizer, text: str, bos: bool = True) -> list[int]:
    """Ids of `text`; with `bos`, BOS leads unless the text already starts with it (a chat prompt)."""
    ids = tok.encode(text, add_special_tokens=False).ids
    bos_id = tok.token_to_id(BOS)
    return [bos_id, *ids] if bos and ids[:1] != [bos_id] else ids


def decode(tok: Tokenizer, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def token_bytes(tok: Tokenizer) -> list[bytes]:
    """The UTF-8 bytes each id adds to `decode`'s text, by the byte-level decoder's rule: a token
    made of byte symbols stands for those bytes, any other token for its own text; special tokens
    add nothing."""
    symbol_byte = {sym: b for b, sym in enumerate(_byte_symbols())}
    added = tok.get_added_tokens_decoder()
    table = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        if i in added and added[i].special:
            table.append(b"")
            continue
        text = tok.id_to_token(i)
        if all(c in symbol_byte for c in text):
            table.append(bytes(symbol_byte[c] for c in text))
        else:
            table.append(text.encode())
    return table


class Detokenizer:
    """Text of a stream of ids, shown only up to the last complete character: the bytes of a
    character split over tokens wait for the rest, so no piece ever holds half a character, and the
    pieces (with `flush`) join to exactly `decode` of all the ids (bytes that can never complete a
    character become U+FFFD at once, as `decode` makes them)."""

    def __init__(self, table: list[bytes]):
        self.table = table
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self.table[token_id])

    def flush(self) -> str:
        """What is left at the end of the stream: U+FFFD for an unfinished character, else ''."""
        return self._utf8.decode(b"", final=True)
