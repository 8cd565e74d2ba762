"""`dsv41 kv ...`: inspect and maintain a persistent global-KV store."""

from __future__ import annotations

import time
from pathlib import Path

import click

from dsv41.storage.store import (
    GlobalKVStore,
    StoreConfig,
    StoreCorruptError,
    StoreError,
    quarantine,
    stored_layout,
)

AGE_BUCKETS_H = (1, 6, 24, 72)


def _open(path: str, readonly: bool, min_age_h: float = 72.0, capacity_gib: float | None = None,
          move_aside: bool = False) -> GlobalKVStore:
    """Open the store, or fail with one line (never a traceback, never a signal: a corrupt file
    is found before LMDB maps it). `move_aside` quarantines a corrupt store file."""
    try:
        config = StoreConfig(min_age_s=min_age_h * 3600)
        if capacity_gib is not None:
            config.capacity_bytes = int(capacity_gib * 2**30)
        return GlobalKVStore(path, stored_layout(path), config, readonly=readonly)
    except StoreCorruptError as exc:
        if not move_aside:
            raise click.ClickException(f"{exc} (`dsv41 kv verify --path {path} --quarantine` moves it "
                                       "aside)") from None
        try:
            moved = quarantine(path)
        except StoreError as locked:
            raise click.ClickException(f"{exc}; not moved: {locked}") from None
        raise click.ClickException(f"{exc}; moved its files to {moved}, the next writer starts empty") from None
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None


@click.group()
def kv() -> None:
    """Inspect and maintain a persistent global-KV store (an LMDB folder)."""


@kv.command()
@click.option("--path", required=True, type=click.Path(file_okay=False), help="Store folder.")
def stats(path: str) -> None:
    """Entries, bytes, age histogram and hit counters."""
    with _open(path, readonly=True) as store:
        now, ages, n, total = time.time(), [0] * (len(AGE_BUCKETS_H) + 1), 0, 0
        for _, created, _, size in store.entries():
            hours = (now - created) / 3600
            ages[sum(hours >= b for b in AGE_BUCKETS_H)] += 1
            n, total = n + 1, total + size
        click.echo(f"store {path}: {n} blocks of {store.layout.block_tokens} tokens, {total:,} bytes "
                   f"({store.layout.payload_bytes:,} B of KV per block)")
        model = store.recorded_model_id()
        click.echo(f"model: {model.hex()[:16] if model else 'not recorded'}")
        labels = ["< 1 h", "1-6 h", "6-24 h", "24-72 h", ">= 72 h"]
        click.echo("age: " + ", ".join(f"{label} {count}" for label, count in zip(labels, ages, strict=True)))
        click.echo("counters: " + ", ".join(f"{k} {v}" for k, v in store.totals().items()))


@kv.command()
@click.option("--path", required=True, type=click.Path(file_okay=False), help="Store folder.")
@click.option("--quarantine", "move_aside", is_flag=True,
              help="If the store file is corrupt (truncated, damaged meta pages), move it to "
                   "DIR.corrupt-<time> so the next writer starts empty (refused while a writer runs).")
def verify(path: str, move_aside: bool) -> None:
    """Check the store file, then the header and checksum of every block; exit non-zero on any
    problem (a corrupt file too, whether moved aside or not)."""
    with _open(path, readonly=True, move_aside=move_aside) as store:
        problems = store.verify()
        for key, why in problems:
            click.echo(f"bad {key.hex()[:16] or '-'}: {why}")
        if problems:
            raise click.ClickException(f"{len(problems)} problem(s) in {path}")
        click.echo(f"ok: every block of {path} checks")


@kv.command()
@click.option("--path", required=True, type=click.Path(file_okay=False), help="Store folder.")
@click.option("--capacity-gib", type=float, help="Byte capacity to evict down to (default: the store's 64 GiB).")
@click.option("--min-age-h", default=72.0, show_default=True, help="Never evict entries younger than this.")
@click.option("--ignore-min-age", is_flag=True, help="Evict by recency alone (operator override).")
def gc(path: str, capacity_gib: float | None, min_age_h: float, ignore_min_age: bool) -> None:
    """Apply retention now: evict least recently used entries older than the minimum age. Needs
    the store's writer lock (stop the pipeline's kvstore first); works on a full disk."""
    with _open(path, readonly=False, min_age_h=min_age_h, capacity_gib=capacity_gib) as store:
        evicted = store.gc(ignore_min_age=ignore_min_age)
        click.echo(f"evicted {evicted} blocks; {store.stored_bytes():,} bytes stored")


@kv.command()
@click.option("--path", required=True, type=click.Path(file_okay=False), help="Store folder.")
@click.argument("dest", type=click.Path(exists=False))
def compact(path: str, dest: str) -> None:
    """Copy the store to DEST with compaction (the way to give freed space back)."""
    if Path(dest).exists():
        raise click.ClickException(f"{dest} already exists")
    with _open(path, readonly=True) as store:
        store.compact_to(dest)
    click.echo(f"compacted copy written to {dest}")
