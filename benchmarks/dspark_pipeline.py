"""DSpark through the pipeline at batch 1 and 8: what the `dspark` component's speculative loop gives.

For each mode (default: off, auto, fixed 3 and fixed 5) a fresh `local` pipeline (six processes, the
default model, DSpark set by the component options) decodes held-out prompts of each domain (see
benchmarks/dspark.py) greedily: batch 1 sends them one after another, batch 8 all at once, so the
component drafts for all of them and verifies them in one batched step. All the pipelines are up at
once and take each group of prompts in turn, so that the machine's speed, which drifts, is shared
by the modes compared. Reported per mode, domain
and batch: output tokens per second over the wall time (prefills included, the same for every
mode), the acceptance length (tokens per verification, the bonus included), and how many outputs
differ from plain decoding (in default numerics a verification step's rows may differ from
one-token steps in the last bits, so a near tie may flip).

Prints a table; writes benchmarks/results/dspark_pipeline.json.
Usage: python benchmarks/dspark_pipeline.py [--prompts 8] [--prompt-len 64] [--new-tokens 48]
       [--modes off,auto,fixed:3,fixed:5]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import msgspec
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.dspark import held_out_prompts  # noqa: E402
from dsv41 import messages as m  # noqa: E402
from dsv41.checkpoint import open_model_dir  # noqa: E402
from dsv41.components.runtime import new_request_id  # noqa: E402
from dsv41.pipelines.client import generate_together  # noqa: E402
from dsv41.pipelines.launch import Supervisor, with_overrides  # noqa: E402
from dsv41.pipelines.schema import load_pipeline  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def run_batch(supervisor: Supervisor, prompts: list[list[int]], new_tokens: int) -> tuple[list, float]:
    """Send every prompt at once; (tokens, Finished) of each, and the wall seconds until the last ends."""
    requests = [m.Generate(request_id=new_request_id(), ids=m.pack_ids(p), max_new_tokens=new_tokens,
                           stop_at_eos=False, temperature=0.0) for p in prompts]
    started = time.perf_counter()
    out = generate_together(supervisor.peer, requests, timeout_s=600)
    return out, time.perf_counter() - started


def pipeline_spec(model: str, mode: str, root: Path):
    """The `local` pipeline with this DSpark mode (off, auto, fixed:N) and a store of its own."""
    name, _, length = mode.partition(":")
    options = {"mode": name, **({"length": int(length)} if length else {})}
    base = load_pipeline("local")
    components = {**base.components, "dspark": msgspec.structs.replace(base.components["dspark"], options=options)}
    # 64-token prompts fill no 256-token store block: no run is helped by another's prefix-cache entries
    return with_overrides(base, name=f"bench-{name}{length}", model={"checkpoint": model},
                          store={"path": str(root / "kv" / mode)}, components=components)


def measure(model: str, modes: list[str], prompts: dict[str, list[list[int]]], batches: list[int], new_tokens: int,
            root: Path) -> dict[str, dict]:
    """Every mode's pipeline up at once; each group of prompts runs on every mode in turn (the order
    reversed every other group), so a drift of the machine's speed falls on all modes alike."""
    results: dict[str, dict] = {mode: {} for mode in modes}
    with ExitStack() as stack:
        supervisors = {mode: stack.enter_context(Supervisor(pipeline_spec(model, mode, root),
                                                            root / f"run-{mode.replace(':', '')}"))
                       for mode in modes}
        for supervisor in supervisors.values():
            run_batch(supervisor, [prompts[next(iter(prompts))][0][:8]], 2)  # first-call costs out of the way
        for domain, group in prompts.items():
            for batch in batches:
                outputs, wall = {mode: [] for mode in modes}, dict.fromkeys(modes, 0.0)
                for turn, i in enumerate(range(0, len(group), batch)):
                    for mode in (modes if turn % 2 == 0 else modes[::-1]):
                        got, seconds = run_batch(supervisors[mode], group[i : i + batch], new_tokens)
                        outputs[mode] += got
                        wall[mode] += seconds
                for mode in modes:
                    results[mode][f"{domain}/{batch}"] = row = summary(outputs[mode], wall[mode])
                    print(f"{mode:<8} {domain:<12} batch {batch}: {row['tokens_per_s']:.2f} tok/s", flush=True)
    return results


def summary(outputs: list, wall: float) -> dict:
    """Tokens, wall time, tokens/s and acceptance length of one mode's requests."""
    done = [d for _, d in outputs]
    verifications = sum(d.verifications for d in done)
    return {"tokens": [t for t, _ in outputs], "wall_s": round(wall, 3),
            "tokens_per_s": round(sum(d.generated_tokens for d in done) / wall, 2),
            "verifications": verifications,
            "acceptance_length": round((sum(d.accepted_tokens for d in done) + verifications) / verifications, 3)
            if verifications else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per domain")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--modes", default="off,auto,fixed:3,fixed:5")
    args = parser.parse_args()
    modes, batches = args.modes.split(","), [int(b) for b in args.batches.split(",")]
    if "off" not in modes:
        parser.error("--modes must include off: it is the baseline")
    tokenizer = Tokenizer.from_file(str(open_model_dir(args.model).tokenizer_path))
    prompts = held_out_prompts(tokenizer, args.prompts, args.prompt_len)
    root = Path(tempfile.mkdtemp(prefix="d41ds", dir="/tmp"))
    results = measure(args.model, modes, prompts, batches, args.new_tokens, root)
    plain = {key: row["tokens"] for key, row in results["off"].items()}
    table = []
    for mode, rows in results.items():
        for key, row in rows.items():
            differing = sum(a != b for a, b in zip(row.pop("tokens"), plain[key], strict=True))
            table.append({"mode": mode, "domain": key.split("/")[0], "batch": int(key.split("/")[1]), **row,
                          "vs_off": round(row["tokens_per_s"] / results["off"][key]["tokens_per_s"], 3),
                          "outputs_differing_from_off": differing})
    for row in table:
        print(f"{row['mode']:<8} {row['domain']:<12} {row['batch']:>5} {row['tokens_per_s']:>8.2f} "
              f"{row['vs_off']:>6.2f}x  acceptance {row['acceptance_length'] or '-'}  "
              f"differing {row['outputs_differing_from_off']}")
    RESULTS.mkdir(exist_ok=True)
    report = {"model": args.model, "prompts_per_domain": args.prompts, "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "pipeline": "local", "rows": table}
    (RESULTS / "dspark_pipeline.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
