"""Train the byte-level BPE tokenizer of the built-in small model, deterministically.

`python -m dsv41.model.train_tokenizer --out dsv41/models/small` reads the training corpus
(tinyshakespeare and the CPython 3.11.7 library, in that order) and writes `tokenizer.json`.
The layout follows the release tokenizer (SPEC.md §11): the same protocol tokens and pre-tokenizer
splits, at low ids because the vocabulary is small, and no normalizer, so any text round-trips.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "corpus"
CORPUS_FILES = ("tinyshakespeare_input.txt", "cpython_3.11.7_lib.txt")
VOCAB_SIZE = 4096

# (content, special): special tokens are dropped by decode; protocol tokens are text the chat
# format writes and a reply may contain, so they decode to themselves. Ids are the list order.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<｜begin▁of▁sentence｜>", True),
    ("<｜end▁of▁sentence｜>", True),
    ("<｜▁pad▁｜>", True),
    ("<｜User｜>", False),
    ("<｜Assistant｜>", False),
    ("<think>", False),
    ("</think>", False),
    ("<｜System｜>", False),
    ("<｜deepseek_image｜>", True),
    ("｜DSML｜", False),
    ("<｜latest_reminder｜>", False),
    ("<｜action｜>", False),
    ("<｜query｜>", False),
    ("<｜authority｜>", False),
    ("<｜domain｜>", False),
    ("<｜title｜>", False),
    ("<｜read_url｜>", False),
)
# SPEC §11: `<｜System｜>` is the one added token matched on normalized text.
NORMALIZED = frozenset({"<｜System｜>"})

# The release's pre-tokenizer: digits in runs of at most three, CJK runs, then words with their
# leading space or punctuation, punctuation runs, newlines and other whitespace.
SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥\u3040-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)


def untrained() -> Tokenizer:
    """The tokenizer pipeline before any merge: splits, byte-level symbols, byte-level decoding."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in SPLITS),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train(files: list[Path], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """Learn merges until the vocabulary (added tokens included) holds `vocab_size` entries.

    The trainer breaks count ties by pair ids, which come from the fixed byte alphabet, so the
    same files give the same file byte for byte."""
    tok = untrained()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=[content for content, _ in ADDED_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(f) for f in files], trainer)
    # the trainer adds every token as special; set each one's flags as listed
    data = json.loads(tok.to_str())
    flags = dict(ADDED_TOKENS)
    for entry in data["added_tokens"]:
        entry["special"] = flags[entry["content"]]
        entry["normalized"] = entry["content"] in NORMALIZED
    return Tokenizer.from_str(json.dumps(data, ensure_ascii=False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write tokenizer.json into")
    parser.add_argument("--corpus", type=Path, default=CORPUS_DIR, help="directory holding the corpus files")
    args = parser.parse_args()
    tok = train([args.corpus / name for name in CORPUS_FILES])
    args.out.mkdir(parents=True, exist_ok=True)
    tok.save(str(args.out / "tokenizer.json"), pretty=True)
    print(f"wrote {args.out / 'tokenizer.json'}: {tok.get_vocab_size(with_added_tokens=True)} tokens")


if __name__ == "__main__":
    main()
