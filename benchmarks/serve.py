"""Serving over HTTP: `dsv41 serve` driven by the official `openai` client on loopback.

Starts `dsv41 serve` (the `local` pipeline: six processes over ipc://, the trained `small` model by
default, a fresh store) and measures, from the client's side of /v1/completions with streaming:

1. concurrency: 1, 4 and 8 closed-loop streams, each sending requests back to back; output tokens/s
   over the wall time, TTFT and inter-token latency (time between two streamed chunks of a request)
   p50/p99. Each level has its own prompts (so no level is helped by another's prefix-cache entries).
   Two workloads: `trace`, prompt and output lengths drawn from the Azure conversation trace
   (lengths / --scale, outputs at most --new-tokens; one draw of 8 x --per-stream requests that
   every level runs, so the levels compare the same work), and `decode`, short prompts
   (--decode-prompt tokens) and --decode-tokens outputs, where the batched decode step is nearly
   all the work. Goal: 8 streams give >= 4x the output tokens/s of one, with p99 inter-token
   latency <= 3x.
2. trace replay: arrival times, prompt and output lengths from a Mooncake trace (prompts made of one
   fixed random token block per hash id, so requests that share hash ids share a prefix), scaled down
   to this machine: lengths / --scale, time compressed by --speedup, at most --requests requests.
   Reports the same, plus the share of prompt tokens served from the prefix cache.

Writes benchmarks/results/serve.json (or --out).
Usage: python benchmarks/serve.py [--model small | --config micro] [--scale 16] [--requests 16]
       [--per-stream 4] [--new-tokens 32] [--decode-prompt 16] [--decode-tokens 64] [--chunk-size 64]
       [--workloads trace,decode,replay] [--dspark off|auto|fixed] [--out PATH]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import openai

from dsv41.pipelines.launch import with_overrides
from dsv41.pipelines.schema import load_pipeline

RESULTS = Path(__file__).parent / "results"
TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"
TRACE = TRACES / "mooncake_fast25" / "conversation_trace.jsonl"
LENGTHS = TRACES / "azure_llm_2023" / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake traces


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


class Server:
    """`dsv41 serve` in a subprocess on a free loopback port."""

    def __init__(self, pipeline_file: Path, runtime_dir: Path, store: Path):
        dsv41 = str(Path(sys.executable).parent / "dsv41")
        self.proc = subprocess.Popen([dsv41, "serve", str(pipeline_file), "--port", "0", "--runtime-dir",
                                      str(runtime_dir), "--store", str(store)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, "DSV41_API_KEY": ""})
        line = self.proc.stdout.readline()
        if "OpenAI API at " not in line:
            self.proc.kill()
            raise RuntimeError(f"dsv41 serve did not start: {line}{self.proc.stderr.read()}")
        self.url = line.split("OpenAI API at ")[1].split("/v1")[0]
        self.model = line.split("(model ")[1].split(")")[0]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def one_request(client: openai.OpenAI, model: str, prompt: list[int], new_tokens: int) -> dict:
    """Stream one completion; arrival times of its chunks and its usage."""
    sent = time.perf_counter()
    times, usage = [], None
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=new_tokens, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            usage = chunk.usage
    return {"sent": sent, "times": times, "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0}


def summarize(results: list[dict], wall_s: float) -> dict:
    ttft = [r["times"][0] - r["sent"] for r in results if r["times"]]
    itl = [b - a for r in results for a, b in zip(r["times"], r["times"][1:], strict=False)]
    tokens = sum(r["completion_tokens"] for r in results)
    prompt = sum(r["prompt_tokens"] for r in results)
    return {"requests": len(results), "wall_s": round(wall_s, 3), "output_tokens": tokens,
            "output_tokens_per_s": round(tokens / wall_s, 2), "prompt_tokens": prompt,
            "cached_share": round(sum(r["cached_tokens"] for r in results) / prompt, 4) if prompt else 0.0,
            "ttft_p50_ms": round(1000 * percentile(ttft, 50), 1), "ttft_p99_ms": round(1000 * percentile(ttft, 99), 1),
            "itl_p50_ms": round(1000 * percentile(itl, 50), 1), "itl_p99_ms": round(1000 * percentile(itl, 99), 1)}


def closed_loop(server: Server, streams: int, requests: list[tuple[list[int], int]]) -> dict:
    """`streams` clients, each sending its share of the (prompt, output length) requests back to back."""
    results, lock = [], threading.Lock()
    shares = [requests[i::streams] for i in range(streams)]

    def worker(share: list[tuple[list[int], int]]) -> None:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
        for prompt, new_tokens in share:
            result = one_request(client, server.model, prompt, new_tokens)
            with lock:
                results.append(result)

    threads = [threading.Thread(target=worker, args=(share,)) for share in shares]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"streams": streams, **summarize(results, time.perf_counter() - start)}


def trace_lengths(path: Path, count: int, scale: int, max_new: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths of `count` requests drawn from an Azure trace, divided by `scale`."""
    with open(path) as f:
        rows = [(int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(f)]
    picked = random.Random(seed).sample(rows, count)
    return [(max(1, p // scale), max(1, min(max_new, o // scale))) for p, o in picked]


def load_trace(path: Path, count: int) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) == count:
                break
    return rows


def trace_prompts(rows: list[dict], scale: int, vocab: int, context: int, new_tokens: int, seed: int):
    """Prompt ids per trace row: one random block of MOONCAKE_BLOCK / scale tokens per hash id, cut to
    input_length / scale; outputs output_length / scale, at most new_tokens."""
    block = max(1, MOONCAKE_BLOCK // scale)
    rng, blocks = random.Random(seed), {}
    out = []
    for row in rows:
        ids = []
        for h in row["hash_ids"]:
            if h not in blocks:
                blocks[h] = [rng.randrange(17, vocab) for _ in range(block)]
            ids += blocks[h]
        length = max(1, min(row["input_length"] // scale, len(ids), context - new_tokens - 1))
        out.append((ids[:length], max(1, min(new_tokens, row["output_length"] // scale))))
    return out


def replay(server: Server, requests: list[tuple[list[int], int]], arrivals: list[float]) -> dict:
    """Open loop: each request sent at its (compressed) arrival time."""
    results, lock = [], threading.Lock()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)

    def send(prompt, new_tokens) -> None:
        result = one_request(client, server.model, prompt, new_tokens)
        with lock:
            results.append(result)

    start = time.perf_counter()
    threads = []
    for (prompt, new_tokens), at in zip(requests, arrivals, strict=True):
        time.sleep(max(0.0, start + at - time.perf_counter()))
        threads.append(threading.Thread(target=send, args=(prompt, new_tokens)))
        threads[-1].start()
    for t in threads:
        t.join()
    return summarize(results, time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", help="A model directory or built-in model (default: small).")
    parser.add_argument("--config", help="Serve this config with random weights instead of --model.")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--scale", type=int, default=16, help="Divide the trace's lengths by this.")
    parser.add_argument("--speedup", type=float, default=4.0, help="Compress the trace's arrival times by this.")
    parser.add_argument("--lengths", type=Path, default=LENGTHS, help="Azure trace of the sweep's lengths.")
    parser.add_argument("--requests", type=int, default=16, help="Trace requests replayed (at least 1).")
    parser.add_argument("--per-stream", type=int, default=4, help="Requests per stream in the concurrency sweep.")
    parser.add_argument("--new-tokens", type=int, default=32, help="Output tokens per trace request (at most).")
    parser.add_argument("--decode-prompt", type=int, default=16, help="Prompt length of the decode workload.")
    parser.add_argument("--decode-tokens", type=int, default=64, help="Output tokens of the decode workload.")
    parser.add_argument("--chunk-size", type=int, default=64, help="Prefill chunk (the per-step prefill budget).")
    parser.add_argument("--workloads", default="trace,decode,replay",
                        help="Comma-separated: trace and decode (the concurrency sweep), replay (the Mooncake replay).")
    parser.add_argument("--levels", default="1,4,8",
                        help="Comma-separated concurrency levels of the sweep; the first is the ratios' base.")
    parser.add_argument("--out", type=Path, default=RESULTS / "serve.json", help="Where the JSON report goes.")
    parser.add_argument("--dspark", choices=("off", "auto", "fixed"),
                        help="DSpark mode of the served pipeline (default: the pipeline's; auto with a drafter).")
    args = parser.parse_args()
    if args.requests < 1:
        parser.error("--requests must be at least 1")
    workloads = args.workloads.split(",")
    try:
        levels = tuple(int(level) for level in args.levels.split(","))
    except ValueError:
        levels = ()
    if not levels or min(levels) < 1:
        parser.error(f"--levels takes positive stream counts, got {args.levels!r}")
    if not workloads or set(workloads) - {"trace", "decode", "replay"}:
        parser.error(f"--workloads takes trace, decode and replay, got {args.workloads!r}")

    root = Path(tempfile.mkdtemp(prefix="d41srv", dir="/tmp"))
    model = {"config": args.config, "checkpoint": None} if args.config else {"checkpoint": args.model}
    pipeline = with_overrides(load_pipeline("local"), name="bench", model=model,
                              store={"block_tokens": 16 * max(1, MOONCAKE_BLOCK // args.scale // 16)},
                              generation={"chunk_size": args.chunk_size})
    if args.dspark:
        dspark = msgspec.structs.replace(pipeline.components["dspark"],
                                         options={**pipeline.components["dspark"].options, "mode": args.dspark})
        pipeline = with_overrides(pipeline, components={**pipeline.components, "dspark": dspark})
    (root / "pipeline.yaml").write_bytes(msgspec.yaml.encode(pipeline))
    from dsv41.components.context import ComponentContext

    config = ComponentContext(pipeline, {}, root).config
    vocab, context = config.text_config.vocab_size, config.text_config.max_position_embeddings
    server = Server(root / "pipeline.yaml", root / "run", root / "kv")
    report = {"model": server.model, "pipeline": "local (processes over ipc://)", "chunk_size": args.chunk_size,
              "dspark": args.dspark or "pipeline default",
              "cpu_count": os.cpu_count(), "scale": args.scale, "lengths": args.lengths.name}
    try:
        warm = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)
        one_request(warm, server.model, [17 + i % 100 for i in range(64)], 4)  # first-call costs out of the way
        report["concurrency"] = {}
        for workload in (w for w in ("trace", "decode") if w in workloads):
            sweep = []
            drawn = trace_lengths(args.lengths, max(levels) * args.per_stream, args.scale, args.new_tokens, seed=0)
            for level, streams in enumerate(levels):
                rng = random.Random(100 + level)
                lengths = drawn if workload == "trace" else [(args.decode_prompt, args.decode_tokens)] * (
                    streams * args.per_stream)  # (equal requests: fewer do for one stream)
                requests = [([rng.randrange(17, vocab) for _ in range(p)], o) for p, o in lengths]
                sweep.append({"workload": workload, **closed_loop(server, streams, requests)})
                print(json.dumps(sweep[-1]), flush=True)
            for row in sweep:
                row["throughput_vs_1"] = round(row["output_tokens_per_s"] / sweep[0]["output_tokens_per_s"], 2)
                row["itl_p99_vs_1"] = round(row["itl_p99_ms"] / sweep[0]["itl_p99_ms"], 2)
            report["concurrency"][workload] = sweep
        if "replay" in workloads:
            rows = load_trace(args.trace, args.requests)
            requests = trace_prompts(rows, args.scale, vocab, context, args.new_tokens, seed=7)
            first = rows[0]["timestamp"]
            arrivals = [(row["timestamp"] - first) / 1000 / args.speedup for row in rows]
            report["trace"] = {"file": args.trace.name, "scale": args.scale, "speedup": args.speedup,
                               **replay(server, requests, arrivals)}
            print(json.dumps(report["trace"]), flush=True)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    report["goal"] = {}
    for workload, sweep in report["concurrency"].items():
        if sweep[0]["streams"] != 1 or sweep[-1]["streams"] != 8:
            continue  # the goal compares 8 streams with 1
        eight = sweep[-1]
        report["goal"][workload] = {"throughput_8_vs_1": eight["throughput_vs_1"], "throughput_goal": 4.0,
                                    "itl_p99_8_vs_1": eight["itl_p99_vs_1"], "itl_p99_goal": 3.0,
                                    "met": eight["throughput_vs_1"] >= 4.0 and eight["itl_p99_vs_1"] <= 3.0}
    print(f"\n{'workload':<8} {'streams':>8} {'prompt':>7} {'tok/s':>8} {'x1':>6} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8} {'p99 x1':>7}")
    for workload, sweep in report["concurrency"].items():
        for row in sweep:
            print(f"{workload:<8} {row['streams']:>8} {row['prompt_tokens'] / row['requests']:>7.0f} "
                  f"{row['output_tokens_per_s']:>8.1f} {row['throughput_vs_1']:>6.2f} {row['ttft_p50_ms']:>9.1f} "
                  f"{row['ttft_p99_ms']:>9.1f} {row['itl_p50_ms']:>8.1f} {row['itl_p99_ms']:>8.1f} "
                  f"{row['itl_p99_vs_1']:>7.2f}")
    if "trace" in report:
        t = report["trace"]
        print(f"trace {t['file']} ({t['requests']} requests): {t['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
              f"{t['ttft_p50_ms']:.0f} ms p99 {t['ttft_p99_ms']:.0f} ms, ITL p50 {t['itl_p50_ms']:.1f} ms p99 "
              f"{t['itl_p99_ms']:.1f} ms, cached share {t['cached_share']:.1%}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
