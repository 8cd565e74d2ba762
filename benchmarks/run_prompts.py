"""`dsv41 run` as a user runs it: a fresh pipeline per prompt, tokens/s and time to first token.

Each round runs `dsv41 run PIPELINE --prompt P --max-new-tokens N --json` once per prompt (six
short prompts by default, three code and three verse), each in its own process that starts and
stops the pipeline, so every run begins with what a fresh pipeline knows: the DSpark scheduler's
rates, its calibration and the step-cost curve measured at start-up. Reported per run: decode
tokens/s (the tokens after the first over the decode time), TTFT, and with DSpark the
verifications and accepted drafts. Goal (docs/performance.md): every prompt >= 30 tokens/s and
TTFT <= 0.3 s on the default model.
Writes benchmarks/results/run_prompts.json (or --out).
Usage: python benchmarks/run_prompts.py [--pipeline local] [--dspark auto|fixed|off] [--rounds 2]
       [--max-new-tokens 64] [--prompts "A" "B" ...] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PROMPTS = ["def fibonacci(n):", "ROMEO:", "import os", "First Citizen:", "class Stack:", "To be, or not to be"]
GOAL_TOKENS_PER_S, GOAL_TTFT_S = 30.0, 0.3


def run_once(pipeline: str, prompt: str, max_new: int, dspark: str | None) -> dict:
    """One `dsv41 run` in a process of its own; its JSON result."""
    command = [sys.executable, "-c", "from dsv41.cli.main import cli; cli()", "run", pipeline, "--prompt", prompt,
               "--max-new-tokens", str(max_new), "--json"] + (["--dspark", dspark] if dspark else [])
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode != 0:
        raise RuntimeError(f"dsv41 run failed on {prompt!r}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default="local")
    parser.add_argument("--dspark", choices=("auto", "fixed", "off"),
                        help="DSpark mode (default: the pipeline's, auto for the default model)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--prompts", nargs="+", default=PROMPTS)
    parser.add_argument("--out", type=Path, default=RESULTS / "run_prompts.json")
    args = parser.parse_args()
    runs = []
    print(f"{'round':>5}  {'prompt':<22} {'tokens/s':>8} {'TTFT ms':>8} {'verif.':>6} {'accepted':>8}")
    for round_ in range(args.rounds):
        for prompt in args.prompts:
            result = run_once(args.pipeline, prompt, args.max_new_tokens, args.dspark)
            decoded = result["generated_tokens"] - 1
            row = {"round": round_, "prompt": prompt, "tokens_per_s": decoded / result["decode_s"],
                   "ttft_s": result["ttft_s"], "verifications": result["verifications"],
                   "accepted_tokens": result["accepted_tokens"], "generated_tokens": result["generated_tokens"]}
            runs.append(row)
            print(f"{round_:>5}  {prompt[:22]:<22} {row['tokens_per_s']:>8.1f} {row['ttft_s'] * 1e3:>8.0f} "
                  f"{row['verifications']:>6} {row['accepted_tokens']:>8}", flush=True)
    slowest = min(r["tokens_per_s"] for r in runs)
    worst_ttft = max(r["ttft_s"] for r in runs)
    goal = {"slowest_tokens_per_s": slowest, "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "worst_ttft_s": worst_ttft, "met": slowest >= GOAL_TOKENS_PER_S and worst_ttft <= GOAL_TTFT_S}
    print(f"\nslowest {slowest:.1f} tokens/s (goal >= {GOAL_TOKENS_PER_S:.0f}), worst TTFT {worst_ttft * 1e3:.0f} ms "
          f"(goal <= {GOAL_TTFT_S * 1e3:.0f}): {'met' if goal['met'] else 'missed'}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"pipeline": args.pipeline, "dspark": args.dspark or "default",
                                    "max_new_tokens": args.max_new_tokens, "runs": runs, "goal": goal}, indent=2)
                        + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
