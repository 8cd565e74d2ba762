"""The persistent global-KV store: one LMDB environment, one writer process, many readers.

Three databases: `blocks` (prefix key -> checked block value, `blockfmt`), `meta` (key -> created,
last access, size) and `info` (store format, block layout, total bytes, hit counters). A batch of
blocks is written in one transaction together with its metadata and the byte total, so after a
crash a block is either there with its metadata or absent.

Retention: an entry younger than `min_age_s` (default 72 h) is never evicted unless the operator
asks (`gc(ignore_min_age=True)`); beyond that, least recently used entries go first whenever the
stored bytes pass the high watermark, down to the low watermark. When only young entries are left
and the capacity is reached (or the disk is full), a write raises StoreFullError and stores nothing
(the caller simply does not cache that request). Access times are buffered and written at most once per
`touch_granularity_s` per entry, with the next write, so reads never turn into write storms.

Reads are zero-copy: `with store.reader() as r: view = r.get(key)` returns a memoryview into
LMDB's map that stays valid only until the `with` block ends; copy it (bytes(view)) to keep it.

Failure handling: the data file's meta pages are checked before LMDB maps it (a truncated file
would kill the process with SIGBUS), a writer holds an exclusive lock so a second writer process
is refused at open, a small ballast file keeps room for the eviction commit a full disk needs,
and the store records the identity of the model whose KV it holds.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import json
import logging
import os
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import lmdb

from dsv41.storage import blockfmt
from dsv41.storage.blockfmt import BadBlock, BlockLayout

STORE_FORMAT = 1
_META = struct.Struct("<ddI")  # created, last access (clock seconds), value bytes
_U64 = struct.Struct("<Q")
GIB = 2**30
# How a failed commit reads when the file cannot grow (ENOSPC, EFBIG, or EIO from a short write).
_DISK_FULL_MESSAGES = ("No space left", "File too large", "Input/output error")
# An LMDB 0.9 meta page (pages 0 and 1): a 16-byte page header, then magic, data format version,
# map address, map size and (as the first database's pad field) the page size; the last used page
# number follows at byte 136. Native byte order, 64-bit build.
_LMDB_META = struct.Struct("=IIQQI")
_LMDB_META_AT, _LMDB_LAST_PAGE_AT = 16, 136
_LMDB_MAGIC, _LMDB_DATA_VERSION = 0xBEEFC0DE, 1
_EVICT_BATCH = 512  # entries deleted per transaction: each commit on a full disk needs only a few pages
_PRIVATE_DIR, _PRIVATE_FILE = 0o700, 0o600  # KV reveals prompts: owner only, whatever the umask
log = logging.getLogger(__name__)
CRASH_EXIT = 70  # the exit status of a process ended at an armed crash point
_CRASH_AT = os.environ.get("DSV41_STORE_CRASH_AT", "")


def _crash_point(name: str) -> None:
    """Crash-consistency tests arm one named point of the write path (`DSV41_STORE_CRASH_AT=name`):
    the process ends there at once, without unwinding, as SIGKILL or a power cut would."""
    if name == _CRASH_AT:
        os._exit(CRASH_EXIT)


class StoreError(Exception):
    """Base of the store's named errors."""


class StoreFullError(StoreError):
    """Nothing more fits: the capacity holds only entries younger than the minimum age, or the
    map cannot grow because the disk is full."""


class StoreDiskFullError(StoreFullError):
    """The data file cannot grow (no space, file size limit) and evicting made no room."""


class StoreVersionError(StoreError):
    """The store on disk was written in another store format or block layout."""


class StoreIdentityError(StoreVersionError):
    """The store holds the KV of another model (its recorded fingerprint differs)."""


class StoreCorruptError(StoreError):
    """The data file is not a whole LMDB file (truncated, or meta pages damaged): opening it
    would crash the process, so it is refused (or moved aside, `quarantine=True`)."""


class StoreLockedError(StoreError):
    """Another process holds the store open for writing."""


class StoreBusyError(StoreError):
    """Every reader slot of the environment is held by a live read transaction (`max_readers`):
    the read is refused now rather than waited for, and a later one can succeed."""


@dataclass
class StoreConfig:
    capacity_bytes: int = 64 * GIB
    min_age_s: float = 72 * 3600.0
    high_watermark: float = 0.95
    low_watermark: float = 0.90
    touch_granularity_s: float = 60.0
    max_readers: int = 1024
    initial_map_bytes: int = 256 * 2**20
    ballast_bytes: int = 32 * 2**20  # disk kept free for the eviction commits of a full disk (0: none)
    # the longest a long scan (`verify`) keeps one read transaction: an open snapshot keeps every
    # page freed after it from reuse, so a scan of a large store beside a busy writer would grow
    # the file by everything the writer replaced meanwhile
    max_read_txn_s: float = 1.0


@dataclass
class Counters:
    hits: int = 0
    misses: int = 0
    bad: int = 0
    evicted: int = 0
    written: int = 0


@dataclass
class _Pending:
    touches: dict[bytes, float] = field(default_factory=dict)
    bad: set[bytes] = field(default_factory=set)


class GlobalKVStore:
    """The store. A writer (`readonly=False`) holds the store's writer lock until `close()`;
    `model_id` (the prefix fingerprint's digest) is recorded in a new store and checked in an old
    one; `quarantine=True` moves a corrupt data file aside and starts empty instead of raising."""

    def __init__(self, path: str | Path, layout: BlockLayout, config: StoreConfig | None = None,
                 clock: Callable[[], float] = time.time, readonly: bool = False, model_id: bytes | None = None,
                 quarantine: bool = False):
        self.path, self.layout, self.config = Path(path), layout, config or StoreConfig()
        self.clock, self.readonly, self.model_id = clock, readonly, model_id
        self._owner_pid = os.getpid()  # LMDB environments must not be used across fork()
        self.reader_slots_freed = 0  # slots of dead readers this handle gave back (counted for operators)
        self.counters = Counters()
        self._flushed = Counters()  # counter values already added to the store's totals
        self._pending = _Pending()
        self._last_touch: dict[bytes, float] = {}
        self._closing = ExitStack()  # the writer lock and the environment, released in reverse order
        try:
            self._open(quarantine)
        except BaseException:
            self._closing.close()
            raise

    # -- opening -------------------------------------------------------------------------------------

    def _open(self, quarantine: bool) -> None:
        data = self.path / "data.mdb"
        if self.readonly:
            _require_store(self.path)
        else:
            self.path.mkdir(parents=True, exist_ok=True, mode=_PRIVATE_DIR)
            os.chmod(self.path, _PRIVATE_DIR)
            self._closing.callback(os.close, _lock_writer(self.path))
            if data.is_file():
                try:
                    check_data_file(self.path)
                except StoreCorruptError as exc:
                    if not quarantine:
                        raise
                    log.error("%s; moved its files to %s and starting empty", exc, _move_aside(self.path))
        try:  # opening reads the main database: a reader slot
            self.env = lmdb.open(str(self.path), map_size=self._map_size_for_open(), max_dbs=3, readonly=self.readonly,
                                 max_readers=self.config.max_readers, max_spare_txns=0, writemap=False, sync=True,
                                 metasync=True, lock=True, lib_version=0, mode=_PRIVATE_FILE)
        except lmdb.ReadersFullError:
            raise self._busy() from None
        self._closing.callback(self.env.close)
        if not self.readonly:  # also tightens files an older version or a person left loose
            for name in ("data.mdb", "lock.mdb", "ballast"):
                if (self.path / name).exists():
                    os.chmod(self.path / name, _PRIVATE_FILE)
        self._free_dead_readers()
        try:  # these read the main database: a reader slot each
            self.blocks = self.env.open_db(b"blocks", create=not self.readonly)
            self.meta = self.env.open_db(b"meta", create=not self.readonly)
            self.info = self.env.open_db(b"info", create=not self.readonly)
            self._check_identity()
        except lmdb.ReadersFullError:
            raise self._busy() from None
        if not self.readonly:
            self._ensure_ballast()

    def _map_size_for_open(self) -> int:
        existing = (self.path / "data.mdb").stat().st_size if (self.path / "data.mdb").is_file() else 0
        return max(self.config.initial_map_bytes, 2 * existing)

    def _check_identity(self) -> None:
        with self.env.begin(db=self.info, write=not self.readonly) as txn:
            stored = txn.get(b"format")
            if stored is None and not self.readonly:
                txn.put(b"format", _U64.pack(STORE_FORMAT))
                txn.put(b"layout", _U64.pack(self.layout.layout_id))
                txn.put(b"layout_spec", json.dumps([self.layout.block_tokens, self.layout.groups,
                                                    self.layout.format_version]).encode())
                txn.put(b"bytes", _U64.pack(0))
                if self.model_id is not None:
                    txn.put(b"model", self.model_id)
                return
            if stored is None or _U64.unpack(stored)[0] != STORE_FORMAT:
                found = "none" if stored is None else _U64.unpack(stored)[0]
                raise StoreVersionError(f"store {self.path} has store format {found}; this build reads {STORE_FORMAT}")
            layout = _U64.unpack(txn.get(b"layout"))[0]
            if layout != self.layout.layout_id:
                raise StoreVersionError(f"store {self.path} holds blocks of layout {layout}, this model writes "
                                        f"layout {self.layout.layout_id} (another block size or KV format)")
            recorded = txn.get(b"model")
            if self.model_id is None:
                return
            if recorded is None and not self.readonly:
                txn.put(b"model", self.model_id)  # a store from before model identities: adopt it
            elif recorded is not None and recorded != self.model_id:
                raise StoreIdentityError(f"store {self.path} holds the KV of another model (fingerprint "
                                         f"{recorded.hex()[:16]}, this one is {self.model_id.hex()[:16]})")

    def recorded_model_id(self) -> bytes | None:
        """The fingerprint digest recorded in the store (None: created without one)."""
        with self._begin_read(db=self.info) as txn:
            return txn.get(b"model")

    def close(self) -> None:
        try:
            if not self.readonly:
                self.flush()
        finally:
            self._closing.close()

    def __enter__(self) -> GlobalKVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading -------------------------------------------------------------------------------------

    @contextmanager
    def reader(self) -> Iterator[_Reader]:
        """A read transaction; views it returns die with it."""
        txn = self._begin_read(buffers=True)
        try:
            yield _Reader(self, txn)
        finally:
            txn.abort()

    def _begin_read(self, db=None, buffers: bool = False):
        """A read transaction, after adopting a map another process grew, or freeing the reader slots
        of processes that died holding one (a SIGKILLed reader keeps its slot until a check)."""
        self._require_own_process()
        try:
            return self.env.begin(db=db, buffers=buffers)
        except lmdb.MapResizedError:
            self.env.set_mapsize(0)  # adopt the size another process grew the map to
            return self.env.begin(db=db, buffers=buffers)
        except lmdb.ReadersFullError:
            if not self._free_dead_readers():
                raise self._busy() from None
            return self.env.begin(db=db, buffers=buffers)

    def _busy(self) -> StoreBusyError:
        slots = self.env.max_readers() if hasattr(self, "env") else "the"
        return StoreBusyError(f"all {slots} reader slots of {self.path} are held by live read transactions; retry "
                              "when some have finished")

    def _free_dead_readers(self) -> int:
        """Give back the reader slots of processes that died inside a read transaction; how many."""
        freed = self.env.reader_check()
        self.reader_slots_freed += freed
        return freed

    def get_copy(self, key: bytes) -> bytes | None:
        """One block's payload, copied out of the map (or None: missing or damaged)."""
        with self.reader() as r:
            view = r.get(key)
            return None if view is None else bytes(view)

    def longest_prefix(self, keys: list[bytes]) -> int:
        """How many of `keys` (a chain, in order) are stored, counted from the first."""
        with self.reader() as r:
            for i, key in enumerate(keys):
                if not r.contains(key):
                    return i
            return len(keys)

    # -- writing -------------------------------------------------------------------------------------

    def put_many(self, payloads: dict[bytes, bytes | memoryview]) -> int:
        """Store blocks (payloads in the layout) in one transaction; returns how many were new.
        Keys already stored keep their value and count as a use; only the new ones count against
        the capacity, and the batch's own entries are never evicted to make room for it.
        Raises StoreFullError (storing nothing) when the new ones cannot fit."""
        self._require_writer()
        values = {key: blockfmt.encode(self.layout, payload) for key, payload in payloads.items()}
        incoming = sum(len(values[key]) for key in self._absent(values))
        keep = frozenset(values)
        self._make_room(incoming, keep)
        try:
            written = self._write(lambda txn: self._put_values(txn, values))
            _crash_point("put:after-commit")
            return written
        except StoreDiskFullError:
            # the file cannot grow: evict entries old enough to go, so the batch fits in pages the
            # file already has (twice its size: new values need contiguous runs of free pages)
            if not self.gc(target_bytes=max(0, self.stored_bytes() - 2 * incoming), keep=keep):
                raise
            return self._write(lambda txn: self._put_values(txn, values))

    def _absent(self, keys) -> list[bytes]:
        """The keys not stored now (or about to go as bad values with the next write)."""
        with self._begin_read() as txn:
            return [key for key in keys if key in self._pending.bad or txn.get(key, db=self.meta) is None]

    def _put_values(self, txn, values: dict[bytes, bytes]) -> int:
        now, added, written = self.clock(), 0, 0
        for key, value in values.items():
            meta = txn.get(key, db=self.meta)
            if meta is not None:  # stored already: the writer just used it
                created, _, size = _META.unpack(meta)
                txn.put(key, _META.pack(created, now, size), db=self.meta)
                continue
            txn.put(key, value, db=self.blocks)
            txn.put(key, _META.pack(now, now, len(value)), db=self.meta)
            added += len(value)
            written += 1
        self._add_bytes(txn, added)
        self.counters.written += written
        _crash_point("put:before-commit")
        return written

    def flush(self) -> None:
        """Write buffered access times and counters, and drop values found bad by readers."""
        if self._pending.touches or self._pending.bad or self.counters != self._flushed:
            self._write(lambda txn: None)

    def _write(self, body: Callable):
        """One write transaction: the pending touches and deletions, then `body`; grows the map
        first when it is nearly full, and once more on MapFullError."""
        self._require_own_process()
        self._grow_map_if_needed()
        self._free_dead_readers()  # a dead reader's slot would pin old pages
        for attempt in (0, 1):
            try:
                with self.env.begin(write=True) as txn:
                    flushed = self._apply_pending(txn)
                    result = body(txn)
                self._pending, self._flushed = _Pending(), flushed  # only once committed
                return result
            except lmdb.MapFullError:
                if attempt or not self._grow_map(force=True):
                    raise StoreDiskFullError(f"store {self.path}: the LMDB map is full and the disk has no room "
                                             "to grow it; nothing was stored") from None
            except lmdb.Error as exc:
                if isinstance(exc, lmdb.DiskError) or any(s in str(exc) for s in _DISK_FULL_MESSAGES):
                    raise StoreDiskFullError(f"store {self.path}: the disk is full ({exc}); nothing was "
                                             "stored") from exc
                raise
        raise AssertionError("unreachable")

    def _write_on_reserve(self, body: Callable):
        """`_write`, retried once after releasing the ballast when the disk is full: an eviction
        commit needs a few new pages, and this is how it gets them on a full disk."""
        try:
            return self._write(body)
        except StoreDiskFullError:
            if not self._release_ballast():
                raise
            return self._write(body)

    def _apply_pending(self, txn) -> Counters:
        """Write the pending counters, deletions and access times; returns the counters written."""
        for name in ("hits", "misses", "bad", "evicted", "written"):
            delta = getattr(self.counters, name) - getattr(self._flushed, name)
            if delta:
                current = txn.get(name.encode(), db=self.info)
                txn.put(name.encode(), _U64.pack((_U64.unpack(current)[0] if current else 0) + delta), db=self.info)
        flushed = Counters(**vars(self.counters))
        for key in self._pending.bad:
            self._delete(txn, key)
        for key, when in self._pending.touches.items():
            meta = txn.get(key, db=self.meta)
            if meta is not None:
                created, _, size = _META.unpack(meta)
                txn.put(key, _META.pack(created, when, size), db=self.meta)
        return flushed

    def _delete(self, txn, key: bytes) -> bool:
        """Delete an entry if it is there (it may be gone already); True when it was."""
        meta = txn.get(key, db=self.meta)
        size = _META.unpack(meta)[2] if meta is not None else len(txn.get(key, db=self.blocks) or b"")
        if txn.delete(key, db=self.blocks) or meta is not None:
            txn.delete(key, db=self.meta)
            self._add_bytes(txn, -size)
            return True
        return False

    def _add_bytes(self, txn, delta: int) -> None:
        if delta:
            current = _U64.unpack(txn.get(b"bytes", db=self.info))[0]
            txn.put(b"bytes", _U64.pack(current + delta), db=self.info)

    # -- capacity, retention, eviction ---------------------------------------------------------------

    def stored_bytes(self) -> int:
        with self._begin_read(db=self.info) as txn:
            return _U64.unpack(txn.get(b"bytes"))[0]

    def _make_room(self, incoming: int, keep: frozenset[bytes]) -> None:
        cap = self.config.capacity_bytes
        if incoming > cap:
            raise StoreFullError(f"a batch of {incoming} bytes exceeds the store capacity of {cap} bytes")
        if self.stored_bytes() + incoming <= self.config.high_watermark * cap:
            return
        target = max(0, int(self.config.low_watermark * cap) - incoming)
        self.gc(target_bytes=target, keep=keep)
        if self.stored_bytes() + incoming > cap:
            raise StoreFullError(f"store {self.path} is at capacity ({cap} bytes) with entries younger than the "
                                 f"minimum age of {self.config.min_age_s / 3600:g} h; not storing {incoming} bytes")

    def gc(self, target_bytes: int | None = None, ignore_min_age: bool = False,
           keep: frozenset[bytes] = frozenset()) -> int:
        """Evict least recently used entries old enough to go, but none in `keep`, until at most
        `target_bytes` (default: the low watermark) are stored; returns how many were evicted. Works
        on a full disk too: the deletions commit in small batches, on the ballast's room if needed."""
        self._require_writer()
        target = int(self.config.low_watermark * self.config.capacity_bytes) if target_bytes is None else target_bytes
        victims = self._victims(target, ignore_min_age, keep)
        evicted = 0
        for start in range(0, len(victims), _EVICT_BATCH):
            batch = victims[start : start + _EVICT_BATCH]
            evicted += self._write_on_reserve(lambda txn, batch=batch: self._evict(txn, batch))
        _crash_point("evict:after-commit")
        if evicted:
            # one more commit (LMDB reuses the freed pages only after it; an empty transaction
            # would commit nothing, so it carries the eviction counter)
            self.counters.evicted += evicted
            self._write_on_reserve(lambda txn: None)
        self._ensure_ballast()
        return evicted

    def _evict(self, txn, keys: list[bytes]) -> int:
        evicted = sum(self._delete(txn, key) for key in keys)
        _crash_point("evict:before-commit")
        return evicted

    def _victims(self, target: int, ignore_min_age: bool, keep: frozenset[bytes]) -> list[bytes]:
        """Keys to evict, least recently used first, chosen from one snapshot of the metadata (ages
        and sizes read together, so an entry that goes meanwhile cannot be half seen)."""
        now = self.clock()
        with self._begin_read() as txn:
            excess = _U64.unpack(txn.get(b"bytes", db=self.info))[0] - target
            if excess <= 0:
                return []
            candidates = []
            for key, value in txn.cursor(db=self.meta):
                created, last, size = _META.unpack(value)
                if key not in keep and (ignore_min_age or now - created >= self.config.min_age_s):
                    candidates.append((last, key, size))
        victims = []
        for _, key, size in sorted(candidates):
            if excess <= 0:
                break
            victims.append(key)
            excess -= size
        return victims

    # -- disk reserve --------------------------------------------------------------------------------

    def _ensure_ballast(self) -> None:
        """Keep `ballast_bytes` of disk allocated in `ballast` beside the store: on a full disk an
        eviction commit needs a few new pages, and deleting this file gives them. It is (re)made
        only while twice its size is free, so making it never fills the disk by itself."""
        size, ballast = self.config.ballast_bytes, self.path / "ballast"
        if not size or (ballast.is_file() and ballast.stat().st_size >= size):
            return
        vfs = os.statvfs(self.path)
        if vfs.f_bavail * vfs.f_frsize < 2 * size:
            return
        fd = os.open(ballast, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, _PRIVATE_FILE)
        try:
            os.fchmod(fd, _PRIVATE_FILE)
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EFBIG):
                raise
            ballast.unlink()  # a partial reserve would only look like one
        finally:
            os.close(fd)

    def _release_ballast(self) -> bool:
        """Delete the ballast to give its room to an eviction; False when there is none."""
        ballast = self.path / "ballast"
        try:
            size = ballast.stat().st_size
            ballast.unlink()
        except FileNotFoundError:
            return False
        log.warning("store %s: the disk is full; released the %d-byte reserve to evict", self.path, size)
        return True

    # -- map size ------------------------------------------------------------------------------------

    def _grow_map_if_needed(self) -> None:
        info, stat = self.env.info(), self.env.stat()
        used = (info["last_pgno"] + 1) * stat["psize"]
        if used > 0.8 * info["map_size"]:
            self._grow_map()

    def _grow_map(self, force: bool = False) -> bool:
        current = self.env.info()["map_size"]
        wanted = max(2 * current, int(1.3 * self.config.capacity_bytes)) if force else 2 * current
        free = os.statvfs(self.path).f_bavail * os.statvfs(self.path).f_frsize
        file_size = (self.path / "data.mdb").stat().st_size
        new = min(wanted, file_size + free)
        if new <= current:
            return False
        self.env.set_mapsize(new)
        return True

    # -- operations ----------------------------------------------------------------------------------

    def verify(self) -> list[tuple[bytes, str]]:
        """Check every block (header, layout, checksum), that blocks and metadata name the same keys,
        and the byte total; returns the problems. The metadata and the byte total are checked in one
        snapshot; the blocks, the long part, in snapshots of at most `max_read_txn_s` each, so a scan
        beside a busy writer does not keep its freed pages from reuse."""
        problems, total = [], 0
        with self._begin_read(buffers=True) as txn:
            for key, meta in txn.cursor(db=self.meta):
                total += _META.unpack(meta)[2]
                if txn.get(key, db=self.blocks) is None:
                    problems.append((bytes(key), "metadata without a block"))
            stored = _U64.unpack(txn.get(b"bytes", db=self.info))[0]
        if stored != total:
            problems.append((b"", f"byte total {stored} does not match the metadata's {total}"))
        for key, value, meta in self._scan_blocks():
            try:
                blockfmt.decode(self.layout, value)
            except BadBlock as exc:
                problems.append((key, str(exc)))
            if meta is None:
                problems.append((key, "block without metadata"))
        return problems

    def _scan_blocks(self) -> Iterator[tuple[bytes, memoryview, memoryview | None]]:
        """(key, value, metadata or None) of every block in key order, read in a new snapshot
        whenever the current one is `max_read_txn_s` old; a value is valid until the next item."""
        after: bytes | None = None
        while True:
            started = time.monotonic()
            with self._begin_read(buffers=True) as txn:
                cursor = txn.cursor(db=self.blocks)
                found = cursor.set_range(after) if after is not None else cursor.first()
                if found and after is not None and bytes(cursor.key()) == after:
                    found = cursor.next()
                while found:
                    after = bytes(cursor.key())
                    yield after, cursor.value(), txn.get(after, db=self.meta)
                    found = cursor.next()
                    if found and time.monotonic() - started > self.config.max_read_txn_s:
                        break
                if not found:
                    return

    def totals(self) -> dict[str, int]:
        """Cumulative counters of every process that wrote to this store, plus this one's unflushed."""
        with self._begin_read(db=self.info) as txn:
            out = {}
            for name in ("hits", "misses", "bad", "evicted", "written"):
                raw = txn.get(name.encode())
                out[name] = (_U64.unpack(raw)[0] if raw else 0) + getattr(self.counters, name) - getattr(
                    self._flushed, name)
            return out

    def entries(self) -> Iterator[tuple[bytes, float, float, int]]:
        """(key, created, last access, bytes) of every entry."""
        with self._begin_read(db=self.meta) as txn:
            for key, value in txn.cursor():
                yield (bytes(key), *_META.unpack(value))

    def compact_to(self, dest: str | Path) -> None:
        Path(dest).mkdir(parents=True, exist_ok=False)
        self.env.copy(str(dest), compact=True)

    def _require_own_process(self) -> None:
        """LMDB forbids using an environment in a process forked from the one that opened it (its
        locks and reader slots belong to the parent): such a use is refused instead of risking the
        store."""
        if os.getpid() != self._owner_pid:
            raise StoreError(f"the store {self.path} was opened by process {self._owner_pid}; a forked process "
                             "must open it again itself")

    def _require_writer(self) -> None:
        if self.readonly:
            raise StoreError("this store handle is read-only; writes go through the store's writer")


class _Reader:
    def __init__(self, store: GlobalKVStore, txn):
        self.store, self.txn = store, txn

    def contains(self, key: bytes) -> bool:
        return self.txn.get(key, db=self.store.meta) is not None

    def get(self, key: bytes) -> memoryview | None:
        """The block payload (zero-copy view valid inside this reader), or None on a miss or a bad
        value (counted and queued for deletion)."""
        value = self.txn.get(key, db=self.store.blocks)
        store = self.store
        if value is None:
            store.counters.misses += 1
            return None
        try:
            payload = blockfmt.decode(store.layout, value)
        except BadBlock:
            store.counters.bad += 1
            store._pending.bad.add(key)
            return None
        store.counters.hits += 1
        now = store.clock()
        if now - store._last_touch.get(key, -float("inf")) >= store.config.touch_granularity_s:
            store._last_touch[key] = now
            store._pending.touches[key] = now
        return payload


def stored_layout(path: str | Path) -> BlockLayout:
    """The block layout a store was created with (to open it without the model config)."""
    _require_store(path)
    env = lmdb.open(str(path), readonly=True, max_dbs=3, lock=True, lib_version=0)
    try:
        info = env.open_db(b"info", create=False)
        with env.begin(db=info) as txn:
            raw = txn.get(b"layout_spec")
        if raw is None:
            raise StoreVersionError(f"store {path} has no layout record")
        tokens, groups, version = json.loads(raw)
        return BlockLayout(tokens, tuple(tuple(g) for g in groups), version)
    finally:
        env.close()


def check_data_file(path: str | Path) -> None:
    """Raise StoreCorruptError unless `path`/data.mdb is a whole LMDB 0.9 file: both meta pages
    carry LMDB's magic and data format, and the file holds every page up to the last one they
    name. LMDB maps the file, so a page past its end kills the process with SIGBUS, and zeroed
    meta pages are a bare lmdb error: this reads them itself before any open. An empty file is a
    store LMDB has not initialised yet and passes."""
    data = Path(path) / "data.mdb"
    need = _LMDB_LAST_PAGE_AT + 8
    with open(data, "rb") as f:
        last_pages, page_size = [], 0
        for index in (0, 1):
            raw = os.pread(f.fileno(), need, index * page_size)
            if index == 0 and not raw and os.fstat(f.fileno()).st_size == 0:
                return
            if len(raw) < need:
                _corrupt(path, f"data.mdb ends inside meta page {index} ({os.fstat(f.fileno()).st_size:,} bytes)")
            magic, version, _, _, size = _LMDB_META.unpack_from(raw, _LMDB_META_AT)
            if magic != _LMDB_MAGIC:
                _corrupt(path, f"meta page {index} has no LMDB magic (zeroed or overwritten)")
            if version != _LMDB_DATA_VERSION:
                _corrupt(path, f"meta page {index} has LMDB data format {version}, this build reads "
                               f"{_LMDB_DATA_VERSION}")
            if size < 512 or size & (size - 1) or (index and size != page_size):
                _corrupt(path, f"meta page {index} names a page size of {size}")
            page_size = size
            last_pages.append(_U64.unpack_from(raw, _LMDB_LAST_PAGE_AT)[0])
        # the size after the meta pages: a commit meanwhile only grows the file
        file_bytes, needed = os.fstat(f.fileno()).st_size, (max(last_pages) + 1) * page_size
    if file_bytes < needed:
        _corrupt(path, f"data.mdb is truncated: {file_bytes:,} bytes, its meta pages name {needed:,}")


def _require_store(path: str | Path) -> None:
    """Raise unless `path` holds an initialised store whose data file is safe to map."""
    data = Path(path) / "data.mdb"
    if not data.is_file() or data.stat().st_size == 0:
        raise StoreError(f"no store at {path}")
    check_data_file(path)


def _corrupt(path: str | Path, why: str) -> NoReturn:
    raise StoreCorruptError(f"store {path} is corrupt: {why}")


def _lock_writer(path: Path) -> int:
    """Take the store's exclusive writer lock (a flock on `writer.lock`, released when the
    returned descriptor closes, or by the kernel when the process dies). LMDB serialises write
    transactions, but eviction and map growth are decided outside them, so two writer processes
    would race; the second one is refused here with the first one's pid."""
    fd = os.open(path / "writer.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, _PRIVATE_FILE)
    try:
        os.fchmod(fd, _PRIVATE_FILE)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise StoreLockedError(f"store {path} is open for writing by process {holder}; one writer per "
                               "store (readers such as kv stats and kv verify still work)") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _move_aside(path: Path) -> Path:
    """Move data.mdb and lock.mdb into a new private folder `<name>.corrupt-<time>` beside the
    store (kept for inspection; the writer lock and the ballast stay), so the next open starts
    empty. Returns the new folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in itertools.count():
        dest = path.with_name(f"{path.name}.corrupt-{stamp}" + (f"-{n}" if n else ""))
        try:
            dest.mkdir(mode=_PRIVATE_DIR)
            break
        except FileExistsError:
            continue
    os.chmod(dest, _PRIVATE_DIR)
    for name in ("data.mdb", "lock.mdb"):
        if (path / name).exists():
            os.replace(path / name, dest / name)
    return dest


def quarantine(path: str | Path) -> Path:
    """Move a store's files aside (`kv verify --quarantine`); refused while a writer holds it."""
    fd = _lock_writer(Path(path))
    try:
        return _move_aside(Path(path))
    finally:
        os.close(fd)
