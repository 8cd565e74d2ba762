"""CED prefill against full prefill on `mini`: time and counted layer-tokens in one run.

For each prompt length N: one `full` prefill (every token through all 40 layers) and one `ced`
prefill (all tokens through the 20 encoder layers, decoder KV projected, the last W = 128 tokens
replayed through the 20 decoder layers). The counted work ratio must equal 1/2 + r/(2N) with
r = min(N, W) exactly. With --fast-attention each CED prefill is also timed with
DSV41_FAST_ATTENTION=1 (the prefill attention over shared keys, docs/performance.md), right after
the reference one, and the speed-up is reported. Prints a table, writes
benchmarks/results/prefill.json and prefill.png (or --out and its .png).
Usage: python benchmarks/prefill.py [--lengths 1024 4096 16384 32768] [--chunk 512] [--threads T]
       [--fast-attention] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from unittest.mock import patch

import torch

from dsv41.engine.core import InferenceCore
from dsv41.model.reference import random_model

RESULTS = Path(__file__).parent / "results"


def measure(core: InferenceCore, ids: list[int], mode: str) -> tuple[float, int]:
    start = time.perf_counter()
    seq, _ = core.prefill(ids, mode)
    c = seq.counters
    return time.perf_counter() - start, c.encoder_layer_tokens + c.decoder_layer_tokens


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads (default: torch's choice for this machine)")
    parser.add_argument("--fast-attention", action="store_true",
                        help="also time each CED prefill with DSV41_FAST_ATTENTION=1 and report the speed-up")
    parser.add_argument("--out", type=Path, default=RESULTS / "prefill.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = random_model("mini", seed=0)
    core = InferenceCore(model, chunk_size=args.chunk)
    window = model.config.text_config.sliding_window
    rows = []
    print(f"{'N':>7} {'full s':>8} {'ced s':>8} {'time ratio':>10} {'counted ratio':>13} {'1/2 + r/2N':>10}")
    for n in args.lengths:
        ids = torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        with patch.dict(os.environ, {"DSV41_FAST_ATTENTION": "0"} if args.fast_attention else {}):
            full_s, full_work = measure(core, ids, "full")
            ced_s, ced_work = measure(core, ids, "ced")
        expected = 0.5 + min(n, window) / (2 * n)
        row = {"n": n, "full_s": full_s, "ced_s": ced_s, "ced_tokens_per_s": n / ced_s, "time_ratio": ced_s / full_s,
               "full_layer_tokens": full_work, "ced_layer_tokens": ced_work, "counted_ratio": ced_work / full_work,
               "predicted_ratio": expected}
        line = (f"{n:>7} {full_s:>8.1f} {ced_s:>8.1f} {row['time_ratio']:>10.3f} {row['counted_ratio']:>13.4f} "
                f"{expected:>10.4f}")
        if args.fast_attention:
            with patch.dict(os.environ, {"DSV41_FAST_ATTENTION": "1"}):
                row["ced_fast_attention_s"], _ = measure(core, ids, "ced")
            row["fast_attention_speedup"] = ced_s / row["ced_fast_attention_s"]
            line += (f"   ced, shared-keys attention: {row['ced_fast_attention_s']:.1f} s "
                     f"({n / row['ced_fast_attention_s']:.0f} tokens/s, {row['fast_attention_speedup']:.2f}x)")
        rows.append(row)
        print(line, flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)  # after every length: the long ones take hours on a CPU
        summary = {"chunk": args.chunk, "threads": args.threads, "cpu": _cpu_name(),
                   "fast_gemm": os.environ.get("DSV41_FAST_GEMM", "0"), "rows": rows}
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        ns = [r["n"] for r in rows]
        ax.plot(ns, [r["time_ratio"] for r in rows], "o-", label="measured time ratio (ced / full)")
        ax.plot(ns, [r["counted_ratio"] for r in rows], "s--", label="counted layer-token ratio")
        ax.axhline(0.5, color="gray", lw=0.8)
        ax.set(xscale="log", xlabel="prompt tokens N", ylabel="ced / full", title="CED prefill on mini")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=110)
        print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    except ImportError:
        print(f"wrote {args.out}; no plot: matplotlib is missing (pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
