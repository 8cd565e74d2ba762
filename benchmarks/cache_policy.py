"""Replay Mooncake traces through the prefix-cache policy: V4.1 against a V4-style policy.

Each request of a trace (real arrival times, 512-token block hash ids; ../shared/data/SOURCES.md
§1a) looks up its longest cached prefix, then stores its new blocks. Byte sizes are the real
ones; the clock is the trace's.

- V4.1 policy: persistent store of global KV only, 890 B/token (512 x 890 = 455,680 B a block);
  encoder SWA snapshots (20 layers x 128 x 528 B = 1,351,680 B) at prompt end and output end in
  the host pool (byte bound and TTL, least recently used first, as `dsv41.storage.swa_pool.SWAPool`);
  a hit whose snapshot is gone costs an encoder replay of 128 tokens through 20 layers.
- V4-style policy: persistent store of V4-Flash global KV, 3,514 B/token (1,799,168 B a block),
  plus SWA snapshots persisted at prompt end and output end: 43 layers x 128 x 528 B = 2,906,112 B
  each (the SWA entry is taken as V4.1's 512-d FP8 entry with its scales, 528 B).

Retention in both: 72 h minimum age, far beyond a trace's span, so nothing is evicted and the hit
rate must equal the infinite-cache oracle of SOURCES.md. A request costs time in its number of
blocks (stored prefixes are trie nodes, the pool keeps its entries in age order), so the largest
traces replay in seconds. Prints a table, writes benchmarks/results/cache_policy.json and
cache_policy.png.
Usage: python benchmarks/cache_policy.py [TRACE.jsonl ...] [--ttl-s 300] [--pool-gib 100] [--out FILE]
(no TRACE: the two Mooncake FAST'25 traces under ../shared/data/traces/mooncake_fast25)
"""

from __future__ import annotations

import argparse
import json
import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "mooncake_fast25"
DEFAULT_TRACES = (DATA / "conversation_trace.jsonl", DATA / "synthetic_trace.jsonl")
RESULTS = Path(__file__).parent / "results"
BLOCK_TOKENS = 512
V41_BLOCK = BLOCK_TOKENS * 890
V41_SNAPSHOT = 20 * 128 * 528
V4_BLOCK = BLOCK_TOKENS * 3514
V4_SNAPSHOT = 43 * 128 * 528
REPLAY_LAYER_TOKENS = 128 * 20
ORACLE_HIT = {"conversation_trace": 0.366, "synthetic_trace": 0.640}
FIELDS = ("timestamp", "input_length", "hash_ids")


class TraceError(ValueError):
    """A trace this benchmark cannot replay, with the reason and where."""


class TraceRequest(NamedTuple):
    timestamp_ms: float
    input_length: int
    hash_ids: list[int]


def load_trace(path: Path) -> list[TraceRequest]:
    """The requests of a Mooncake-format JSONL trace, checked: the replay relies on 512-token
    blocks and a clock that never goes back, and a wrong file must fail by name, not mid-replay."""
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    lines = path.read_text().splitlines()
    first = next((line for line in lines if line.strip()), None)
    if first is None:
        raise TraceError(f"{path}: the file is empty (no requests to replay)")
    if not first.lstrip().startswith("{"):
        hint = (" (an Azure LLM inference trace: arrival times and lengths only, no prefix-block hashes)"
                if first.startswith("TIMESTAMP,ContextTokens") else "")
        raise TraceError(f"{path}: unknown trace format{hint}; expected Mooncake JSONL, one object a line with "
                         f"{', '.join(FIELDS)} (512-token block hashes)")
    requests, last = [], -math.inf
    for number, line in enumerate(lines, 1):
        if line.strip():
            requests.append(_request(path, number, line, last))
            last = requests[-1].timestamp_ms
    return requests


def _request(path: Path, number: int, line: str, last_ms: float) -> TraceRequest:
    where = f"{path}:{number}"
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(item, dict) or any(key not in item for key in FIELDS):
        raise TraceError(f"{where}: unknown trace format; each line needs the fields {', '.join(FIELDS)}")
    at, length, ids = item["timestamp"], item["input_length"], item["hash_ids"]
    if isinstance(at, bool) or not isinstance(at, int | float) or at < last_ms:
        raise TraceError(f"{where}: timestamp {at!r} must be a number of ms, not before the previous request's")
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise TraceError(f"{where}: input_length {length!r} must be a positive integer")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers")
    if len(ids) != -(-length // BLOCK_TOKENS):
        raise TraceError(f"{where}: {len(ids)} hash_ids for {length} input tokens; expected one per "
                         f"{BLOCK_TOKENS}-token block ({-(-length // BLOCK_TOKENS)})")
    return TraceRequest(at, length, ids)


class PrefixTrie:
    """The stored prefixes as a trie of block ids: a prefix is a node, one dict probe from its
    parent, so a request costs O(its blocks). (A tuple per prefix costs O(blocks²) in time and
    memory: the longest prompts have hundreds of blocks.)"""

    def __init__(self):
        self._nodes: dict[tuple[int, int], int] = {}  # (parent node, block id) -> node; the root is 0

    def __len__(self) -> int:
        return len(self._nodes)

    def lookup_and_store(self, ids: list[int]) -> tuple[int, list[int]]:
        """Stores every prefix of `ids`; returns how many leading blocks were stored before, and
        the node of each prefix (node i names ids[: i + 1])."""
        nodes, parent, hit = [], 0, 0
        for block in ids:
            key = (parent, block)
            node = self._nodes.get(key)
            if node is None:  # after a miss every node is new, so the hit is the leading run
                node = self._nodes[key] = len(self._nodes) + 1
            else:
                hit += 1
            nodes.append(node)
            parent = node
        return hit, nodes


class SnapshotPool:
    """The host SWA pool's policy on sizes alone (`SWAPool`'s: an entry expires `ttl_s` after it was
    stored, a full pool drops the least recently used), with O(1) work per operation: entries are
    kept both in use order and in age order, so expiry pops the oldest instead of scanning all.
    Age order equals insertion order because the clock never goes back (checked)."""

    def __init__(self, capacity_bytes: int, ttl_s: float):
        self.capacity, self.ttl = capacity_bytes, ttl_s
        self.bytes_used = 0
        self.hits = self.misses = self.expired = self.evicted = 0
        self._by_use: OrderedDict[Hashable, int] = OrderedDict()  # key -> size, least recently used first
        self._by_age: OrderedDict[Hashable, float] = OrderedDict()  # key -> stored at, oldest first
        self._now = -math.inf

    def __len__(self) -> int:
        return len(self._by_use)

    def put(self, key: Hashable, size: int, now: float) -> None:
        if size > self.capacity:
            raise ValueError(f"a snapshot of {size} bytes cannot fit a pool of {self.capacity} bytes")
        self._advance(now)
        self._drop(key)
        self._by_use[key], self._by_age[key] = size, now
        self.bytes_used += size
        self._expire()
        while self.bytes_used > self.capacity:
            self._drop(next(iter(self._by_use)))
            self.evicted += 1

    def get(self, key: Hashable, now: float) -> bool:
        """Whether the snapshot is there (a hit makes it the most recently used)."""
        self._advance(now)
        self._expire()
        if key not in self._by_use:
            self.misses += 1
            return False
        self._by_use.move_to_end(key)
        self.hits += 1
        return True

    def _advance(self, now: float) -> None:
        if now < self._now:
            raise ValueError(f"the clock went back from {self._now} to {now}: ages would no longer be in order")
        self._now = now

    def _expire(self) -> None:
        while self._by_age and self._now - next(iter(self._by_age.values())) > self.ttl:
            self._drop(next(iter(self._by_age)))
            self.expired += 1

    def _drop(self, key: Hashable) -> None:
        size = self._by_use.pop(key, None)
        if size is not None:
            del self._by_age[key]
            self.bytes_used -= size


@dataclass
class Run:
    name: str
    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0
    hit_tokens: int = 0
    input_tokens: int = 0
    replays: int = 0
    replay_layer_tokens: int = 0
    v41_persistent: int = 0
    v4_persistent: int = 0
    v41_read: int = 0
    v41_written: int = 0
    v4_read: int = 0
    v4_written: int = 0
    series: list = field(default_factory=list)  # (t s, V4.1 persistent, V4 persistent, pool bytes)


def replay(name: str, requests: Iterable[TraceRequest], ttl_s: float, pool_bytes: int) -> Run:
    pool, stored, run = SnapshotPool(pool_bytes, ttl_s), PrefixTrie(), Run(name)
    now = 0.0
    for n, req in enumerate(requests):
        now = req.timestamp_ms / 1000
        hit, prefixes = stored.lookup_and_store(req.hash_ids)
        run.requests += 1
        run.blocks += len(prefixes)
        run.hit_blocks += hit
        run.input_tokens += req.input_length
        run.hit_tokens += min(hit * BLOCK_TOKENS, req.input_length)
        if hit:
            run.v41_read += hit * V41_BLOCK
            run.v4_read += hit * V4_BLOCK + V4_SNAPSHOT
            if not pool.get(prefixes[hit - 1], now):  # SWA state gone: encoder replay of W tokens
                run.replays += 1
                run.replay_layer_tokens += REPLAY_LAYER_TOKENS
        new = len(prefixes) - hit
        run.v41_written += new * V41_BLOCK
        run.v41_persistent += new * V41_BLOCK
        run.v4_written += new * V4_BLOCK + 2 * V4_SNAPSHOT
        run.v4_persistent += new * V4_BLOCK + 2 * V4_SNAPSHOT
        full_blocks = req.input_length // BLOCK_TOKENS
        if full_blocks:
            pool.put(prefixes[full_blocks - 1], V41_SNAPSHOT, now)  # prompt end (block aligned)
        pool.put(("output", n), V41_SNAPSHOT, now)  # output end: only a later request of this turn can use it
        if n % 200 == 0:
            run.series.append((now, run.v41_persistent, run.v4_persistent, pool.bytes_used))
    run.series.append((now, run.v41_persistent, run.v4_persistent, pool.bytes_used))
    return run


def summary(run: Run) -> dict:
    ratio = run.v41_persistent / run.v4_persistent
    v4_swa_share = 1 - (run.blocks - run.hit_blocks) * V4_BLOCK / run.v4_persistent
    return {
        "trace": run.name, "requests": run.requests, "block_hit_rate": run.hit_blocks / run.blocks,
        "token_hit_rate": run.hit_tokens / run.input_tokens, "oracle_hit_rate": ORACLE_HIT.get(run.name),
        "replays": run.replays, "replay_layer_tokens": run.replay_layer_tokens,
        "v41_persistent_bytes": run.v41_persistent, "v4_persistent_bytes": run.v4_persistent,
        "persistent_ratio_v41_over_v4": ratio, "v4_swa_share_of_persistent": v4_swa_share,
        "global_kv_ratio": 890 / 3514, "pool_peak_bytes": max(s[3] for s in run.series),
        "v41_read_bytes": run.v41_read, "v41_written_bytes": run.v41_written,
        "v4_read_bytes": run.v4_read, "v4_written_bytes": run.v4_written,
    }


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        t = [s[0] / 60 for s in run.series]
        axes[0].plot(t, [s[1] / 2**30 for s in run.series], label=f"{run.name} V4.1")
        axes[0].plot(t, [s[2] / 2**30 for s in run.series], "--", label=f"{run.name} V4-style")
        axes[1].plot(t, [s[3] / 2**30 for s in run.series], label=run.name)
    axes[0].set(title="persistent bytes", xlabel="trace time (min)", ylabel="GiB")
    axes[1].set(title="V4.1 host SWA pool occupancy", xlabel="trace time (min)", ylabel="GiB")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="*", type=Path, default=list(DEFAULT_TRACES),
                        help="Mooncake-format JSONL traces (default: the conversation and synthetic FAST'25 traces)")
    parser.add_argument("--ttl-s", type=float, default=300.0, help="SWA pool TTL (default 300 s)")
    parser.add_argument("--pool-gib", type=float, default=100.0, help="SWA pool bytes (default 100 GiB: 10 %% of a "
                        "1 TiB host)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cache_policy.json",
                        help="the JSON report (the plot goes beside it as .png)")
    args = parser.parse_args(argv)
    pool_bytes = int(args.pool_gib * 2**30)
    if pool_bytes < V41_SNAPSHOT or args.ttl_s < 0:
        parser.error(f"--pool-gib must hold one snapshot ({V41_SNAPSHOT:,} B) and --ttl-s must not be negative")
    try:
        runs = [replay(path.stem, load_trace(path), args.ttl_s, pool_bytes) for path in args.traces]
    except TraceError as e:
        parser.error(str(e))
    rows = [summary(run) for run in runs]
    print(f"{'trace':<20} {'hit':>6} {'oracle':>6} {'replays':>8} {'V4.1 GiB':>9} {'V4 GiB':>8} {'ratio':>7} "
          f"{'V4 SWA':>7} {'pool peak GiB':>13}")
    for r in rows:
        oracle = "-" if r["oracle_hit_rate"] is None else f"{r['oracle_hit_rate']:.3f}"
        print(f"{r['trace']:<20} {r['block_hit_rate']:>6.3f} {oracle:>6} {r['replays']:>8} "
              f"{r['v41_persistent_bytes'] / 2**30:>9.1f} {r['v4_persistent_bytes'] / 2**30:>8.1f} "
              f"{r['persistent_ratio_v41_over_v4']:>7.3f} {r['v4_swa_share_of_persistent']:>7.1%} "
              f"{r['pool_peak_bytes'] / 2**30:>13.2f}")
    print(f"global KV alone: 890 / 3514 = {890 / 3514:.3f}; V4 SWA snapshot {V4_SNAPSHOT:,} B, V4.1 pooled snapshot "
          f"{V41_SNAPSHOT:,} B; TTL {args.ttl_s:g} s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"ttl_s": args.ttl_s, "pool_bytes": pool_bytes, "runs": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    try:
        plot(runs, args.out.with_suffix(".png"))
        print(f"wrote {args.out} and {args.out.with_suffix('.png').name}")
    except ImportError:
        print(f"wrote {args.out}; no plot: matplotlib is missing (pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
