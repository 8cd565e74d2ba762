"""Kernel throughput in GB/s of packed cache bytes, against copy bandwidth measured in the same run.

CPU: the torch twins (what dsv41 runs without a GPU). GPU (when present): each Triton kernel
timed with triton.testing.do_bench (median). Prints a table and writes
benchmarks/results/kernels.json. Usage: python benchmarks/kernels.py [--entries N] [--repeats N]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from dsv41.kernels import torch_ops
from dsv41.kernels.layouts import index_k_format, main_kv_format, swa_format

RESULTS = Path(__file__).parent / "results"


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cases(entries: int, device: str) -> dict[str, tuple]:
    """name -> (kernel name, args, packed bytes read per call). Sizes follow `mini` (head 512,
    index 128, window 128, Top-512, 4 query heads, 4 indexer heads)."""
    g = torch.Generator().manual_seed(0)
    d, di, window, k, heads = 512, 128, 128, 512, 4

    def rows(n, dim):
        return torch.randn(n, dim, generator=g).bfloat16().to(device)

    ring = torch_ops.pack_rows(rows(window, d).cpu(), swa_format(d)).unsqueeze(0).to(device)
    main = torch_ops.pack_rows(rows(entries, d).cpu(), main_kv_format(d)).unsqueeze(0).to(device)
    keys = torch_ops.pack_rows(rows(entries, di).cpu(), index_k_format(di)).unsqueeze(0).to(device)
    slots = torch.arange(window, device=device).int().unsqueeze(0)
    topk = torch.randperm(entries, generator=g)[:k].sort().values.int().unsqueeze(0).to(device)
    q = torch.randn(1, heads, d, generator=g).bfloat16().to(device)
    qi = torch.randn(1, heads, di, generator=g).bfloat16().to(device)
    weights = torch.randn(1, heads, generator=g).bfloat16().to(device)
    sink = torch.randn(heads, generator=g).to(device)
    tokens, hidden = 64, 256
    x = torch.randn(1, tokens, 4, hidden, generator=g).bfloat16().to(device)
    f = torch.randn(1, tokens, hidden, generator=g).bfloat16().to(device)
    post, mix = torch.rand(1, tokens, 4, device=device), torch.rand(1, tokens, 4, device=device)
    comb = torch.softmax(torch.randn(1, tokens, 4, 4, device=device), -1)
    fn = torch.randn(24, 4 * hidden, device=device) * 0.03
    scale, base = torch.ones(3, device=device), torch.zeros(24, device=device)
    n_pack = 4096
    return {
        f"pack main KV x{n_pack}": ("pack_rows", (rows(n_pack, d), main_kv_format(d)), n_pack * 288),
        f"pack indexer K x{n_pack}": ("pack_rows", (rows(n_pack, di), index_k_format(di)), n_pack * 68),
        f"pack SWA x{n_pack}": ("pack_rows", (rows(n_pack, d), swa_format(d)), n_pack * 528),
        f"decode attention W{window}+top{k}": ("sparse_attention_decode",
                                               (q, ring, slots, main, topk, sink, d**-0.5), window * 528 + k * 288),
        f"index scores x{entries}": ("index_scores", (qi, weights, keys), entries * 68),
        f"fused mHC x{tokens} (hidden {hidden})": ("mhc_update", (x, f, post, comb, mix, fn, scale, base, 20, 1e-6,
                                                                  1e-20), tokens * 4 * hidden * 2),
    }


def copy_bandwidth(device: str, repeats: int, timer) -> float:
    src = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timer(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() / seconds / 1e9  # read + write


def run(device: str, module, timer, repeats: int, entries: int) -> dict:
    copy = copy_bandwidth(device, repeats, timer)
    rows = []
    for name, (kernel, args, nbytes) in cases(entries, device).items():
        seconds = timer(lambda kernel=kernel, args=args: getattr(module, kernel)(*args), repeats)
        rows.append({"case": name, "seconds": seconds, "packed_bytes": nbytes, "gb_per_s": nbytes / seconds / 1e9,
                     "ratio_to_copy": nbytes / seconds / 1e9 / copy})
    return {"device": device, "copy_gb_per_s": copy, "rows": rows}


def print_table(title: str, result: dict) -> None:
    print(f"\n{title}: copy bandwidth {result['copy_gb_per_s']:.2f} GB/s (read + write, same run)")
    print(f"{'case':<38} {'time ms':>10} {'GB/s':>9} {'of copy':>8}")
    for row in result["rows"]:
        print(f"{row['case']:<38} {row['seconds'] * 1e3:>10.3f} {row['gb_per_s']:>9.3f} {row['ratio_to_copy']:>8.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=65536, help="global KV entries in the cache (default 65536)")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    report = {"machine": platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "entries": args.entries}
    report["cpu_torch"] = run("cpu", torch_ops, median_seconds, args.repeats, args.entries)
    print_table("CPU, torch twins", report["cpu_torch"])
    if torch.cuda.is_available():
        import triton.testing

        from dsv41.kernels import triton_kernels

        def do_bench(fn, repeats):
            return triton.testing.do_bench(fn, return_mode="median") / 1e3

        report["gpu_triton"] = run("cuda", triton_kernels, do_bench, args.repeats, args.entries)
        print_table(f"GPU ({torch.cuda.get_device_name()}), Triton", report["gpu_triton"])
    else:
        report["gpu_triton"] = None
        print("\nno GPU here: the Triton kernels were not timed")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kernels.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {RESULTS / 'kernels.json'}")


if __name__ == "__main__":
    main()
