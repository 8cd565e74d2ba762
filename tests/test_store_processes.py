"""The store under real process crashes: a SIGKILLed writer, concurrent readers, a killed reader."""

import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dsv41.storage.store import CRASH_EXIT, GlobalKVStore, StoreBusyError, StoreConfig

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import store_worker  # noqa: E402

WORKER = Path(__file__).parent / "helpers" / "store_worker.py"


class Worker:
    """A worker subprocess in its own process group; stdout lines are collected on a thread."""

    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self.thread = threading.Thread(target=self._pump, daemon=True)
        self.thread.start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line.strip())

    def wait_for(self, count: int, prefix: str, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while sum(line.startswith(prefix) for line in self.lines) < count:
            assert self.proc.poll() is None, f"worker exited: {self.lines[-3:]}"
            assert time.monotonic() < deadline, f"no {count} '{prefix}' lines in {timeout} s"
            time.sleep(0.005)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.thread.join(timeout=5)

    def acked(self) -> list[int]:
        return [int(line.split()[1]) for line in self.lines if line.startswith("ack ")]


def _batches_present(store: GlobalKVStore) -> dict[int, int]:
    counts: dict[int, int] = {}
    for key, *_ in store.entries():
        batch = struct.unpack("<I", key[:4])[0]
        counts[batch] = counts.get(batch, 0) + 1
    return counts


@pytest.mark.parametrize("rounds", [25, pytest.param(200, marks=pytest.mark.slow)])
def test_writer_killed_at_random_points_loses_nothing_acknowledged(tmp_path, rng, rounds):
    # the kill points and the batches checked follow the test seed, so a failure can be repeated;
    # the named points of the write path are checked one by one below
    path, next_batch, acked = str(tmp_path / "store"), 0, set()
    chance = random.Random(int(torch.randint(0, 2**31, (1,), generator=rng)))
    for _ in range(rounds):
        worker = Worker("write", path, str(next_batch), "1000000")
        try:
            worker.wait_for(chance.randint(0, 2), "ack ")
            time.sleep(chance.random() * 0.02)  # die anywhere, often inside a write transaction
        finally:
            worker.kill()
        acked.update(worker.acked())
        store = GlobalKVStore(path, store_worker.LAYOUT, StoreConfig(capacity_bytes=2**40, min_age_s=0))
        try:
            assert store.verify() == []
            present = _batches_present(store)
            assert all(count == store_worker.BATCH for count in present.values()), "a partial batch is visible"
            assert acked <= set(present), f"acknowledged batches lost: {sorted(acked - set(present))[:5]}"
            with store.reader() as r:
                for batch in chance.sample(sorted(present), min(3, len(present))):
                    for i, k in enumerate(store_worker.batch_keys(batch)):
                        assert r.get(k) == store_worker.payload(batch, i)
            next_batch = max(present, default=-1) + 1
        finally:
            store.close()
    assert len(acked) >= rounds // 2  # the writers really did commit batches


def test_readers_never_see_torn_values_and_a_killed_reader_does_not_block_the_writer(tmp_path):
    path = str(tmp_path / "store")
    writer = Worker("write", path, "0", "40")  # small capacity: the writer evicts all the time
    readers = []
    try:
        writer.wait_for(5, "ack ")
        readers = [Worker("read", path) for _ in range(3)]
        for reader in readers:
            reader.wait_for(2, "read ")
        readers[0].kill()  # SIGKILL, most likely inside a read transaction
        before = len(writer.acked())
        writer.wait_for(before + 30, "ack ")  # the writer goes on after the reader's death
        for reader in readers[1:]:
            reader.wait_for(4, "read ")
        assert not any("torn" in line for reader in readers for line in reader.lines)
    finally:
        for worker in [writer, *readers]:
            worker.kill()
    store = GlobalKVStore(path, store_worker.LAYOUT, StoreConfig(capacity_bytes=40 * 14_400, min_age_s=0))
    try:
        assert store.verify() == []
        assert (Path(path) / "data.mdb").stat().st_size < 64 * 2**20  # no runaway growth from the dead slot
    finally:
        store.close()


def test_disk_full_is_a_named_error_and_writes_resume_by_evicting(tmp_path):
    code = f"""
import resource, signal, sys
sys.path.insert(0, {str(WORKER.parent)!r})
import store_worker
from dsv41.storage.store import GlobalKVStore, StoreConfig, StoreDiskFullError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
clock = [1e6]
store = GlobalKVStore({str(tmp_path / 'store')!r}, store_worker.LAYOUT, StoreConfig(capacity_bytes=2**40,
                      min_age_s=3600, initial_map_bytes=2**20), clock=lambda: clock[0])
resource.setrlimit(resource.RLIMIT_FSIZE, (3 * 2**20, 3 * 2**20))
def put(batch):
    store.put_many({{k: store_worker.payload(batch, i) for i, k in enumerate(store_worker.batch_keys(batch))}})
batch = 0
try:
    while True:
        put(batch)
        batch += 1
except StoreDiskFullError as exc:
    print("full", batch, exc)
for more in range(batch + 1, batch + 101):  # an hour apart: what is stored gets old enough to go,
    clock[0] += 3600                        # and each write on the full file evicts to fit
    put(more)
print("resumed", more)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith("full "), out.stdout + out.stderr
    written, last = int(lines[0].split()[1]), int(lines[1].split()[1])
    store = GlobalKVStore(tmp_path / "store", store_worker.LAYOUT, StoreConfig(capacity_bytes=2**40, min_age_s=0))
    try:
        assert store.verify() == []
        present = _batches_present(store)
        assert all(count == store_worker.BATCH for count in present.values()), "a partial batch is visible"
        assert written not in present and last in present  # the refused batch stored nothing
        assert min(present) > 0 and len(present) < written + 100  # the oldest went first
    finally:
        store.close()


def test_a_reader_follows_a_map_another_process_grew(tmp_path):
    """A writer process grows the memory map and fills pages past the size this process mapped
    (1 MiB) while this process holds the store open for reading: the next read transaction adopts the
    new size (LMDB's MDB_MAP_RESIZED) and reads the new blocks intact, instead of failing."""
    path = tmp_path / "store"
    code = f"""
import sys
sys.path.insert(0, {str(WORKER.parent)!r})
import store_worker
from dsv41.storage.store import GlobalKVStore, StoreConfig
store = GlobalKVStore({str(path)!r}, store_worker.LAYOUT, StoreConfig(capacity_bytes=2**30, min_age_s=0,
                      initial_map_bytes=2**20, ballast_bytes=0))
def put(batch):
    store.put_many({{k: store_worker.payload(batch, i) for i, k in enumerate(store_worker.batch_keys(batch))}})
put(0)
print("ready", flush=True)
sys.stdin.readline()
first, batch = store.env.info()["map_size"], 1
while (store.env.info()["last_pgno"] + 1) * store.env.stat()["psize"] < 1.5 * first:  # pages past the old map
    put(batch)
    batch += 1
print("grown", batch - 1, store.env.info()["map_size"], flush=True)
sys.stdin.readline()
store.close()
"""
    writer = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "ready"
        store = GlobalKVStore(path, store_worker.LAYOUT, StoreConfig(initial_map_bytes=2**20), readonly=True)
        try:
            first_map = store.env.info()["map_size"]
            assert store.get_copy(store_worker.batch_keys(0)[0]) == store_worker.payload(0, 0)
            writer.stdin.write("go\n")
            writer.stdin.flush()
            _, last, grown = writer.stdout.readline().split()
            assert int(grown) > first_map
            with store.reader() as r:
                for batch in (0, int(last)):
                    for i, key in enumerate(store_worker.batch_keys(batch)):
                        assert bytes(r.get(key)) == store_worker.payload(batch, i)
            assert store.env.info()["map_size"] == int(grown)  # adopted the writer's size
        finally:
            store.close()
    finally:
        writer.stdin.close()
        assert writer.wait(30) == 0


OPEN_READONLY = f"""
import sys
sys.path.insert(0, {str(WORKER.parent)!r})
import store_worker
from dsv41.storage.store import GlobalKVStore
try:
    GlobalKVStore(sys.argv[1], store_worker.LAYOUT, readonly=True).close()
    print("opened")
except Exception as exc:
    print(type(exc).__name__)
"""


def test_reads_with_every_reader_slot_taken_are_refused_by_name_until_a_holder_dies(tmp_path):
    """Another process holds every reader slot of the environment in live read transactions: a read
    or a write here fails at once with StoreBusyError (no hang, no raw LMDB error, nothing written);
    once that process is killed (its slots left stale), the next read frees them and succeeds."""
    path = tmp_path / "store"
    store = GlobalKVStore(path, store_worker.LAYOUT, StoreConfig(capacity_bytes=2**30, min_age_s=0, max_readers=2))
    key = store_worker.batch_keys(0)[0]
    try:
        store.put_many({k: store_worker.payload(0, i) for i, k in enumerate(store_worker.batch_keys(0))})
        holder = subprocess.Popen([sys.executable, str(WORKER), "hold", str(path)], stdout=subprocess.PIPE, text=True)
        try:
            assert holder.stdout.readline().split()[0] == "holding"
            with pytest.raises(StoreBusyError, match=f"all {store.env.max_readers()} reader slots"):
                store.get_copy(key)
            with pytest.raises(StoreBusyError):  # a write reads the store's size first: refused, nothing written
                store.put_many({k: store_worker.payload(1, i) for i, k in enumerate(store_worker.batch_keys(1))})
            opening = subprocess.run([sys.executable, "-c", OPEN_READONLY, str(path)], capture_output=True, text=True,
                                     timeout=60)  # another process's read-only open (`kv stats`) is refused by name
            assert opening.stdout.strip() == "StoreBusyError", opening.stdout + opening.stderr
        finally:
            holder.kill()
            holder.wait(30)
        assert store.get_copy(key) == store_worker.payload(0, 0)  # the dead holder's slots were freed
        assert store.get_copy(store_worker.batch_keys(1)[0]) is None
        assert store.verify() == []
    finally:
        store.close()


def test_a_compact_copy_taken_while_a_writer_churns_is_whole_and_live_sized(tmp_path):
    """`kv compact`'s copy (S15) made while another process writes and evicts all the time: the copy
    opens, verifies, holds only whole blocks with their own payloads, and its file is about the size
    of what it holds, where the churned original has grown well past its live data."""
    path = tmp_path / "store"
    writer = Worker("write", str(path), "0", "40")  # small capacity: the writer evicts all the time
    try:
        writer.wait_for(60, "ack ")  # well past the capacity: pages freed and reused
        live = GlobalKVStore(path, store_worker.LAYOUT, readonly=True)
        try:
            live.compact_to(tmp_path / "copy")
        finally:
            live.close()
        before = len(writer.acked())
        writer.wait_for(before + 10, "ack ")  # the writer went on undisturbed
    finally:
        writer.kill()
    copy = GlobalKVStore(tmp_path / "copy", store_worker.LAYOUT, readonly=True)
    try:
        assert copy.verify() == []
        blocks = 0
        with copy.reader() as r:
            for key, *_ in list(copy.entries()):
                batch, i = struct.unpack("<II", key[:8])
                assert bytes(r.get(key)) == store_worker.payload(batch, i)
                blocks += 1
        assert 0 < blocks <= 40
        held = copy.stored_bytes()
        size = (tmp_path / "copy" / "data.mdb").stat().st_size
        assert held <= size <= 1.5 * held + 2**20, (held, size)
        assert (path / "data.mdb").stat().st_size > size
    finally:
        copy.close()


@pytest.mark.parametrize("point", ["put:before-commit", "put:after-commit", "evict:before-commit",
                                   "evict:after-commit"])
def test_a_writer_ended_at_a_named_point_leaves_a_consistent_store(tmp_path, point):
    """Whitebox crash points (S3): a writer process armed with DSV41_STORE_CRASH_AT ends at that
    point of its write path without unwinding. Blocks, metadata and the byte total still agree
    (`verify`), every acknowledged batch that was not evicted is whole, the batch in flight is whole
    if its transaction committed and absent if not, and the next writer carries on."""
    path = tmp_path / "store"
    done = subprocess.run([sys.executable, str(WORKER), "write", str(path), "0", "40"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "DSV41_STORE_CRASH_AT": point})
    assert done.returncode == CRASH_EXIT, done.stderr
    acked = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("ack ")]
    in_flight = max(acked, default=-1) + 1
    if point.startswith("evict"):
        assert len(acked) >= 5  # it ran until the store was full enough to evict
    config = StoreConfig(capacity_bytes=40 * (store_worker.LAYOUT.payload_bytes + 64), min_age_s=0)
    store = GlobalKVStore(path, store_worker.LAYOUT, config)
    try:
        assert store.verify() == []
        present = _batches_present(store)
        assert (present.get(in_flight) == store_worker.BATCH) == (point == "put:after-commit")
        assert set(present) <= set(acked) | {in_flight}
        if point == "evict:before-commit":  # the eviction never committed: every acknowledged batch is whole
            assert all(present.get(batch) == store_worker.BATCH for batch in acked)
        if point == "evict:after-commit":  # it had: some acknowledged blocks are gone
            assert sum(present.values()) < len(acked) * store_worker.BATCH
        with store.reader() as r:
            for key, *_ in list(store.entries()):
                batch, i = struct.unpack("<II", key[:8])
                assert bytes(r.get(key)) == store_worker.payload(batch, i)
        for batch in range(in_flight + 1, in_flight + 20):  # the next writer carries on, evicting
            store.put_many({k: store_worker.payload(batch, i) for i, k in enumerate(store_worker.batch_keys(batch))})
        assert store.verify() == []
    finally:
        store.close()


def test_a_long_verify_beside_a_busy_writer_does_not_pin_the_pages_it_frees(tmp_path, monkeypatch):
    """A long read transaction (S14) keeps every page freed after it from reuse: a `verify` that
    took one snapshot for its whole scan let a churning writer grow the file by all it replaced
    meanwhile. The scan now renews its snapshot every `max_read_txn_s`, so the file stays near its
    live size. Each verify is slowed to 50 ms a block; the same scan with no bound is the control."""
    from dsv41.storage import store as store_module

    decode = store_module.blockfmt.decode

    def slow_decode(layout, value):
        time.sleep(0.05)
        return decode(layout, value)

    monkeypatch.setattr(store_module.blockfmt, "decode", slow_decode)
    path = tmp_path / "store"
    writer = Worker("write", str(path), "0", "40")  # small capacity: the writer evicts all the time
    growth = {}
    try:
        writer.wait_for(20, "ack ")
        for bound in (float("inf"), 0.02):
            store = GlobalKVStore(path, store_worker.LAYOUT, StoreConfig(max_read_txn_s=bound), readonly=True)
            try:
                size, acked = (path / "data.mdb").stat().st_size, len(writer.acked())
                assert store.verify() == []
                growth[bound] = (path / "data.mdb").stat().st_size - size
                assert len(writer.acked()) > acked + 20  # the writer churned meanwhile
            finally:
                store.close()
    finally:
        writer.kill()
    assert growth[0.02] * 4 < growth[float("inf")], growth  # 0 against 39 MB here
