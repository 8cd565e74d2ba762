"""The store against a hostile operator's disk: damaged files, a full disk, a second writer, loose
permissions, another model's store. Anything that could die of SIGBUS runs in a subprocess."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dsv41 import messages as m
from dsv41.components.runtime import Peer, new_request_id
from dsv41.config import load_config
from dsv41.storage.blockfmt import BlockLayout
from dsv41.storage.store import (
    GlobalKVStore,
    StoreConfig,
    StoreError,
    StoreIdentityError,
    StoreLockedError,
)
from tests.helpers.pipelines import endpoints, pipeline_for, start_alone

HELPERS = Path(__file__).parent / "helpers"
sys.path.insert(0, str(HELPERS))
import store_worker  # noqa: E402

CLI = [sys.executable, "-c", "from dsv41.cli.main import cli; cli()", "kv"]
PAGE = 4096


def fill(path: Path, batches: int = 30, **config) -> None:
    with GlobalKVStore(path, store_worker.LAYOUT, StoreConfig(**config)) as store:
        for batch in range(batches):
            store.put_many({k: store_worker.payload(batch, i) for i, k in enumerate(store_worker.batch_keys(batch))})


def damage(path: Path, how: str) -> None:
    data = path / "data.mdb"
    if how == "truncated":
        os.truncate(data, data.stat().st_size // 2)
    else:  # both meta pages zeroed
        with open(data, "r+b") as f:
            f.write(bytes(2 * PAGE))


def kv(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=30)


@pytest.fixture
def corrupt(tmp_path, request) -> Path:
    path = tmp_path / "store"
    fill(path)
    damage(path, request.param)
    return path


@pytest.mark.parametrize("corrupt", ["truncated", "zeroed meta pages"], indirect=True)
def test_a_corrupt_store_file_is_a_one_line_error_never_a_signal(corrupt):
    for command in ("stats", "verify", "gc"):
        out = kv(command, "--path", str(corrupt))
        assert out.returncode == 1, (command, out.returncode, out.stderr)  # not -SIGBUS
        (line,) = out.stderr.splitlines()
        assert line.startswith(f"Error: store {corrupt} is corrupt: ") and "--quarantine` moves it aside" in line
    assert (corrupt / "data.mdb").is_file()  # reporting moves nothing


def test_the_truncated_file_really_kills_a_plain_lmdb_reader(tmp_path):
    """The file the tests above use is dangerous: LMDB opened on it directly dies of SIGBUS."""
    path = tmp_path / "store"
    fill(path)
    damage(path, "truncated")
    code = ("import lmdb, sys; env = lmdb.open(sys.argv[1], readonly=True, max_dbs=3, lib_version=0);"
            "db = env.open_db(b'blocks', create=False); print(sum(len(v) for _, v in env.begin(db=db).cursor()))")
    assert subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, timeout=30).returncode \
        == -signal.SIGBUS


@pytest.mark.parametrize("corrupt", ["truncated", "zeroed meta pages"], indirect=True)
def test_kv_verify_quarantine_moves_a_corrupt_store_aside(corrupt):
    out = kv("verify", "--quarantine", "--path", str(corrupt))
    assert out.returncode == 1
    (line,) = out.stderr.splitlines()
    assert "is corrupt" in line and "the next writer starts empty" in line
    (aside,) = corrupt.parent.glob("store.corrupt-*")
    assert str(aside) in line and (aside / "data.mdb").is_file() and stat.S_IMODE(aside.stat().st_mode) == 0o700
    assert not (corrupt / "data.mdb").exists()
    assert "no store at" in kv("stats", "--path", str(corrupt)).stderr
    fill(corrupt, batches=2)
    assert kv("verify", "--path", str(corrupt)).returncode == 0


@pytest.mark.parametrize("corrupt", ["truncated", "zeroed meta pages"], indirect=True)
def test_a_writer_quarantines_a_corrupt_store_and_starts_empty(corrupt):
    code = f"""
import sys
sys.path.insert(0, {str(HELPERS)!r})
import store_worker
from dsv41.storage.store import GlobalKVStore, StoreCorruptError
try:
    GlobalKVStore(sys.argv[1], store_worker.LAYOUT)
except StoreCorruptError as exc:
    print("refused:", exc)
with GlobalKVStore(sys.argv[1], store_worker.LAYOUT, quarantine=True) as store:
    print("entries", len(list(store.entries())))
    store.put_many({{k: store_worker.payload(7, i) for i, k in enumerate(store_worker.batch_keys(7))}})
    print("verify", store.verify())
"""
    out = subprocess.run([sys.executable, "-c", code, str(corrupt)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1:] == ["entries 0", "verify []"]
    assert out.stdout.startswith(f"refused: store {corrupt} is corrupt")  # only on request
    (logged,) = out.stderr.splitlines()  # one clear line
    (aside,) = corrupt.parent.glob("store.corrupt-*")
    assert "is corrupt" in logged and f"moved its files to {aside} and starting empty" in logged


def test_garbage_in_the_lock_file_is_rebuilt_by_lmdb(tmp_path):
    path = tmp_path / "store"
    fill(path, batches=2)
    with open(path / "lock.mdb", "r+b") as f:
        f.write(os.urandom(2 * PAGE))
    code = f"""
import sys
sys.path.insert(0, {str(HELPERS)!r})
import store_worker
from dsv41.storage.store import GlobalKVStore
for readonly in (True, False):
    with GlobalKVStore(sys.argv[1], store_worker.LAYOUT, readonly=readonly) as store:
        print(len(list(store.entries())), store.verify())
"""
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.splitlines() == ["8 []", "8 []"], out.stderr


def test_a_second_writer_is_refused_while_readers_still_work(tmp_path):
    path = tmp_path / "store"
    writer = subprocess.Popen([sys.executable, str(HELPERS / "store_worker.py"), "write", str(path), "0", "40"],
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert writer.stdout.readline().startswith("ack ")  # the lock is held from here on
        with pytest.raises(StoreLockedError, match=f"open for writing by process {writer.pid}"):
            GlobalKVStore(path, store_worker.LAYOUT)
        gc = kv("gc", "--path", str(path))
        assert gc.returncode == 1 and f"open for writing by process {writer.pid}" in gc.stderr
        stats = kv("stats", "--path", str(path))
        assert stats.returncode == 0 and "blocks of 16 tokens" in stats.stdout
        with GlobalKVStore(path, store_worker.LAYOUT, readonly=True) as reader:
            assert reader.verify() == []
        acked = int(writer.stdout.readline().split()[1])
        for _ in range(20):  # the first writer evicts and writes on, undisturbed
            assert int(writer.stdout.readline().split()[1]) == acked + 1
            acked += 1
    finally:
        os.killpg(writer.pid, signal.SIGKILL)
        writer.wait()
        writer.stdout.close()
    with GlobalKVStore(path, store_worker.LAYOUT) as store:  # a dead writer's lock goes with it
        assert store.verify() == []


def test_the_store_stays_in_the_lmdb_09_format_whatever_the_environment_asks(tmp_path):
    """LMDB_DEFAULT_LIB_VERSION=1 makes a plain `lmdb.open` write LMDB 1.0's file format, which the
    store's own checks and older readers do not read; the store pins `lib_version=0`, so its file
    keeps the 0.9 meta pages (magic 0xBEEFC0DE, data format 1) and reads back intact."""
    code = f"""
import sys, lmdb
sys.path.insert(0, {str(HELPERS)!r})
import store_worker
from dsv41.storage.store import GlobalKVStore, StoreConfig
plain = lmdb.open({str(tmp_path / "plain")!r}, map_size=2**20)
with plain.begin(write=True) as txn:
    txn.put(b"k", b"v")
plain.close()
with GlobalKVStore({str(tmp_path / "store")!r}, store_worker.LAYOUT, StoreConfig(ballast_bytes=0)) as store:
    store.put_many({{k: store_worker.payload(0, i) for i, k in enumerate(store_worker.batch_keys(0))}})
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LMDB_DEFAULT_LIB_VERSION": "1"})
    assert done.returncode == 0, done.stderr
    meta = bytes.fromhex("dec0efbe01000000")  # 0xBEEFC0DE and data format 1, little-endian, at byte 16
    assert (tmp_path / "plain" / "data.mdb").read_bytes()[16:24] != meta  # the variable is in effect
    assert (tmp_path / "store" / "data.mdb").read_bytes()[16:24] == meta
    with GlobalKVStore(tmp_path / "store", store_worker.LAYOUT, readonly=True) as store:
        assert store.get_copy(store_worker.batch_keys(0)[1]) == store_worker.payload(0, 1)
        assert store.verify() == []


def test_store_files_are_private_whatever_the_umask(tmp_path):
    path = tmp_path / "store"
    old = os.umask(0)
    try:
        fill(path, batches=1)
        names = ("data.mdb", "lock.mdb", "writer.lock", "ballast")
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        assert {name: stat.S_IMODE((path / name).stat().st_mode) for name in names} == dict.fromkeys(names, 0o600)
        path.chmod(0o755)  # a store left loose (by an older version, or by hand) is tightened on open
        for name in names:
            (path / name).chmod(0o644)
        fill(path, batches=1)
        assert stat.S_IMODE(path.stat().st_mode) == 0o700
        assert {name: stat.S_IMODE((path / name).stat().st_mode) for name in names} == dict.fromkeys(names, 0o600)
    finally:
        os.umask(old)


def test_a_store_of_another_model_is_a_named_error(tmp_path):
    path = tmp_path / "store"
    with GlobalKVStore(path, store_worker.LAYOUT, model_id=b"a" * 32) as store:
        assert store.recorded_model_id() == b"a" * 32
    with pytest.raises(StoreIdentityError, match="holds the KV of another model"):
        GlobalKVStore(path, store_worker.LAYOUT, model_id=b"b" * 32)
    with GlobalKVStore(path, store_worker.LAYOUT, readonly=True) as store:  # tools open any model's store
        assert store.recorded_model_id() == b"a" * 32
    fill(tmp_path / "old", batches=1)  # a store from before model identities is adopted
    with GlobalKVStore(tmp_path / "old", store_worker.LAYOUT, model_id=b"c" * 32) as store:
        assert store.recorded_model_id() == b"c" * 32 and len(list(store.entries())) == 4
    with pytest.raises(StoreIdentityError):
        GlobalKVStore(tmp_path / "old", store_worker.LAYOUT, model_id=b"a" * 32)


def test_the_kvstore_runs_without_a_store_of_another_model(root, caplog):
    pipeline = pipeline_for("thread", root)
    layout = BlockLayout.of(load_config(pipeline.model.config), pipeline.store.block_tokens)
    other = bytes(32)  # no fingerprint is all zeros
    with GlobalKVStore(root / "kv", layout, model_id=other) as store:
        store.put_many({bytes(32): bytes(layout.payload_bytes)})
    runtime_dir = root / "run"
    with caplog.at_level(logging.ERROR, logger="dsv41.components.kvstore"):
        child = start_alone("kvstore", pipeline, runtime_dir)
    peer = Peer(endpoints(pipeline, runtime_dir)["kvstore"], "kvstore", timeout_s=30)
    try:
        ids = list(range(3, 53))
        hit, _ = peer.call(m.Lookup(request_id=new_request_id(), ids=m.pack_ids(ids)))
        assert (hit.cached_blocks, hit.keys) == (0, [])  # no keys: the encoder neither loads nor stores
        out = m.Frames()
        put = m.PutBlocks(request_id=new_request_id(), keys=[b"k" * 32],
                          payloads=[out.add(torch.zeros(layout.payload_bytes, dtype=torch.uint8))])
        assert peer.call(put, out)[0].stored == 0
        assert peer.ping().counters["store_disabled"] == 1
    finally:
        peer.close()
        child.stop(10)
    (record,) = caplog.records
    assert "holds the KV of another model" in record.getMessage()
    assert "running without the prefix cache" in record.getMessage()
    with GlobalKVStore(root / "kv", layout, readonly=True) as store:  # the other model's store is untouched
        assert store.recorded_model_id() == other and len(list(store.entries())) == 1


# --- a full disk: a small tmpfs of its own in a user and mount namespace ------------------------------

FULL_DISK = f"""
import os, subprocess, sys
sys.path.insert(0, {str(HELPERS)!r})
import store_worker
from dsv41.storage.store import GlobalKVStore, StoreConfig, StoreDiskFullError

class Clock:
    now = 1e6
    def __call__(self):
        return self.now

def batch(n):
    return {{k: store_worker.payload(n, i) for i, k in enumerate(store_worker.batch_keys(n))}}

disk, ballast = sys.argv[1], int(sys.argv[2])
clock, path = Clock(), disk + "/store"
config = StoreConfig(capacity_bytes=2**40, min_age_s=3600, ballast_bytes=ballast)
store = GlobalKVStore(path, store_worker.LAYOUT, config, clock=clock)
for n in range(100):
    store.put_many(batch(n))
fd = os.open(disk + "/filler", os.O_WRONLY | os.O_CREAT)  # something else fills the disk to the last byte
try:
    while True:
        os.write(fd, bytes(512))
except OSError:
    os.close(fd)
stored = store.stored_bytes()
try:
    store.put_many(batch(1000))
except StoreDiskFullError:
    print("put refused", store.stored_bytes() == stored)  # young entries only: nothing to evict
store.close()
gc = subprocess.run({CLI!r} + ["gc", "--path", path, "--ignore-min-age", "--capacity-gib",
                    str(stored / 2 / 0.9 / 2**30)], capture_output=True, text=True)
print("kv gc", gc.returncode, gc.stdout.split(";")[0] if gc.returncode == 0 else "failed")
sys.stderr.write(gc.stderr)
if gc.returncode:
    sys.exit()
store = GlobalKVStore(path, store_worker.LAYOUT, config, clock=clock)
print("put after gc", store.put_many(batch(1001)))
clock.now += 7200  # everything is old enough to go now: a write on the full disk evicts for itself
for n in range(2000, 2040):
    store.put_many(batch(n))
print("writes resumed", store.verify() == [], os.path.exists(path + "/ballast"))
"""


def _run_on_small_disk(disk: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    """`code` in a process of its own with an 8 MiB tmpfs mounted on `disk` (gone when it exits)."""
    disk.mkdir()
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                           'mount -t tmpfs -o size=8m tmpfs "$1" && shift && exec "$@"', "sh", str(disk),
                           sys.executable, "-c", code, str(disk), *args], capture_output=True, text=True, timeout=60)


def _small_disks(tmp_path: Path) -> None:
    probe = tmp_path / "probe"
    probe.mkdir()
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--user", "--map-root-user", "--mount", "mount", "-t", "tmpfs", "tmpfs", str(probe)],
            capture_output=True).returncode:
        pytest.skip("needs unshare with user and mount namespaces (a private tmpfs to fill)")


def test_a_full_disk_recovers_by_releasing_the_ballast(tmp_path):
    _small_disks(tmp_path)
    started = time.monotonic()
    out = _run_on_small_disk(tmp_path / "with", FULL_DISK, str(2**20))
    assert out.returncode == 0, out.stderr
    refused, gc, *after = out.stdout.splitlines()
    assert refused == "put refused True" and after == ["put after gc 4", "writes resumed True False"]
    assert gc.startswith("kv gc 0 evicted ") and int(gc.split()[4]) >= 199  # about half of 400 blocks
    assert out.stderr.count("the disk is full; released the 1048576-byte reserve to evict") == 1
    # without the ballast, the same `kv gc` cannot commit on the full disk (the defect)
    out = _run_on_small_disk(tmp_path / "without", FULL_DISK, "0")
    assert out.stdout.splitlines() == ["put refused True", "kv gc 1 failed"], out.stderr
    assert "Error: store" in out.stderr and "the disk is full" in out.stderr
    assert time.monotonic() - started < 20


def test_a_store_used_after_fork_is_refused_and_the_parent_goes_on(tmp_path):
    """LMDB environments must not cross fork() (S17): a forked child that reads or writes through its
    parent's handle gets a named StoreError, nothing reaches the file, and the parent's handle and
    the store are intact. (The launcher starts components as new interpreters, never by fork.)"""
    fill(tmp_path / "store", batches=2, min_age_s=0)
    store = GlobalKVStore(tmp_path / "store", store_worker.LAYOUT, StoreConfig(min_age_s=0))
    try:
        key = store_worker.batch_keys(0)[0]
        pid = os.fork()
        if pid == 0:  # the child: both uses must be refused by name
            refused = 0
            for use in (lambda: store.get_copy(key),
                        lambda: store.put_many({store_worker.batch_keys(9)[0]: store_worker.payload(9, 0)})):
                try:
                    use()
                except StoreError as exc:
                    refused += "opened by process" in str(exc)
            os._exit(0 if refused == 2 else 1)
        assert os.waitpid(pid, 0)[1] == 0
        assert store.get_copy(key) == store_worker.payload(0, 0)
        assert store.get_copy(store_worker.batch_keys(9)[0]) is None and store.verify() == []
    finally:
        store.close()
