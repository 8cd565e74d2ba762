"""The LMDB global-KV store: contents, retention, growth, damage, versions, restarts."""

import os
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from dsv41.storage.blockfmt import HEADER_BYTES, BlockLayout
from dsv41.storage.store import GlobalKVStore, StoreConfig, StoreFullError, StoreVersionError

LAYOUT = BlockLayout(16, ((2, 288, 68), (2, 288, 68), (2, 288, 68), (1, 288, 68)))
BLOCK = LAYOUT.payload_bytes + HEADER_BYTES


def key(i: int) -> bytes:
    return struct.pack("<I", i) + bytes(28)


def payload(i: int) -> bytes:
    return (struct.pack("<I", i) * (LAYOUT.payload_bytes // 4 + 1))[: LAYOUT.payload_bytes]


class Clock:
    def __init__(self):
        self.now = 1_000_000.0

    def __call__(self):
        return self.now


def open_store(path, clock=None, blocks=100, min_age_h=72.0, **extra) -> GlobalKVStore:
    config = StoreConfig(capacity_bytes=blocks * BLOCK, min_age_s=min_age_h * 3600, **extra)
    return GlobalKVStore(path / "store", LAYOUT, config, clock=clock or Clock())


def test_batched_writes_read_back_zero_copy(tmp_path):
    with open_store(tmp_path) as store:
        assert store.put_many({key(i): payload(i) for i in range(5)}) == 5
        assert store.put_many({key(0): payload(0)}) == 0  # already there
        with store.reader() as r:
            view = r.get(key(3))
            assert isinstance(view, memoryview) and view == payload(3)
            assert r.get(key(9)) is None
        assert store.longest_prefix([key(0), key(1), key(7), key(2)]) == 2
        assert store.stored_bytes() == 5 * BLOCK and store.verify() == []


def test_nothing_younger_than_the_minimum_age_is_evicted(tmp_path):
    clock = Clock()
    with open_store(tmp_path, clock, blocks=10) as store:
        store.put_many({key(i): payload(i) for i in range(9)})
        with pytest.raises(StoreFullError, match="younger than the minimum age of 72 h"):
            store.put_many({key(i): payload(i) for i in range(9, 12)})
        assert store.stored_bytes() == 9 * BLOCK  # the refused batch stored nothing
        clock.now += 71 * 3600
        with pytest.raises(StoreFullError):
            store.put_many({key(20): payload(20), key(21): payload(21)})
        assert store.gc(target_bytes=5 * BLOCK, ignore_min_age=True) == 4  # the operator may override


def fill_in_order(store: GlobalKVStore, clock: Clock, count: int) -> None:
    """Blocks 0..count-1 stored a second apart (0 the least recently used), then aged past 72 h."""
    for i in range(count):
        store.put_many({key(i): payload(i)})
        clock.now += 1
    clock.now += 73 * 3600


def test_lru_order_beyond_the_minimum_age(tmp_path):
    clock = Clock()
    with open_store(tmp_path, clock, blocks=10, touch_granularity_s=0) as store:
        fill_in_order(store, clock, 8)
        with store.reader() as r:
            for i in (0, 1, 2):  # recently used again
                assert r.get(key(i)) is not None
        store.flush()
        store.put_many({key(100 + i): payload(100 + i) for i in range(3)})  # past the 95 % watermark
        left = {k for k, *_ in store.entries()}
        assert {key(i) for i in (0, 1, 2)} <= left
        assert key(3) not in left and key(4) not in left  # least recently used went first
        assert store.stored_bytes() <= 0.95 * 10 * BLOCK and store.verify() == []


def test_a_batch_counts_only_its_new_keys_and_keeps_its_stored_ones(tmp_path):
    """A batch that re-stores the least recently used entry beside one new block: only the new block
    counts against the capacity, the re-stored entry is not evicted (and written back as new) but
    counts as a use, and the next least recently used entry makes the room."""
    clock = Clock()
    with open_store(tmp_path, clock, blocks=10, touch_granularity_s=0) as store:
        fill_in_order(store, clock, 9)
        created = {k: c for k, c, *_ in store.entries()}
        assert store.put_many({key(0): payload(0), key(50): payload(50)}) == 1  # 9 + 1 blocks pass 95 %
        entries = {k: (c, last) for k, c, last, *_ in store.entries()}
        assert key(0) in entries and key(1) not in entries and len(entries) == 9
        assert entries[key(0)] == (created[key(0)], clock.now)  # the same entry, used now
        assert store.put_many({key(i): payload(i) for i in (2, 3, 4)}) == 0  # all stored: nothing goes
        assert len(list(store.entries())) == 9 and store.stored_bytes() == 9 * BLOCK and store.verify() == []


def test_access_times_are_buffered_not_written_per_read(tmp_path):
    clock = Clock()
    with open_store(tmp_path, clock) as store:
        store.put_many({key(1): payload(1)})
        version = store.env.info()["last_txnid"]
        for _ in range(100):
            with store.reader() as r:
                r.get(key(1))
        assert store.env.info()["last_txnid"] == version  # 100 reads, no write transaction
        clock.now += 5
        store.flush()
        assert next(store.entries())[2] == clock.now - 5  # recorded once, at the first read


def test_the_map_grows_instead_of_filling(tmp_path):
    with open_store(tmp_path, blocks=4000, initial_map_bytes=2**20) as store:
        for i in range(0, 300, 10):
            store.put_many({key(j): payload(j) for j in range(i, i + 10)})
        assert store.env.info()["map_size"] > 2**20 and store.verify() == []


def test_damaged_values_are_misses_never_data(tmp_path):
    with open_store(tmp_path) as store:
        store.put_many({key(i): payload(i) for i in range(3)})
        with store.env.begin(write=True) as txn:  # bit rot LMDB itself would not notice
            damaged = bytearray(txn.get(key(1), db=store.blocks))
            damaged[HEADER_BYTES + 100] ^= 0x40
            txn.put(key(1), bytes(damaged), db=store.blocks)
        assert [why for _, why in store.verify()] == ["checksum mismatch"]
        with store.reader() as r:
            assert r.get(key(1)) is None and r.get(key(2)) == payload(2)
        assert store.counters.bad == 1
        store.flush()  # the bad value is deleted with the next write
        assert store.verify() == [] and store.longest_prefix([key(0), key(1)]) == 1


def test_verify_finds_blocks_and_metadata_that_disagree(tmp_path):
    with open_store(tmp_path) as store:
        store.put_many({key(i): payload(i) for i in range(3)})
        assert store.verify() == []
        with store.env.begin(write=True) as txn:  # a block gone, its metadata and bytes left behind
            txn.delete(key(0), db=store.blocks)
        with store.env.begin(write=True) as txn:  # metadata gone, its block left behind
            txn.delete(key(2), db=store.meta)
        problems = sorted(store.verify())
        assert (key(0), "metadata without a block") in problems and (key(2), "block without metadata") in problems
        assert any(why.startswith("byte total") for _, why in problems)


def test_other_store_format_or_layout_is_a_clear_error(tmp_path):
    open_store(tmp_path).close()
    other = BlockLayout(32, LAYOUT.groups)
    with pytest.raises(StoreVersionError, match="another block size or KV format"):
        GlobalKVStore(tmp_path / "store", other)
    store = open_store(tmp_path)
    with store.env.begin(write=True, db=store.info) as txn:
        txn.put(b"format", struct.pack("<Q", 99))
    store.close()
    with pytest.raises(StoreVersionError, match="store format 99; this build reads 1"):
        open_store(tmp_path)


def test_a_restarted_process_sees_the_same_hits(tmp_path):
    with open_store(tmp_path) as store:
        store.put_many({key(i): payload(i) for i in range(6)})
    code = ("import sys; sys.path.insert(0, 'tests'); from test_store import *; from pathlib import Path;"
            "s = open_store(Path(sys.argv[1])); print(s.longest_prefix([key(i) for i in range(9)]), "
            "s.get_copy(key(5)) == payload(5))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "123"})
    assert out.stdout.split() == ["6", "True"]


def test_kv_commands(tmp_path):
    from click.testing import CliRunner

    from dsv41.cli.main import cli

    clock = Clock()
    with open_store(tmp_path, clock) as store:
        store.put_many({key(i): payload(i) for i in range(4)})
    path = str(tmp_path / "store")
    run = CliRunner().invoke
    out = run(cli, ["kv", "stats", "--path", path]).stdout
    assert f"4 blocks of 16 tokens, {4 * BLOCK:,} bytes" in out and "written 4" in out
    assert run(cli, ["kv", "verify", "--path", path]).exit_code == 0
    with open_store(tmp_path, clock) as store, store.env.begin(write=True) as txn:
        txn.put(key(2), b"DSKV" + bytes(40), db=store.blocks)
    bad = run(cli, ["kv", "verify", "--path", path])
    assert bad.exit_code == 1 and "1 problem(s)" in bad.output
    gc = run(cli, ["kv", "gc", "--path", path, "--capacity-gib", str(2 * BLOCK / 2**30), "--ignore-min-age"])
    assert gc.exit_code == 0 and "evicted 3 blocks" in gc.stdout
    result = run(cli, ["kv", "compact", "--path", path, str(tmp_path / "copy")])
    assert result.exit_code == 0 and (tmp_path / "copy" / "data.mdb").is_file()
    assert run(cli, ["kv", "stats", "--path", str(tmp_path / "nowhere")]).exit_code == 1


class RetentionMachine(RuleBasedStateMachine):
    """The store's retention against a model of its documented rules (S13): a batch whose new keys
    would pass the 95 % watermark first evicts, least recently used first, entries at least the
    minimum age old and not in the batch, down to 90 % less the new keys; if they still do not fit
    the capacity the batch is refused whole. Reads count as uses once written (each is flushed
    here), and so does a batch's key already stored. Keys, bytes and the eviction order must match
    the model after every step."""

    CAPACITY, MIN_AGE_H = 10, 72.0

    def __init__(self):
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="d41ret", dir="/tmp"))
        self.clock = Clock()
        self.store = open_store(self.root, self.clock, blocks=self.CAPACITY, min_age_h=self.MIN_AGE_H,
                                touch_granularity_s=0)
        self.model: dict[int, tuple[float, float]] = {}  # id -> (created, last use)

    @rule(ids=st.lists(st.integers(0, 29), min_size=1, max_size=3, unique=True))
    def put(self, ids):
        cap, now = self.CAPACITY * BLOCK, self.clock.now
        new = [i for i in ids if i not in self.model]
        incoming = len(new) * BLOCK
        expected = dict(self.model)
        if len(expected) * BLOCK + incoming > 0.95 * cap:
            target = max(0, int(0.90 * cap) - incoming)
            old_enough = sorted((last, key(i), i) for i, (created, last) in expected.items()
                                if now - created >= self.MIN_AGE_H * 3600 and i not in ids)
            for _, _, i in old_enough:
                if len(expected) * BLOCK <= target:
                    break
                del expected[i]
        fits = len(expected) * BLOCK + incoming <= cap
        if fits:
            for i in ids:
                expected[i] = (expected[i][0] if i in expected else now, now)
            assert self.store.put_many({key(i): payload(i) for i in ids}) == len(new)
        else:
            with pytest.raises(StoreFullError):
                self.store.put_many({key(i): payload(i) for i in ids})
        self.model = expected

    @rule(i=st.integers(0, 29))
    def get(self, i):
        with self.store.reader() as r:
            got = r.get(key(i))
            assert (bytes(got) if got is not None else None) == (payload(i) if i in self.model else None)
        self.store.flush()
        if i in self.model:
            self.model[i] = (self.model[i][0], self.clock.now)

    @rule(hours=st.integers(1, 100))
    def advance(self, hours):
        self.clock.now += hours * 3600

    @invariant()
    def matches_the_model(self):
        assert {k for k, *_ in self.store.entries()} == {key(i) for i in self.model}
        assert self.store.stored_bytes() == len(self.model) * BLOCK <= self.CAPACITY * BLOCK

    def teardown(self):
        try:
            assert self.store.verify() == []
        finally:
            self.store.close()
            shutil.rmtree(self.root, ignore_errors=True)


test_retention_follows_its_model = RetentionMachine.TestCase
test_retention_follows_its_model.settings = settings(max_examples=25, stateful_step_count=30, deadline=None)
