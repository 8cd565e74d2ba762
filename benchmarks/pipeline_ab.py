"""Two code trees served side by side: the same greedy requests through `local` pipelines whose
components run tree A or tree B, alternating, in one run.

On a machine whose speed drifts within minutes, two runs of `pipeline_overhead.py` a few minutes
apart differ by more than a change of a few percent. Here both pipelines are up at once (one idles
while the other serves), each round lets the other tree go first, and the run has two sessions:
A's pipeline started first, then B's first (with one tree in both pipelines, the one started
second was 1-5 % faster per token here). Each component process imports the tree it was started
in: the supervisor starts it there, and `python -m` puts the working directory first on the path
(PYTHONPATH does not override that). The client and supervisor are this checkout's, so the trees
must agree on the pipeline schema and the client's messages. Both trees must give the same tokens.

Reported: each session's per-round median time per decoded token of each tree, and the median
of the per-round ratios B/A (below 1: B is faster).
Writes benchmarks/results/pipeline_ab.json.
Usage: python benchmarks/pipeline_ab.py TREE_A TREE_B [--model small] [--rounds 10] [--tokens 40]
       [--prompt 64]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.pipeline_overhead import start, through  # noqa: E402
from dsv41.pipelines.launch import Supervisor  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def revision(tree: Path) -> str:
    """The tree's commit, with '+' when it has changes not committed."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True).stdout.strip()

    return git("rev-parse", "--short", "HEAD") + ("+" if git("status", "--porcelain", "--untracked-files=no") else "")


def start_in(tree: Path, model: str, root: Path) -> Supervisor:
    """A `local` pipeline (DSpark off) whose component processes run the code of `tree`."""
    with contextlib.chdir(tree):
        return start("local", model, root)


def session(trees: dict[str, Path], order: list[str], args, root: Path, prompts: list[list[int]]) -> dict:
    """Pipelines started in `order`; rounds alternate which tree serves first. Per-round medians."""
    supervisors: dict[str, Supervisor] = {}
    medians: dict[str, list[float]] = {name: [] for name in trees}
    try:
        for name in order:
            supervisors[name] = start_in(trees[name], args.model, root / f"{name}-{order[0]}")
        for round_, prompt in enumerate(prompts):
            tokens = {}
            for name in order if round_ % 2 else order[::-1]:
                tokens[name], gaps, _ = through(supervisors[name], prompt, args.tokens, [])
                if round_:  # round 0 warms both up and is not kept
                    medians[name].append(statistics.median(gaps) * 1e3)
            if tokens["A"] != tokens["B"]:
                raise SystemExit(f"the trees' tokens differ: A {tokens['A']}, B {tokens['B']}")
            if round_:
                print(json.dumps({"started_first": order[0], "round": round_,
                                  **{f"{n}_ms": round(v[-1], 2) for n, v in medians.items()}}), flush=True)
    finally:
        for supervisor in supervisors.values():
            supervisor.stop()
    ratios = [b / a for a, b in zip(medians["A"], medians["B"], strict=True)]
    return {"started_first": order[0], "A_ms": medians["A"], "B_ms": medians["B"],
            "median_ratio_b_over_a": statistics.median(ratios)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree_a", type=Path, help="A checkout of dsv41 (the baseline).")
    parser.add_argument("tree_b", type=Path, help="Another checkout (the change).")
    parser.add_argument("--model", default="small", help="A model directory or built-in model (default: small).")
    parser.add_argument("--rounds", type=int, default=10, help="Rounds kept per session (each tree once a round).")
    parser.add_argument("--tokens", type=int, default=40, help="Tokens decoded per request (at least 2).")
    parser.add_argument("--prompt", type=int, default=64, help="Prompt tokens (random ids).")
    args = parser.parse_args(argv)
    trees = {"A": args.tree_a.resolve(), "B": args.tree_b.resolve()}
    for tree in trees.values():
        if not (tree / "dsv41" / "components" / "host.py").exists():
            parser.error(f"{tree} is not a dsv41 checkout")
    if args.tokens < 2:
        parser.error("--tokens must be at least 2 (the time per token is between tokens)")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.prompt < 1:
        parser.error("--prompt must be at least 1")
    torch.set_num_threads(1)
    prompts = [torch.randint(17, 4096, (args.prompt,), generator=torch.Generator().manual_seed(r)).tolist()
               for r in range(args.rounds + 1)]
    root = Path(tempfile.mkdtemp(prefix="d41ab", dir="/tmp"))
    try:
        sessions = [session(trees, order, args, root, prompts) for order in (["A", "B"], ["B", "A"])]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report = {"model": args.model, "tokens": args.tokens, "prompt": args.prompt, "cpu_count": os.cpu_count(),
              "trees": {name: {"path": str(tree), "revision": revision(tree)} for name, tree in trees.items()},
              "sessions": sessions,
              "median_ratio_b_over_a": statistics.median(s["median_ratio_b_over_a"] for s in sessions)}
    print(f"\nA = {trees['A']} ({report['trees']['A']['revision']}), B = {trees['B']} "
          f"({report['trees']['B']['revision']})")
    print(f"{'started first':>13} {'A ms/token':>11} {'B ms/token':>11} {'B/A by round':>13}")
    for s in sessions:
        print(f"{s['started_first']:>13} {statistics.median(s['A_ms']):>11.2f} {statistics.median(s['B_ms']):>11.2f} "
              f"{s['median_ratio_b_over_a']:>13.3f}")
    print(f"{'both':>13} {'':>11} {'':>11} {report['median_ratio_b_over_a']:>13.3f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipeline_ab.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
