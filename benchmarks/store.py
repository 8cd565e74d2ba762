"""Global-KV store throughput against this disk's sequential bandwidth, measured in one run.

Writes then reads blocks of the `mini` layout (global KV of 256-token blocks, 222.5 KiB each, and
512-token blocks), in batches of one transaction, with LMDB's default durable commits; the disk
baseline writes (fsync) and reads a plain file of the same total size in the same folder. Reads
of both come from the page cache after writing, so the ratio compares like with like. Prints a
table and writes benchmarks/results/store.json.
Usage: python benchmarks/store.py [--mib 256] [--batch 16] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from dsv41.config import load_config
from dsv41.storage.blockfmt import BlockLayout
from dsv41.storage.store import GlobalKVStore, StoreConfig

RESULTS = Path(__file__).parent / "results"


def disk_bandwidth(folder: Path, total: int) -> tuple[float, float]:
    path, chunk = folder / "seq.bin", os.urandom(4 * 2**20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(total // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())
    write = total / (time.perf_counter() - start)
    start = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(len(chunk)):
            pass
    read = total / (time.perf_counter() - start)
    path.unlink()
    return write, read


def store_bandwidth(folder: Path, block_tokens: int, total: int, batch: int) -> dict:
    layout = BlockLayout.of(load_config("mini"), block_tokens)
    payload = os.urandom(layout.payload_bytes)
    n = total // layout.payload_bytes
    keys = [i.to_bytes(32, "little") for i in range(n)]
    store = GlobalKVStore(folder / f"store{block_tokens}", layout, StoreConfig(capacity_bytes=4 * total))
    start = time.perf_counter()
    for i in range(0, n, batch):
        store.put_many({k: payload for k in keys[i : i + batch]})
    write = n * layout.payload_bytes / (time.perf_counter() - start)
    start = time.perf_counter()
    with store.reader() as r:
        for k in keys:
            assert r.get(k) is not None  # checksummed zero-copy view
    read = n * layout.payload_bytes / (time.perf_counter() - start)
    store.close()
    return {"block_tokens": block_tokens, "block_bytes": layout.payload_bytes, "blocks": n, "write": write,
            "read": read}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="bytes written per case (default 256 MiB)")
    parser.add_argument("--batch", type=int, default=16, help="blocks per write transaction")
    parser.add_argument("--dir", default=None, help="folder on the disk to measure (default: a temp folder)")
    args = parser.parse_args()
    total = args.mib * 2**20
    folder = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        disk_write, disk_read = disk_bandwidth(folder, total)
        rows = [store_bandwidth(folder, tokens, total, args.batch) for tokens in (256, 512)]
    finally:
        shutil.rmtree(folder)
    print(f"disk sequential: write {disk_write / 1e6:.0f} MB/s (fsync), read {disk_read / 1e6:.0f} MB/s (page cache)")
    print(f"{'block':>6} {'bytes':>9} {'write MB/s':>11} {'of disk':>8} {'read MB/s':>10} {'of disk':>8}")
    for r in rows:
        r["write_of_disk"], r["read_of_disk"] = r["write"] / disk_write, r["read"] / disk_read
        print(f"{r['block_tokens']:>6} {r['block_bytes']:>9,} {r['write'] / 1e6:>11.0f} {r['write_of_disk']:>8.0%} "
              f"{r['read'] / 1e6:>10.0f} {r['read_of_disk']:>8.0%}")
    RESULTS.mkdir(exist_ok=True)
    report = {"mib": args.mib, "batch": args.batch, "disk_write": disk_write, "disk_read": disk_read, "rows": rows}
    (RESULTS / "store.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {RESULTS / 'store.json'}")


if __name__ == "__main__":
    main()
