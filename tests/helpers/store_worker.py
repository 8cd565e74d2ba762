"""A store process for the crash and concurrency tests (no torch import: starts fast).

    store_worker.py write PATH START CAPACITY_BLOCKS -- write batches START, START+1, ... forever;
                                         print "ack N" after batch N commits; evicts beyond capacity
    store_worker.py read PATH          -- read every stored block forever, checking each; print
                                         "read N" every 50 reads, "torn" on a bad value
    store_worker.py hold PATH          -- hold every free reader slot in open read transactions;
                                         print "holding N", then sleep a minute
"""

import struct
import sys
import time

import lmdb

from dsv41.storage.blockfmt import BlockLayout
from dsv41.storage.store import GlobalKVStore, StoreConfig

LAYOUT = BlockLayout(16, ((2, 288, 68), (1, 288, 68)))
BATCH = 4  # blocks per batch


def batch_keys(batch: int) -> list[bytes]:
    return [struct.pack("<II", batch, i) + bytes(24) for i in range(BATCH)]


def payload(batch: int, i: int) -> bytes:
    unit = struct.pack("<II", batch, i)
    return (unit * (LAYOUT.payload_bytes // len(unit) + 1))[: LAYOUT.payload_bytes]


def write(path: str, start: int, capacity_blocks: int) -> None:
    capacity = capacity_blocks * (LAYOUT.payload_bytes + 64)
    store = GlobalKVStore(path, LAYOUT, StoreConfig(capacity_bytes=capacity, min_age_s=0))
    batch = start
    while True:
        store.put_many({key: payload(batch, i) for i, key in enumerate(batch_keys(batch))})
        print(f"ack {batch}", flush=True)
        batch += 1


def read(path: str) -> None:
    store = GlobalKVStore(path, LAYOUT, readonly=True)
    reads = 0
    while True:
        with store.reader() as r:
            for key, *_ in list(store.entries()):
                view = r.get(key)
                if view is None:
                    continue
                batch, i = struct.unpack("<II", key[:8])
                if bytes(view) != payload(batch, i):
                    print("torn", flush=True)
                reads += 1
                if reads % 50 == 0:
                    print(f"read {reads}", flush=True)


def hold(path: str) -> None:
    env = lmdb.open(path, readonly=True, max_dbs=3, lock=True, max_spare_txns=0, lib_version=0)
    held = []
    try:
        while True:
            held.append(env.begin())
    except lmdb.ReadersFullError:
        print(f"holding {len(held)}", flush=True)
    time.sleep(60)


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    elif sys.argv[1] == "hold":
        hold(sys.argv[2])
    else:
        read(sys.argv[2])
