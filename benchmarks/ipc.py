"""What the process split costs: decode step time through the `local` pipeline vs the in-process core.

In one run on `mini`: (1) the in-process core's decode step time after a `ced` prefill; (2) the
same request through the `local` pipeline (six processes over ipc://), its decode time per token;
(3) the round trip of one hop carrying a 4 x hidden bf16 activation (mini's 256 and the official
4096) to a component in another process, and of a ping; (4) the Engram prefetch lead: how long
the prompt's rows were ready before the encoder needed them, from the encoder's counters (a decode
step's rows are looked up by the encoder unless the engram option `prefetch_steps` is set). The
overhead share is (pipeline - in-process) / in-process step time; goal <= 5 %.
Writes benchmarks/results/ipc.json.
Usage: python benchmarks/ipc.py [--prompt-tokens 256] [--new-tokens 32] [--hops 2000]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dsv41 import messages as m
from dsv41.components.host import compute_threads
from dsv41.components.runtime import Component, ComponentError, Peer, Server, new_request_id
from dsv41.engine.core import InferenceCore
from dsv41.model.reference import random_model
from dsv41.pipelines.client import generate
from dsv41.pipelines.launch import Supervisor, with_overrides
from dsv41.pipelines.schema import load_pipeline

RESULTS = Path(__file__).parent / "results"


def in_process_step_ms(ids: list[int], new_tokens: int) -> float:
    core = InferenceCore(random_model("mini", 0))
    seq, logits = core.prefill(ids, "ced", capacity=len(ids) + new_tokens + 1, packed=True)
    times = []
    for _ in range(new_tokens):
        start = time.perf_counter()
        logits = core.step(seq, [int(logits.argmax(-1).reshape(-1)[-1])])
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def pipeline_run(ids: list[int], new_tokens: int, root: Path) -> dict:
    pipeline = with_overrides(load_pipeline("local"), store={"path": str(root / "kv")})
    with Supervisor(pipeline, root / "run") as supervisor:
        peer = supervisor.peer()
        events = list(generate(peer, ids=ids, max_new_tokens=new_tokens, stop_at_eos=False))
        encoder = supervisor.peer("encoder")
        counters = encoder.ping().counters
        peer.close()
        encoder.close()
    done = events[-1]
    return {"decode_ms_per_token": done.decode_s / (new_tokens - 1) * 1e3, "ttft_s": done.ttft_s,
            "engram_counters": {k: v for k, v in counters.items() if k.startswith("engram")}}


class Echo(Component):
    name = "echo"
    accepts = frozenset({m.KIND.DECODER_STEP})

    def handle(self, message, frames, reply) -> None:
        reply(m.Ack(request_id=message.request_id))


def serve_echo(endpoint: str) -> None:
    server = Server(Echo(), endpoint)
    server.run()


def wait_ready(endpoint: str, timeout_s: float = 60.0) -> None:
    peer, deadline = Peer(endpoint, "echo"), time.monotonic() + timeout_s
    try:
        while True:
            try:
                peer.ping(timeout_s=1.0)
                return
            except ComponentError:
                if time.monotonic() > deadline:
                    raise
    finally:
        peer.close()


def hop_us(endpoint: str, hidden: int, hops: int) -> dict[str, float]:
    """Median round trip of a DecoderStep carrying [1, 1, 4, hidden] bf16 streams + fp32 pre-mix."""
    peer = Peer(endpoint, "echo", timeout_s=10)
    streams, pre_mix = torch.randn(1, 1, 4, hidden).bfloat16(), torch.randn(1, 1, 4)
    times, pings = [], []
    for _ in range(hops):
        out = m.Frames()
        request = m.DecoderStep(request_id=new_request_id(), start=0, streams=out.add(streams),
                                pre_mix=out.add(pre_mix))
        start = time.perf_counter()
        peer.call(request, out)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        peer.ping()
        pings.append(time.perf_counter() - start)
    peer.close()
    return {"activation_round_trip_us": statistics.median(times) * 1e6, "ping_round_trip_us":
            statistics.median(pings) * 1e6, "activation_bytes": streams.numel() * 2 + pre_mix.numel() * 4}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--hops", type=int, default=2000)
    args = parser.parse_args()
    ids = torch.randint(3, 300, (args.prompt_tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    root = Path(tempfile.mkdtemp(prefix="d41ipc", dir="/tmp"))
    endpoint = f"ipc://{root}/echo.sock"
    echo = multiprocessing.get_context("spawn").Process(target=serve_echo, args=(endpoint,), daemon=True)
    echo.start()
    wait_ready(endpoint)
    hops = {f"hidden {h}": hop_us(endpoint, h, args.hops) for h in (256, 4096)}
    echo.kill()
    all_threads = torch.get_num_threads()
    in_process_all = in_process_step_ms(ids, args.new_tokens)
    torch.set_num_threads(compute_threads("decoder", load_pipeline("local")))  # what each model process gets
    in_process = in_process_step_ms(ids, args.new_tokens)
    piped = pipeline_run(ids, args.new_tokens, root)
    overhead = piped["decode_ms_per_token"] / in_process - 1
    per_step_hops = 4  # dspark -> encoder -> decoder and back carry the step; the Engram push and detokenize are small
    hop_share = per_step_hops * hops["hidden 256"]["activation_round_trip_us"] / 2 / 1e3 / in_process
    result = {"prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "in_process_step_ms": in_process,
              "in_process_step_ms_all_threads": in_process_all, "threads": [all_threads, torch.get_num_threads()],
              "pipeline": piped, "pipeline_overhead": overhead, "hop_share_of_step": hop_share, "hops": hops}
    print(f"{'measure':52} {'value':>12}")
    print(f"{f'in-process decode step (mini, {all_threads} threads, ms)':52} {in_process_all:12.2f}")
    print(f"{f'in-process decode step ({torch.get_num_threads()} threads, as each model process, ms)':52} "
          f"{in_process:12.2f}")
    print(f"{'local pipeline decode per token (ms)':52} {piped['decode_ms_per_token']:12.2f}")
    print(f"{'pipeline overhead vs in-process':52} {overhead:12.1%}")
    for name, h in hops.items():
        print(f"{'round trip, 4 x ' + name + ' activation (us)':52} {h['activation_round_trip_us']:12.1f}")
        print(f"{'round trip, ping (us)':52} {h['ping_round_trip_us']:12.1f}")
    print(f"{'4 one-way activation hops / in-process step':52} {hop_share:12.2%}")
    for key, value in piped["engram_counters"].items():
        print(f"{'encoder ' + key:52} {value:12}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ipc.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
