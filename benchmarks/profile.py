"""Where a decode step's time goes: torch.profiler over a few decode steps of one sequence.

Prefills a prompt (random token ids) through the inference core on a packed cache, then profiles
`--steps` greedy decode steps and prints the operators by self CPU time, with the number of
operator calls per step (the count is what a CPU step at these sizes pays for; it does not depend
on the machine's load, the times do). Before profiling it times `--timed` unprofiled steps and prints
their median wall and process CPU time. DSV41_FAST_MHC=1 profiles the compiled Sinkhorn (docs/performance.md).
Writes benchmarks/results/profile_<model>.json.
Usage: python benchmarks/profile.py [--model small] [--prompt 256] [--steps 5] [--timed 20] [--threads 1] [--top 15]
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
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--timed", type=int, default=20, help="unprofiled steps timed before profiling")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.model)
    model.eval()
    vocab = model.config.text_config.vocab_size
    ids = torch.randint(3, vocab, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    core = InferenceCore(model)
    with torch.inference_mode():
        seq, logits = core.prefill(ids, capacity=args.prompt + args.timed + 2 * args.steps + 2, packed=True)
        token = int(logits.argmax())
        for _ in range(2):  # warm-up: first-call allocations stay out of the table
            token = int(core.step(seq, [token])[0].argmax())
        times, cpu_times = [], []
        for _ in range(args.timed):
            t0, c0 = time.perf_counter(), time.process_time()
            token = int(core.step(seq, [token])[0].argmax())
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
        unprofiled = statistics.median(times) if times else float("nan")
        cpu = statistics.median(cpu_times) if times else float("nan")
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                token = int(core.step(seq, [token])[0].argmax())
        wall = (time.perf_counter() - t0) / args.steps
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    calls = sum(e.count for e in events) / args.steps
    rows = [{"op": e.key, "self_ms_per_step": e.self_cpu_time_total / 1e3 / args.steps,
             "calls_per_step": e.count / args.steps} for e in events[: args.top]]
    fast = os.environ.get("DSV41_FAST_MHC", "0")
    print(f"{args.model}: {args.prompt}-token prompt, {args.steps} decode steps, {args.threads} thread(s), "
          f"DSV41_FAST_MHC={fast}")
    print(f"step without the profiler (median of {args.timed}): {unprofiled * 1e3:.1f} ms wall, "
          f"{cpu * 1e3:.1f} ms process CPU time (less sensitive to other jobs on the machine)")
    print(f"step {wall * 1e3:.1f} ms under the profiler, {calls:,.0f} operator calls per step\n")
    print(f"{'operator':<32} {'self ms/step':>12} {'calls/step':>11}")
    for r in rows:
        print(f"{r['op']:<32} {r['self_ms_per_step']:>12.2f} {r['calls_per_step']:>11,.0f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"profile_{Path(args.model).name}.json"
    out.write_text(json.dumps({"model": args.model, "prompt": args.prompt, "steps": args.steps,
                               "threads": args.threads, "fast_mhc": fast,
                               "step_ms_unprofiled": unprofiled * 1e3, "step_cpu_ms_unprofiled": cpu * 1e3,
                               "step_ms_profiled": wall * 1e3,
                               "calls_per_step": calls, "top": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
