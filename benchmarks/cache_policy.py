"""Replay the Mooncake traces through the prefix-cache policy: V4.1 against a V4-style policy.

Each request of a trace (real arrival times, 512-token block hash ids; ../shared/data/SOURCES.md
§1a) looks up its longest cached prefix, then stores its new blocks. Byte sizes are the real
ones; the clock is the trace's.

- V4.1 policy: persistent store of global KV only, 890 B/token (512 x 890 = 455,680 B a block);
  encoder SWA snapshots (20 layers x 128 x 528 B = 1,351,680 B) at prompt end and output end in
  the host pool (SWAPool: byte bound and TTL); a hit whose snapshot is gone costs an encoder
  replay of 128 tokens through 20 layers.
- V4-style policy: persistent store of V4-Flash global KV, 3,514 B/token (1,799,168 B a block),
  plus SWA snapshots persisted at prompt end and output end: 43 layers x 128 x 528 B = 2,906,112 B
  each (the SWA entry is taken as V4.1's 512-d FP8 entry with its scales, 528 B).

Retention in both: 72 h minimum age, far beyond a trace's span, so nothing is evicted and the hit
rate must equal the infinite-cache oracle of SOURCES.md. Prints a table, writes
benchmarks/results/cache_policy.json and cache_policy.png.
Usage: python benchmarks/cache_policy.py [--ttl-s 300] [--pool-gib 100]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from dsv41.storage.swa_pool import SWAPool

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "mooncake_fast25"
RESULTS = Path(__file__).parent / "results"
BLOCK_TOKENS = 512
V41_BLOCK = BLOCK_TOKENS * 890
V41_SNAPSHOT = 20 * 128 * 528
V4_BLOCK = BLOCK_TOKENS * 3514
V4_SNAPSHOT = 43 * 128 * 528
REPLAY_LAYER_TOKENS = 128 * 20
ORACLE_HIT = {"conversation_trace": 0.366, "synthetic_trace": 0.640}


class Sized:
    """Stands in for a snapshot's bytes in the pool: only its size matters here."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


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


def replay(trace: Path, ttl_s: float, pool_bytes: int) -> Run:
    now = [0.0]
    pool = SWAPool(capacity_bytes=pool_bytes, ttl_s=ttl_s, clock=lambda: now[0])
    stored: set[tuple[int, ...]] = set()  # prefix identity = the chain of block ids
    run = Run(trace.stem)
    for n, line in enumerate(trace.open()):
        req = json.loads(line)
        now[0] = req["timestamp"] / 1000
        ids = req["hash_ids"]
        prefixes = [tuple(ids[: i + 1]) for i in range(len(ids))]
        hit = 0
        while hit < len(ids) and prefixes[hit] in stored:
            hit += 1
        run.requests += 1
        run.blocks += len(ids)
        run.hit_blocks += hit
        run.input_tokens += req["input_length"]
        run.hit_tokens += min(hit * BLOCK_TOKENS, req["input_length"])
        if hit:
            run.v41_read += hit * V41_BLOCK
            run.v4_read += hit * V4_BLOCK + V4_SNAPSHOT
            if pool.get(prefixes[hit - 1]) is None:  # SWA state gone: encoder replay of W tokens
                run.replays += 1
                run.replay_layer_tokens += REPLAY_LAYER_TOKENS
        new = prefixes[hit:]
        stored.update(new)
        run.v41_written += len(new) * V41_BLOCK
        run.v41_persistent += len(new) * V41_BLOCK
        run.v4_written += len(new) * V4_BLOCK + 2 * V4_SNAPSHOT
        run.v4_persistent += len(new) * V4_BLOCK + 2 * V4_SNAPSHOT
        full_blocks = req["input_length"] // BLOCK_TOKENS
        if full_blocks:
            pool.put(prefixes[full_blocks - 1], Sized(V41_SNAPSHOT))  # prompt end (block aligned)
        pool.put(("output", n), Sized(V41_SNAPSHOT))  # output end: only a later request of this turn can use it
        if n % 200 == 0:
            run.series.append((now[0], run.v41_persistent, run.v4_persistent, pool.bytes_used))
    run.series.append((now[0], run.v41_persistent, run.v4_persistent, pool.bytes_used))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ttl-s", type=float, default=300.0, help="SWA pool TTL (default 300 s)")
    parser.add_argument("--pool-gib", type=float, default=100.0, help="SWA pool bytes (default 100 GiB: 10 %% of a "
                        "1 TiB host)")
    args = parser.parse_args()
    runs = [replay(DATA / f"{name}.jsonl", args.ttl_s, int(args.pool_gib * 2**30))
            for name in ("conversation_trace", "synthetic_trace")]
    rows = [summary(run) for run in runs]
    print(f"{'trace':<20} {'hit':>6} {'oracle':>6} {'replays':>8} {'V4.1 GiB':>9} {'V4 GiB':>8} {'ratio':>7} "
          f"{'V4 SWA':>7} {'pool peak GiB':>13}")
    for r in rows:
        print(f"{r['trace']:<20} {r['block_hit_rate']:>6.3f} {r['oracle_hit_rate']:>6.3f} {r['replays']:>8} "
              f"{r['v41_persistent_bytes'] / 2**30:>9.1f} {r['v4_persistent_bytes'] / 2**30:>8.1f} "
              f"{r['persistent_ratio_v41_over_v4']:>7.3f} {r['v4_swa_share_of_persistent']:>7.1%} "
              f"{r['pool_peak_bytes'] / 2**30:>13.2f}")
    print(f"global KV alone: 890 / 3514 = {890 / 3514:.3f}; V4 SWA snapshot {V4_SNAPSHOT:,} B, V4.1 pooled snapshot "
          f"{V41_SNAPSHOT:,} B; TTL {args.ttl_s:g} s")
    RESULTS.mkdir(exist_ok=True)
    report = {"ttl_s": args.ttl_s, "pool_bytes": int(args.pool_gib * 2**30), "runs": rows}
    (RESULTS / "cache_policy.json").write_text(json.dumps(report, indent=2) + "\n")
    try:
        plot(runs, RESULTS / "cache_policy.png")
        print(f"wrote {RESULTS / 'cache_policy.json'} and cache_policy.png")
    except ImportError:
        print(f"wrote {RESULTS / 'cache_policy.json'}; no plot: matplotlib is missing (pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
