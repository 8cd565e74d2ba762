"""Corpus loading, the held-out split and batch sampling.

Each corpus file is split by byte range: its last `val_fraction` (cut at a line start) is held
out for validation, the rest is training text; both halves are tokenized as documents framed by
BOS and EOS and concatenated. Training windows start at positions drawn from a seeded generator
whose state goes into checkpoints, so a resumed run draws the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

BOS, EOS = 0, 1


@dataclass(frozen=True)
class Corpus:
    train: torch.Tensor  # int64 token stream
    val: torch.Tensor


def split_text(text: str, val_fraction: float) -> tuple[str, str]:
    """(training text, held-out text): the held-out part is the tail from the first line start
    at or after (1 - val_fraction) of the text."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(text) * (1 - val_fraction))
    line = text.find("\n", cut)
    cut = len(text) if line < 0 else line + 1
    return text[:cut], text[cut:]


def _tokens(tokenizer: Tokenizer, texts: list[str]) -> torch.Tensor:
    """Each non-empty text as BOS ids EOS, concatenated; lines are encoded in parallel batches."""
    out: list[int] = []
    for text in texts:
        if not text:
            continue
        lines = text.splitlines(keepends=True)
        out.append(BOS)
        for encoding in tokenizer.encode_batch(lines, add_special_tokens=False):
            out.extend(encoding.ids)
        out.append(EOS)
    return torch.tensor(out, dtype=torch.int64)


def load_corpus(paths: list[Path], tokenizer: Tokenizer, val_fraction: float) -> Corpus:
    halves = [split_text(Path(p).read_text(encoding="utf-8"), val_fraction) for p in paths]
    return Corpus(_tokens(tokenizer, [h[0] for h in halves]), _tokens(tokenizer, [h[1] for h in halves]))


def sample_batch(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    """[batch, seq_len + 1] windows at seeded random starts (inputs and their next tokens)."""
    if stream.numel() < seq_len + 1:
        raise ValueError(f"the training text has {stream.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    starts = torch.randint(0, stream.numel() - seq_len, (batch,), generator=gen)
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


def validation_batches(stream: torch.Tensor, batch: int, seq_len: int, n_batches: int) -> list[torch.Tensor]:
    """Up to n_batches fixed batches of consecutive, non-overlapping windows from the held-out text."""
    n = min((stream.numel() - 1) // seq_len, batch * n_batches)
    if n == 0:
        raise ValueError(f"the held-out text has {stream.numel()} tokens, fewer than seq_len + 1 = {seq_len + 1}")
    windows = torch.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    return list(windows.split(batch))
