"""Decode step time by context length and layer kind, against its floor (`mini` by default).

Long caches are built synthetically (random but valid packed entries: prefilling a million tokens
through the reference-numerics model is out of reach on a CPU), then a few decode steps run over
a packed cache, with every weight already dequantized (`fill_weight_caches`, as a served model has
them after its warm-up). Each step is timed per layer and summed by kind: SWA-only, Full (ratio 2, scoring
every visible entry), Full building the candidate pool (ratio 1), Reindex (scores the pool),
Reuse. KV bytes read per step are counted from the plan and compared with this machine's copy
bandwidth measured in the same run, and its FLOPs (every multiply-add counted, as the CPU path
computes in fp32; `dsv41.engine.flops`) with the fp32 GEMM rate measured in the same run: the
larger of the two floors is what a step could take at best on this machine, and each step is
printed beside it. The KV the synthetic cache holds is reported as it is stored: packed global
entries per token, the page pools' reserved bytes, and the SWA rings. Then a batch of sequences
of different lengths steps one token each, as one batch (projections, MoE and the attention
kernel once over the batch) and one by one. `--tokens K [K ...]` also times a forward of K tokens
at each context, beside the one-token step: 2-8 tokens are a DSpark verification (a draft and the
token before it), 512 a prompt's chunk over a cached prefix (every layer; a `ced` prefill runs the
encoder's half over it). `--config` takes a built-in name or any official-format config.json
(random weights).
Writes benchmarks/results/decode.json (or --out).
Usage: python benchmarks/decode.py [--config mini] [--contexts 4096 16384 65536] [--steps 3]
       [--batch 4 --batch-context 8192] [--tokens 4 512] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dsv41.checkpoint import load_named_config
from dsv41.components.sequences import keep_freed_memory
from dsv41.config import Mode
from dsv41.engine.core import InferenceCore, Sequence
from dsv41.engine.flops import decode_token_flops
from dsv41.kernels.layouts import index_k_format, main_kv_format, swa_format
from dsv41.model.cache import DecodeCache
from dsv41.model.layers import fill_weight_caches
from dsv41.model.pages import PagePools
from dsv41.model.reference import random_model
from dsv41.model.tokenizer import load_tokenizer

RESULTS = Path(__file__).parent / "results"


def benchmark_model(config_name: str):
    """`config_name`'s model with seeded random weights and the Engram map of the tokenizer that
    comes with it (a built-in model's, or the one beside a config file; else the byte stand-in):
    `small`'s config counts the compressed ids of its trained tokenizer."""
    config = load_named_config(config_name)
    return random_model(config, seed=0, tokenizer=load_tokenizer(config_name, config.text_config.vocab_size))


def kind(spec) -> str:
    if spec.mode is Mode.FULL:
        return "Full, pool source" if spec.candidate_source else "Full, full-range indexer"
    return {Mode.SWA: "SWA-only", Mode.REINDEX: "Reindex (pool)", Mode.REUSE: "Reuse"}[spec.mode]


def random_entries(fmt, n: int, gen: torch.Generator) -> torch.Tensor:
    """n valid packed entries [n, bytes]: random finite codes, scales in a moderate range."""
    codes = torch.randint(0, 256, (n, fmt.code_bytes), generator=gen, dtype=torch.uint8)
    if not fmt.fp4:  # E4M3 S.1111.111 is NaN: use 448 instead
        codes = torch.where(codes & 0x7F == 0x7F, codes ^ 1, codes)
    low, high = (40, 56) if fmt.e4m3_scale else (120, 128)  # E4M3 ~0.125..1, E8M0 2^-7..1
    return torch.cat([codes, torch.randint(low, high, (n, fmt.scale_bytes), generator=gen, dtype=torch.uint8)], dim=1)


def synthetic_cache(model, context: int, steps: int, pools: PagePools | None = None) -> DecodeCache:
    gen = torch.Generator().manual_seed(context)
    cache = DecodeCache.allocate(model.config, 1, context + steps + 1, packed=True, pools=pools)
    for ring in cache.windows.values():
        ring.data[0] = random_entries(ring.fmt, ring.data.size(1), gen)
    for layer, group in cache.groups.items():
        n = context // model.plan.layers[layer].ratio
        for store in (group.main_kv, group.index_k):
            store.put_raw(0, random_entries(store.fmt, n, gen))
    cache.ids[:, :context] = torch.randint(3, model.config.text_config.vocab_size, (1, context), generator=gen)
    cache.length = context
    return cache


def kv_bytes_per_step(model, context: int) -> dict[str, int]:
    """Cache bytes one decode step reads, by layer kind, in the stored formats of the config."""
    t = model.config.text_config
    pool = t.candidate_topk_blocks * t.candidate_block_size
    ring = min(context, t.sliding_window) * swa_format(t.head_dim).entry_bytes
    main, index = main_kv_format(t.head_dim).entry_bytes, index_k_format(t.index_head_dim).entry_bytes
    out: dict[str, int] = {}
    for spec in model.plan.backbone:
        n = ring
        if spec.ratio:
            visible = context // spec.ratio
            n += min(t.index_topk, visible) * main  # gathered main-KV entries
            if spec.mode is Mode.FULL:
                n += visible * index  # every index key
            elif spec.mode is Mode.REINDEX:
                n += min(pool, visible) * index
        out[kind(spec)] = out.get(kind(spec), 0) + n
    return out


def held_kv(cache: DecodeCache) -> dict[str, int]:
    """What the cache holds: packed global entries, the pages reserved for them, the SWA rings."""
    pages = sum(store.nbytes for group in cache.groups.values() for store in (group.main_kv, group.index_k))
    return {"global_entries_bytes": cache.global_kv_bytes_held(), "global_pages_bytes": pages,
            "swa_ring_bytes": sum(ring.nbytes for ring in cache.windows.values())}


def time_layers(model, cache: DecodeCache, steps: int) -> dict[str, float]:
    per_layer: dict[int, list[float]] = {}
    originals = {}
    for layer in model.layers:
        originals[layer] = layer.forward

        def timed(*args, _layer=layer, **kwargs):
            start = time.perf_counter()
            out = originals[_layer](*args, **kwargs)
            per_layer.setdefault(_layer.spec.layer_id, []).append(time.perf_counter() - start)
            return out

        layer.forward = timed
    try:
        with torch.inference_mode():
            model(torch.tensor([[4]]), cache=cache)  # warm-up, not recorded
            per_layer.clear()
            for step in range(steps):
                logits = model(torch.tensor([[5 + step]]), cache=cache).logits
        if not logits.isfinite().all():
            raise RuntimeError("the synthetic cache gave non-finite logits: the timings would not be of real work")
    finally:
        for layer, forward in originals.items():
            layer.forward = forward
    by_kind: dict[str, float] = {}
    for layer in model.layers:
        name = kind(layer.spec)
        by_kind[name] = by_kind.get(name, 0.0) + statistics.median(per_layer[layer.spec.layer_id])
    return by_kind


def time_tokens(model, context: int, tokens: int, steps: int) -> float:
    """Median seconds of a forward of `tokens` tokens over a synthetic cache of `context` tokens
    (fewer where the timed forwards would pass the context limit)."""
    limit = model.config.text_config.max_position_embeddings
    context = min(context, limit - (steps + 1) * tokens)
    if context < 1:
        raise SystemExit(f"--tokens {tokens}: {steps + 1} forwards of it pass the context limit of {limit} tokens")
    cache = synthetic_cache(model, context, (steps + 1) * tokens)
    times = []
    with torch.inference_mode():
        for step in range(steps + 1):  # the first is a warm-up
            start = time.perf_counter()
            ids = (torch.arange(tokens) + 5 + step) % (model.config.text_config.vocab_size - 3) + 3
            logits = model(ids.unsqueeze(0), cache=cache).logits
            times.append(time.perf_counter() - start)
    if not logits.isfinite().all():
        raise RuntimeError("the synthetic cache gave non-finite logits: the timings would not be of real work")
    return statistics.median(times[1:])


def time_batch(model, contexts: list[int], steps: int) -> dict:
    """Median seconds of one decode step of every sequence: batched, and one sequence at a time."""
    core = InferenceCore(model)
    seqs = [Sequence(synthetic_cache(model, c, 2 * steps + 2, core.pools)) for c in contexts]
    batched, alone = [], []
    core.step_batch(seqs, [[4]] * len(seqs))  # warm-up
    for step in range(steps):
        start = time.perf_counter()
        logits = core.step_batch(seqs, [[5 + step]] * len(seqs))
        batched.append(time.perf_counter() - start)
        if not all(out.isfinite().all() for out in logits):
            raise RuntimeError("the synthetic caches gave non-finite logits: the timings would not be of real work")
        start = time.perf_counter()
        for seq in seqs:
            core.step(seq, [5 + step])
        alone.append(time.perf_counter() - start)
    return {"contexts": contexts, "batched_s": statistics.median(batched), "one_by_one_s": statistics.median(alone),
            "pages_in_use": core.pages_in_use}


def gemm_rate() -> float:
    """FLOP/s of a large fp32 matmul with torch's threads (the best the CPU path's compute gets)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    start = time.perf_counter()
    for _ in range(5):
        a @ b
    return 5 * 2 * 2048**3 / (time.perf_counter() - start)


def copy_bandwidth() -> float:
    src = torch.empty(128 * 2**20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    return 2 * 5 * src.numel() / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="mini",
                        help="a built-in config name or an official-format config.json (random weights)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4, help="sequences in the batched step (0: skip it)")
    parser.add_argument("--batch-context", type=int, default=8192,
                        help="context of the longest sequence of the batch; the others hold 1/2, 1/4, ...")
    parser.add_argument("--tokens", type=int, nargs="*", default=[],
                        help="also time a forward of each of these token counts at each context (4: a DSpark "
                             "verification, 512: a prompt chunk over a cached prefix)")
    parser.add_argument("--out", type=Path, default=RESULTS / "decode.json")
    args = parser.parse_args()
    if any(tokens < 1 for tokens in args.tokens):
        parser.error(f"--tokens takes token counts of at least 1, got {args.tokens}")
    keep_freed_memory()  # the allocator policy the model components run with (DSV41_MALLOC=system: none)
    model = benchmark_model(args.config)
    fill_weight_caches(model)  # steady state: a routed expert's first token would pay its dequantization
    bandwidth, rate = copy_bandwidth(), gemm_rate()
    print(f"copy bandwidth (read + write): {bandwidth / 1e9:.1f} GB/s; fp32 GEMM: {rate / 1e9:.1f} GFLOP/s")
    rows = []
    limit = model.config.text_config.max_position_embeddings
    for context in args.contexts:
        context = min(context, limit - args.steps - 1)  # room for the timed steps inside the context limit
        cache = synthetic_cache(model, context, args.steps)
        times = time_layers(model, cache, args.steps)
        kv = kv_bytes_per_step(model, context)
        total_s, total_b = sum(times.values()), sum(kv.values())
        flops = decode_token_flops(model.config, context, weighted=False).total
        floor = max(total_b / bandwidth, flops / rate)
        held = held_kv(cache)
        rows.append({"context": context, "step_s": total_s, "kv_bytes": total_b, "by_kind_s": times,
                     "by_kind_kv_bytes": kv, "kv_bytes_over_bandwidth_s": total_b / bandwidth, "flops": flops,
                     "flops_over_gemm_rate_s": flops / rate, "floor_s": floor, "step_over_floor": total_s / floor,
                     "held": held, "global_bytes_per_token": held["global_entries_bytes"] / context})
        print(f"\ncontext {context:,}: step {total_s * 1e3:.0f} ms against a floor of {floor * 1e3:.2f} ms "
              f"({total_s / floor:.0f}x); KV read {total_b / 2**20:.1f} MiB "
              f"(= {total_b / bandwidth * 1e3:.2f} ms at copy bandwidth); {flops / 1e9:.2f} GFLOP "
              f"(= {flops / rate * 1e3:.2f} ms at the GEMM rate)")
        print(f"  held: global KV {held['global_entries_bytes'] / context:.0f} B/token packed "
              f"({held['global_pages_bytes'] / 2**20:.1f} MiB of pages reserved), SWA rings "
              f"{held['swa_ring_bytes'] / 2**20:.2f} MiB")
        for name, seconds in times.items():
            print(f"  {name:<26} {seconds * 1e3:>9.1f} ms  {kv[name] / 2**20:>9.2f} MiB")
        if args.tokens:
            one = time_tokens(model, context, 1, args.steps)
            rows[-1]["several_tokens"] = {"one_token_s": one}
            print(f"  a forward of 1 token (whole model): {one * 1e3:.0f} ms")
            for tokens in args.tokens:
                several = time_tokens(model, context, tokens, args.steps)
                rows[-1]["several_tokens"][str(tokens)] = several
                print(f"  a forward of {tokens} tokens: {several * 1e3:.0f} ms, {several / one:.2f}x one token, "
                      f"{tokens / several:.0f} tokens/s")
        del cache
    batch = None
    if args.batch:
        batch = time_batch(model, [max(1, args.batch_context >> i) for i in range(args.batch)], args.steps)
        print(f"\n{args.batch} sequences of {batch['contexts']} tokens, one token each: batched "
              f"{batch['batched_s'] * 1e3:.0f} ms, one by one {batch['one_by_one_s'] * 1e3:.0f} ms "
              f"(ratio {batch['batched_s'] / batch['one_by_one_s']:.2f}); {batch['pages_in_use']} pages in use")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    summary = {"config": args.config, "bandwidth": bandwidth, "gemm_flops_per_s": rate, "rows": rows, "batch": batch}
    args.out.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
