"""Where a decode step's time goes: torch.profiler over a few decode steps of one sequence or a batch.

Prefills `--batch` prompts (random token ids) through the inference core on packed caches, then
profiles `--steps` greedy decode steps of them as one batched step and prints the operators by
self CPU time, with the number of operator calls per step (the count is what a CPU step at these
sizes pays for; it does not depend on the machine's load, the times do). Before profiling it times
`--timed` unprofiled steps and prints their median wall and process CPU time. DSV41_FAST_MHC=1
profiles the compiled Sinkhorn (docs/performance.md).
Writes benchmarks/results/profile_<model>.json (profile_<model>_batch<B>.json for a batch).
Usage: python benchmarks/profile.py [--model small] [--prompt 256] [--batch 1] [--steps 5] [--timed 20]
       [--threads 1] [--top 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from dsv41.checkpoint import load_model
from dsv41.engine.core import InferenceCore

RESULTS = Path(__file__).parent / "results"
# this file's name shadows the standard library's `profile`, which torch.compile imports
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="a model directory or built-in model name")
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens before the profiled steps")
    parser.add_argument("--batch", type=int, default=1, help="sequences stepped as one batch (one token each)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timed", type=int, default=20, help="unprofiled steps timed before profiling")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    model.eval()
    if args.batch < 1:
        parser.error("--batch must be at least 1")
    vocab = model.config.text_config.vocab_size
    draw = torch.Generator().manual_seed(0)
    core = InferenceCore(model)
    with torch.inference_mode():
        capacity = args.prompt + args.timed + 2 * args.steps + 2
        seqs, tokens = [], []
        for _ in range(args.batch):
            seq, logits = core.prefill(torch.randint(3, vocab, (args.prompt,), generator=draw).tolist(),
                                       capacity=capacity, packed=True)
            seqs.append(seq)
            tokens.append(int(logits.argmax()))

        def step() -> None:
            for i, logits in enumerate(core.step_batch(seqs, [[token] for token in tokens])):
                tokens[i] = int(logits[-1].argmax())

        for _ in range(2):  # warm-up: first-call allocations stay out of the table
            step()
        times, cpu_times = [], []
        for _ in range(args.timed):
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        unprofiled = statistics.median(times) if times else float("nan")
        cpu = statistics.median(cpu_times) if times else float("nan")
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step()
        wall = (time.perf_counter() - t0) / args.steps
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    calls = sum(e.count for e in events) / args.steps
    rows = [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / args.steps,
             "calls_per_step": e.count / args.steps} for e in events[: args.top]]
    fast = os.environ.get("DSV41_FAST_MHC", "0")
    print(f"{args.model}: {args.batch} x {args.prompt}-token prompt, {args.steps} decode steps, "
          f"{args.threads} thread(s), DSV41_FAST_MHC={fast}")
    print(f"step without the profiler (median of {args.timed}): {unprofiled * 1e3:.1f} ms wall, "
          f"{cpu * 1e3:.1f} ms process CPU time (less sensitive to other jobs on the machine)")
    print(f"step {wall * 1e3:.1f} ms under the profiler, {calls:,.0f} operator calls per step\n")
    print(f"{'operator':<32} {'self ms/step':>12} {'calls/step':>11}")
    for r in rows:
        print(f"{r['op']:<32} {r['self_ms_per_step']:>12.2f} {r['calls_per_step']:>11,.0f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"profile_{Path(args.model).name}{'' if args.batch == 1 else f'_batch{args.batch}'}.json"
    out.write_text(json.dumps({"model": args.model, "prompt": args.prompt, "batch": args.batch, "steps": args.steps,
                               "threads": args.threads, "fast_mhc": fast,
                               "step_ms_unprofiled": unprofiled * 1e3, "step_cpu_ms_unprofiled": cpu * 1e3,
                               "step_ms_profiled": wall * 1e3,
                               "calls_per_step": calls, "top": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
