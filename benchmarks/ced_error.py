"""How far CED's bounded replay moves the model, next to the noise floor of the numerics.

For prompts longer than the window, `ced` differs from `full` by design (the decoder's SWA state is
rebuilt from the last W tokens only). `exact` computes the same function as `full` but in other
chunk shapes, so exact-vs-full shows how much last-bit differences alone move these random-weight
models (docs/model.md). Reported per length: last-prompt-position logit error (max, mean) and
greedy agreement over the next steps. Writes benchmarks/results/ced_error.json.
Usage: python benchmarks/ced_error.py [--lengths 192 512] [--steps 64] [--config mini]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dsv41.engine.core import InferenceCore
from dsv41.model.reference import random_model

RESULTS = Path(__file__).parent / "results"


def greedy(core: InferenceCore, ids: list[int], mode: str, steps: int) -> tuple[torch.Tensor, list[int]]:
    seq, logits = core.prefill(ids, mode, capacity=len(ids) + steps + 1)
    first, tokens = logits, []
    for _ in range(steps):
        tokens.append(int(logits.argmax()))
        logits = core.step(seq, [tokens[-1]])[0]
    return first, tokens


def agreement(a: list[int], b: list[int]) -> tuple[float, int]:
    """Fraction of equal tokens, and the length of the common prefix."""
    prefix = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a), prefix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[192, 512])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--config", default="mini")
    args = parser.parse_args()
    core = InferenceCore(random_model(args.config, seed=0), chunk_size=256)
    rows = []
    print(f"{'N':>6} {'pair':<13} {'max err':>8} {'mean err':>9} {'agree':>6} {'common prefix':>13}")
    for n in args.lengths:
        ids = torch.randint(3, 320, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        runs = {mode: greedy(core, ids, mode, args.steps) for mode in ("full", "exact", "ced")}
        for pair in (("ced", "full"), ("exact", "full")):
            (la, ta), (lb, tb) = runs[pair[0]], runs[pair[1]]
            err = (la - lb).abs()
            share, prefix = agreement(ta, tb)
            row = {"n": n, "pair": "/".join(pair), "max_err": err.max().item(), "mean_err": err.mean().item(),
                   "greedy_agreement": share, "common_prefix": prefix, "logit_std": lb.std().item()}
            rows.append(row)
            print(f"{n:>6} {row['pair']:<13} {row['max_err']:>8.3f} {row['mean_err']:>9.4f} {share:>6.2f} "
                  f"{prefix:>13}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ced_error.json").write_text(json.dumps({"config": args.config, "steps": args.steps, "rows": rows},
                                                       indent=2) + "\n")
    print(f"wrote {RESULTS / 'ced_error.json'}")


if __name__ == "__main__":
    main()
