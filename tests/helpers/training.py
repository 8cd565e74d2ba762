"""Running `dsv41 train` in a test: the CLI in-process, its thread count given back after."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from click.testing import CliRunner, Result

from dsv41.cli.main import cli


def invoke(args: list[str]) -> Result:
    """Run the CLI with `args`; --threads sets torch's count for the process, so restore it."""
    threads = torch.get_num_threads()
    try:
        return CliRunner().invoke(cli, args)
    finally:
        torch.set_num_threads(threads)


def train(args: list[str], corpus: Path, out: Path, *extra: str) -> list[dict]:
    """`dsv41 train ARGS --corpus corpus --out out EXTRA`, which must succeed; its log records."""
    result = invoke(["train", *args, "--corpus", str(corpus), "--out", str(out), *extra])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]


def steps(records: list[dict]) -> list[dict]:
    """The per-step records of a training log."""
    return [r for r in records if r["kind"] == "step"]


CORPUS = Path(__file__).resolve().parents[3] / "shared" / "data" / "corpus" / "tinyshakespeare_input.txt"


def corpus_slice(folder: Path) -> Path:
    """The first 20,000 characters of the Shakespeare corpus as a file in `folder` (any English-like
    text in a checkout without ../shared)."""
    path = folder / "slice.txt"
    if CORPUS.exists():
        path.write_text(CORPUS.read_text(encoding="utf-8")[:20_000], encoding="utf-8")
    else:
        path.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 300, encoding="utf-8")
    return path
