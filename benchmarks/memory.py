"""Resident memory of each component of a running pipeline over many requests.

Starts a pipeline (default `local`: every component its own process, the `mini` model) with a
store in a temporary folder, sends requests one after another (random prompts of varied lengths,
so the model sees many shapes, and a few new tokens each) and samples every component's RSS
(VmRSS) and the encoder's and decoder's gauges (live sequences, pages in use, held Engram rows)
every N requests. A bounded process levels off after warm-up; a leak keeps climbing. Prints a
table and writes benchmarks/results/memory.json.
`--native-cache-entries 1024` gives the model processes oneDNN's default cache sizes (what they
ran with before `bound_native_caches`), for a before/after comparison.
Usage: python benchmarks/memory.py [--requests 500] [--every 50] [--pipeline local] [--max-new-tokens 4]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

from dsv41 import messages as m
from dsv41.components.sequences import NATIVE_CACHE_ENTRIES
from dsv41.pipelines.client import generate
from dsv41.pipelines.launch import Supervisor, with_overrides
from dsv41.pipelines.schema import load_pipeline

RESULTS = Path(__file__).parent / "results"
GAUGES = ("sequences", "pages_in_use", "engram_rows_held")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def sample(supervisor: Supervisor, done: int, started: float) -> dict:
    """RSS by component (threads share this process's) and the model components' gauges."""
    pids = {name: pid or os.getpid() for name, pid in supervisor.pids().items()}
    gauges = {}
    for name in ("encoder", "decoder"):
        peer = supervisor.peer(name)
        try:
            counters = peer.ping().counters
        finally:
            peer.close()
        gauges[name] = {g: counters.get(g, 0) for g in GAUGES}
    return {"requests": done, "elapsed_s": round(time.monotonic() - started, 1),
            "rss_mb": {name: round(rss_mb(pid), 1) for name, pid in pids.items()}, "gauges": gauges}


def run(args: argparse.Namespace, root: Path) -> list[dict]:
    pipeline = with_overrides(load_pipeline(args.pipeline), store={"path": str(root / "kv")},
                              runtime_dir=str(root / "run"))
    rnd, samples = random.Random(args.seed), []
    with Supervisor(pipeline) as supervisor:
        peer, started = supervisor.peer(), time.monotonic()
        try:
            for done in range(args.requests + 1):
                if done % args.every == 0 or done == args.requests:
                    samples.append(sample(supervisor, done, started))
                    print(row(samples[-1], samples[0]), flush=True)
                if done == args.requests:
                    break
                ids = [rnd.randrange(3, 300) for _ in range(rnd.randint(*args.prompt_tokens))]
                events = list(generate(peer, ids=ids, max_new_tokens=rnd.randint(1, args.max_new_tokens),
                                       stop_at_eos=False))
                if not isinstance(events[-1], m.Finished):
                    raise RuntimeError(f"request {done} did not finish: {events[-1]}")
        finally:
            peer.close()
    return samples


def row(s: dict, first: dict) -> str:
    rss = "  ".join(f"{name} {mb:7.1f}" for name, mb in s["rss_mb"].items())
    model = s["rss_mb"]["encoder"] + s["rss_mb"]["decoder"]
    base = first["rss_mb"]["encoder"] + first["rss_mb"]["decoder"]
    live = ", ".join(f"{name} {'/'.join(str(v) for v in g.values())}" for name, g in s["gauges"].items())
    return (f"{s['requests']:>5} {s['elapsed_s']:>7.1f}s  enc+dec {model:7.1f} MB ({model - base:+6.1f})  {rss}  "
            f"[seq/pages/engram: {live}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--every", type=int, default=50, help="sample every N requests")
    parser.add_argument("--pipeline", default="local", help="built-in pipeline or YAML file (default local)")
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(4, 40), metavar=("MIN", "MAX"))
    parser.add_argument("--max-new-tokens", type=int, default=4, help="new tokens per request: 1..this")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--native-cache-entries", type=int, default=None,
                        help="oneDNN cache entries of the model processes (default: the components' bound)")
    parser.add_argument("--out", type=Path, default=RESULTS / "memory.json")
    args = parser.parse_args()
    if args.requests < 1 or args.every < 1 or not 1 <= args.prompt_tokens[0] <= args.prompt_tokens[1]:
        parser.error("--requests and --every must be positive, and 1 <= MIN <= MAX for --prompt-tokens")
    if args.native_cache_entries is not None:
        if args.native_cache_entries < 1:
            parser.error("--native-cache-entries must be positive (oneDNN crashes with an empty cache)")
        for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
            os.environ[name] = str(args.native_cache_entries)  # the component processes inherit it
    root = Path(tempfile.mkdtemp(prefix="d41mem", dir="/tmp"))
    try:
        samples = run(args, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    model = [s["rss_mb"]["encoder"] + s["rss_mb"]["decoder"] for s in samples]
    warm = 1 if len(samples) > 2 else 0  # the first sample past start: weights dequantized, first kernels built
    per_100 = (model[-1] - model[warm]) / max(1, samples[-1]["requests"] - samples[warm]["requests"]) * 100
    print(f"encoder+decoder RSS {model[0]:.0f} -> {model[-1]:.0f} MB over {samples[-1]['requests']} requests; "
          f"{per_100:+.1f} MB per 100 requests after the first sample past start")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"pipeline": args.pipeline, "requests": args.requests, "every": args.every,
              "prompt_tokens": list(args.prompt_tokens), "max_new_tokens": args.max_new_tokens, "seed": args.seed,
              "native_cache_entries": int(os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", NATIVE_CACHE_ENTRIES)),
              "encoder_decoder_mb_per_100_requests_after_warmup": round(per_100, 2), "samples": samples}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
