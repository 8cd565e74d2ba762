"""Pipeline overhead: greedy decoding through the components against the same steps in one process.

The same prompt and model decode `--tokens` tokens (DSpark off, temperature 0) two ways, in
alternating rounds (each way first in every other round) so that both see the same machine (its
speed drifts within minutes):

* in process: `InferenceCore.prefill` then one `InferenceCore.step` per token, on one thread (what
  each component computes with);
* through a pipeline (`local`: a process per component over ipc://; `inproc`: threads): the tokens
  a client receives from `generate`.

Reported per round: the median time per decoded token (the prefill is left out; a median, since
the machine's short stalls hit single tokens), and the overhead, pipeline / in process - 1, of
rounds run back to back; for `local` also the CPU seconds per token of all component processes
against the in-process thread's (work added by messages and hand-offs, not by waiting). Both ways
must produce the same tokens; the benchmark stops if they do not. Goal (docs/performance.md):
overhead <= 5 %.
Writes benchmarks/results/pipeline_overhead.json.
Usage: python benchmarks/pipeline_overhead.py [--model small] [--pipelines local,inproc] [--prompt 64]
       [--tokens 24] [--rounds 8]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import msgspec
import torch

from dsv41 import messages as m
from dsv41.checkpoint import load_model
from dsv41.engine.core import InferenceCore
from dsv41.pipelines.client import generate
from dsv41.pipelines.launch import Supervisor, with_overrides
from dsv41.pipelines.schema import load_pipeline

RESULTS = Path(__file__).parent / "results"


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of processes so far."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def in_process(core: InferenceCore, prompt: list[int], tokens: int) -> tuple[list[int], list[float], float]:
    """Greedy tokens, the seconds of each decoded token and the CPU seconds of decoding."""
    with torch.inference_mode():
        seq, logits = core.prefill(prompt, capacity=len(prompt) + tokens + 1, packed=True)
        out, gaps = [int(logits.argmax())], []
        cpu = time.thread_time()
        while len(out) < tokens:
            started = time.perf_counter()
            out.append(int(core.step(seq, [out[-1]])[-1].argmax()))
            gaps.append(time.perf_counter() - started)
        cpu = time.thread_time() - cpu
        core.release(seq)
    return out, gaps, cpu


def through(supervisor: Supervisor, prompt: list[int], tokens: int, pids: list[int]):
    """The same through the pipeline: tokens, the gaps between them and the processes' CPU seconds."""
    peer = supervisor.peer()
    out, times, cpu = [], [], 0.0
    try:
        for event in generate(peer, ids=prompt, max_new_tokens=tokens, stop_at_eos=False):
            if isinstance(event, m.TokenEvent):
                if not out and pids:
                    cpu = cpu_seconds(pids)
                out.append(event.token)
                times.append(time.perf_counter())
    finally:
        peer.close()
    cpu = cpu_seconds(pids) - cpu if pids else 0.0
    return out, [b - a for a, b in zip(times, times[1:], strict=False)], cpu


def start(name: str, model: str, root: Path) -> Supervisor:
    pipeline = load_pipeline(name)
    dspark = msgspec.structs.replace(pipeline.components["dspark"],
                                     options={**pipeline.components["dspark"].options, "mode": "off"})
    pipeline = with_overrides(pipeline, name=f"overhead-{name}", model={"checkpoint": model},
                              components={**pipeline.components, "dspark": dspark})
    return Supervisor(pipeline, root / name).start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small", help="A model directory or built-in model (default: small).")
    parser.add_argument("--pipelines", default="local,inproc", help="Comma-separated built-in pipelines.")
    parser.add_argument("--prompt", type=int, default=64, help="Prompt tokens (random ids).")
    parser.add_argument("--tokens", type=int, default=24, help="Tokens decoded per run (at least 2).")
    parser.add_argument("--rounds", type=int, default=8, help="Alternating rounds of each way.")
    args = parser.parse_args()
    if args.tokens < 2 or args.rounds < 1:
        parser.error("--tokens must be at least 2 and --rounds at least 1")
    torch.set_num_threads(1)
    model, _ = load_model(args.model)
    model.eval()
    core = InferenceCore(model)
    vocab = model.config.text_config.vocab_size
    root = Path(tempfile.mkdtemp(prefix="d41ovh", dir="/tmp"))
    report = {"model": args.model, "prompt": args.prompt, "tokens": args.tokens, "cpu_count": os.cpu_count(),
              "pipelines": {}}
    try:
        for name in args.pipelines.split(","):
            supervisor = start(name, args.model, root)
            pids = [child.proc.pid for child in supervisor.children.values() if getattr(child, "proc", None)]
            rows = []
            try:
                for round_ in range(args.rounds + 1):  # round 0 warms both ways up and is not kept
                    g = torch.Generator().manual_seed(round_)
                    prompt = torch.randint(17, vocab, (args.prompt,), generator=g).tolist()
                    if round_ % 2:  # each way goes first in every other round
                        piped, piped_gaps, piped_cpu = through(supervisor, prompt, args.tokens, pids)
                        alone, alone_gaps, alone_cpu = in_process(core, prompt, args.tokens)
                    else:
                        alone, alone_gaps, alone_cpu = in_process(core, prompt, args.tokens)
                        piped, piped_gaps, piped_cpu = through(supervisor, prompt, args.tokens, pids)
                    if alone != piped:
                        raise SystemExit(f"{name}: the pipeline's tokens differ from the in-process ones: "
                                         f"{piped} against {alone}")
                    if round_:
                        per = [statistics.median(gaps) * 1e3 for gaps in (alone_gaps, piped_gaps)]
                        row = {"in_process_ms": round(per[0], 2), "pipeline_ms": round(per[1], 2),
                               "overhead": round(per[1] / per[0] - 1, 4)}
                        if pids:
                            # the pipeline's CPU from its first token on covers tokens-1 steps, as the loop's
                            row.update(in_process_cpu_ms=round(alone_cpu / (args.tokens - 1) * 1e3, 2),
                                       pipeline_cpu_ms=round(piped_cpu / (args.tokens - 1) * 1e3, 2),
                                       cpu_overhead=round(piped_cpu / alone_cpu - 1, 4))
                        rows.append(row)
                        print(json.dumps({"pipeline": name, **row}), flush=True)
            finally:
                supervisor.stop()
            report["pipelines"][name] = {"rounds": rows,
                                         "median_overhead": statistics.median(r["overhead"] for r in rows)}
            if pids:
                report["pipelines"][name]["median_cpu_overhead"] = statistics.median(r["cpu_overhead"] for r in rows)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{'pipeline':<8} {'in process ms/token':>20} {'pipeline ms/token':>18} {'overhead':>9} "
          f"{'CPU ms/token (in process, pipeline)':>36} {'CPU overhead':>13}")
    for name, result in report["pipelines"].items():
        for row in result["rounds"]:
            cpu = (f"{row['in_process_cpu_ms']:>17.1f}, {row['pipeline_cpu_ms']:>17.1f} {row['cpu_overhead']:>13.1%}"
                   if "cpu_overhead" in row else "")
            print(f"{name:<8} {row['in_process_ms']:>20.1f} {row['pipeline_ms']:>18.1f} {row['overhead']:>9.1%} {cpu}")
        cpu = f"{result['median_cpu_overhead']:>50.1%}" if "median_cpu_overhead" in result else ""
        print(f"{name:<8} {'median':>20} {'':>18} {result['median_overhead']:>9.1%} {cpu}   (goal <= 5%)")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipeline_overhead.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
