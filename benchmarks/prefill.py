"""CED prefill against full prefill (`mini` by default): time and counted layer-tokens in one run.

For each prompt length N: one `full` prefill (every token through all layers) and one `ced`
prefill (all tokens through the encoder layers, decoder KV projected, the last W tokens replayed
through the decoder layers; on `mini` 20 + 20 layers and W = 128). The counted work ratio must
equal 1/2 + r/(2N) with r = min(N, W) exactly. Each CED time is printed beside its floor: the
FLOPs of the prompt's positions (each counted as a decode token at its context,
`dsv41.engine.flops`: the encoder's share of the layers for every position, the decoder's for the
replayed ones) over the fp32 GEMM rate measured in the same run. `--config` takes a built-in name
or any official-format config.json (random weights). With --fast-attention each CED prefill is
also timed with DSV41_FAST_ATTENTION=1 (the prefill attention over shared keys, or in place where
a block's queries share few, docs/performance.md), right after the reference one, and the speed-up
is reported; DSV41_FAST_GEMM=1 in the environment applies to every run (recorded in the file). Prints a table, writes
benchmarks/results/prefill.json and prefill.png (or --out and its .png).
Usage: python benchmarks/prefill.py [--config mini] [--lengths 1024 4096 16384 32768] [--chunk 512]
       [--threads T] [--fast-attention] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from unittest.mock import patch

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.decode import benchmark_model, gemm_rate  # noqa: E402
from dsv41.components.sequences import keep_freed_memory  # noqa: E402
from dsv41.engine.core import InferenceCore  # noqa: E402
from dsv41.engine.flops import decode_token_flops  # noqa: E402

RESULTS = Path(__file__).parent / "results"
SAMPLES = 256  # positions at which the FLOP count is evaluated (it is piecewise linear in the context)


def ced_flops(config, n: int, window: int, encoder_share: float) -> float:
    """FLOPs of a CED prefill of n tokens, every multiply-add counted as 2: each position costs what
    a decode token at its context does, the encoder's share of it for every position and the
    decoder's for the last `window` (the replay)."""
    stride, total = max(1, n // SAMPLES), 0.0
    for first in range(0, n, stride):
        count = min(stride, n - first)
        replayed = max(0, first + count - max(first, n - min(n, window)))
        per_token = decode_token_flops(config, first + 1, weighted=False).total
        total += per_token * (count * encoder_share + replayed * (1 - encoder_share))
    return total


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
    parser.add_argument("--config", default="mini",
                        help="a built-in config name or an official-format config.json (random weights)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads (default: torch's choice for this machine)")
    parser.add_argument("--fast-attention", action="store_true",
                        help="also time each CED prefill with DSV41_FAST_ATTENTION=1 and report the speed-up")
    parser.add_argument("--out", type=Path, default=RESULTS / "prefill.json")
    args = parser.parse_args()
    keep_freed_memory()  # the allocator policy the model components run with (DSV41_MALLOC=system: none)
    torch.set_num_threads(args.threads)
    model = benchmark_model(args.config)
    core = InferenceCore(model, chunk_size=args.chunk)
    window, vocab = model.config.text_config.sliding_window, model.config.text_config.vocab_size
    encoder_share = len(core.encoder) / (len(core.encoder) + len(core.decoder))
    rate = gemm_rate()
    rows = []
    print(f"fp32 GEMM: {rate / 1e9:.1f} GFLOP/s ({args.threads} threads)")
    print(f"{'N':>7} {'full s':>8} {'ced s':>8} {'ced floor s':>11} {'x floor':>8} {'time ratio':>10} "
          f"{'counted ratio':>13} {'1/2 + r/2N':>10}")
    for n in args.lengths:
        ids = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        with patch.dict(os.environ, {"DSV41_FAST_ATTENTION": "0"} if args.fast_attention else {}):
            full_s, full_work = measure(core, ids, "full")
            ced_s, ced_work = measure(core, ids, "ced")
        expected = 0.5 + min(n, window) / (2 * n)
        floor = ced_flops(model.config, n, window, encoder_share) / rate
        row = {"n": n, "full_s": full_s, "ced_s": ced_s, "ced_tokens_per_s": n / ced_s, "time_ratio": ced_s / full_s,
               "full_layer_tokens": full_work, "ced_layer_tokens": ced_work, "counted_ratio": ced_work / full_work,
               "predicted_ratio": expected, "ced_floor_s": floor, "ced_over_floor": ced_s / floor}
        line = (f"{n:>7} {full_s:>8.1f} {ced_s:>8.1f} {floor:>11.3f} {ced_s / floor:>7.0f}x {row['time_ratio']:>10.3f} "
                f"{row['counted_ratio']:>13.4f} {expected:>10.4f}")
        if args.fast_attention:
            with patch.dict(os.environ, {"DSV41_FAST_ATTENTION": "1"}):
                row["ced_fast_attention_s"], _ = measure(core, ids, "ced")
            row["fast_attention_speedup"] = ced_s / row["ced_fast_attention_s"]
            line += (f"   ced, fast attention: {row['ced_fast_attention_s']:.1f} s "
                     f"({n / row['ced_fast_attention_s']:.0f} tokens/s, {row['fast_attention_speedup']:.2f}x)")
        rows.append(row)
        print(line, flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)  # after every length: the long ones take hours on a CPU
        summary = {"config": args.config, "chunk": args.chunk, "threads": args.threads, "cpu": _cpu_name(),
                   "gemm_flops_per_s": rate,
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
        ax.set(xscale="log", xlabel="prompt tokens N", ylabel="ced / full", title=f"CED prefill on {args.config}")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.out.with_suffix(".png"), dpi=110)
        print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    except ImportError:
        print(f"wrote {args.out}; no plot: matplotlib is missing (pip install -e '.[bench]')")


if __name__ == "__main__":
    main()
