"""The persistent global-KV store: one LMDB environment, one writer process, many readers.

Three databases: `blocks` (prefix key -> checked block value, `blockfmt`), `meta` (key -> created,
last access, size) and `info` (store format, block layout, total bytes, hit counters). A batch of
blocks is written in one transaction together with its metadata and the byte total, so after a
crash a block is either there with its metadata or absent.

Retention: an entry younger than `min_age_s` (default 72 h) is never evicted unless the operator
asks (`gc(ignore_min_age=True)`); beyond that, least recently used entries go first whenever the
stored bytes pass the high watermark, down to the low watermark. When only young entries are left
and the capacity is reached, a write raises StoreFullError and stores nothing (the caller simply
does not cache that request). Access times are buffered and written at most once per
`touch_granularity_s` per entry, with the next write, so reads never turn into write storms.

Reads are zero-copy: `with store.reader() as r: view = r.get(key)` returns a memoryview into
LMDB's map that stays valid only until the `with` block ends; copy it (bytes(view)) to keep it.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import lmdb

from dsv41.storage import blockfmt
from dsv41.storage.blockfmt import BadBlock, BlockLayout

STORE_FORMAT = 1
_META = struct.Struct("<ddI")  # created, last access (clock seconds), value bytes
_U64 = struct.Struct("<Q")
GIB = 2**30
# How a failed commit reads when the file cannot grow (ENOSPC, EFBIG, or EIO from a short write).
_DISK_FULL_MESSAGES = ("No space left", "File too large", "Input/output error")


class StoreError(Exception):
    """Base of the store's named errors."""


class StoreFullError(StoreError):
    """Nothing more fits: the capacity holds only entries younger than the minimum age, or the
    map cannot grow because the disk is full."""


class StoreVersionError(StoreError):
    """The store on disk was written in another store format or block layout."""


@dataclass
class StoreConfig:
    capacity_bytes: int = 64 * GIB
    min_age_s: float = 72 * 3600.0
    high_watermark: float = 0.95
    low_watermark: float = 0.90
    touch_granularity_s: float = 60.0
    max_readers: int = 1024
    initial_map_bytes: int = 256 * 2**20


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
    def __init__(self, path: str | Path, layout: BlockLayout, config: StoreConfig | None = None,
                 clock: Callable[[], float] = time.time, readonly: bool = False):
        self.path, self.layout, self.config = Path(path), layout, config or StoreConfig()
        self.clock, self.readonly = clock, readonly
        self.counters = Counters()
        self._flushed = Counters()  # counter values already added to the store's totals
        self._pending = _Pending()
        self._last_touch: dict[bytes, float] = {}
        if not readonly:
            self.path.mkdir(parents=True, exist_ok=True)
        elif not (self.path / "data.mdb").is_file():
            raise StoreError(f"no store at {self.path}")
        self.env = lmdb.open(str(self.path), map_size=self._map_size_for_open(), max_dbs=3, readonly=readonly,
                             max_readers=self.config.max_readers, max_spare_txns=0, writemap=False, sync=True,
                             metasync=True, lock=True, lib_version=0)
        self.env.reader_check()
        self.blocks = self.env.open_db(b"blocks", create=not readonly)
        self.meta = self.env.open_db(b"meta", create=not readonly)
        self.info = self.env.open_db(b"info", create=not readonly)
        self._check_identity()

    # -- opening -------------------------------------------------------------------------------------

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
                return
            if stored is None or _U64.unpack(stored)[0] != STORE_FORMAT:
                found = "none" if stored is None else _U64.unpack(stored)[0]
                raise StoreVersionError(f"store {self.path} has store format {found}; this build reads {STORE_FORMAT}")
            layout = _U64.unpack(txn.get(b"layout"))[0]
            if layout != self.layout.layout_id:
                raise StoreVersionError(f"store {self.path} holds blocks of layout {layout}, this model writes "
                                        f"layout {self.layout.layout_id} (another block size or KV format)")

    def close(self) -> None:
        if not self.readonly:
            self.flush()
        self.env.close()

    def __enter__(self) -> GlobalKVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reading -------------------------------------------------------------------------------------

    @contextmanager
    def reader(self) -> Iterator[_Reader]:
        """A read transaction; views it returns die with it."""
        try:
            txn = self.env.begin(buffers=True)
        except lmdb.MapResizedError:
            self.env.set_mapsize(0)  # adopt the size another process grew the map to
            txn = self.env.begin(buffers=True)
        try:
            yield _Reader(self, txn)
        finally:
            txn.abort()

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
        Raises StoreFullError (storing nothing) when they cannot fit."""
        self._require_writer()
        values = {key: blockfmt.encode(self.layout, payload) for key, payload in payloads.items()}
        incoming = sum(len(v) for v in values.values())
        self._make_room(incoming)
        return self._write(lambda txn: self._put_values(txn, values))

    def _put_values(self, txn, values: dict[bytes, bytes]) -> int:
        now, added, written = self.clock(), 0, 0
        for key, value in values.items():
            if txn.get(key, db=self.blocks) is not None:
                continue
            txn.put(key, value, db=self.blocks)
            txn.put(key, _META.pack(now, now, len(value)), db=self.meta)
            added += len(value)
            written += 1
        self._add_bytes(txn, added)
        self.counters.written += written
        return written

    def flush(self) -> None:
        """Write buffered access times and counters, and drop values found bad by readers."""
        if self._pending.touches or self._pending.bad or self.counters != self._flushed:
            self._write(lambda txn: None)

    def _write(self, body: Callable):
        """One write transaction: the pending touches and deletions, then `body`; grows the map
        first when it is nearly full, and once more on MapFullError."""
        self._grow_map_if_needed()
        self.env.reader_check()  # free slots of readers that died; a dead slot would pin old pages
        for attempt in (0, 1):
            try:
                with self.env.begin(write=True) as txn:
                    self._apply_pending(txn)
                    result = body(txn)
                self._pending = _Pending()
                return result
            except lmdb.MapFullError:
                if attempt or not self._grow_map(force=True):
                    raise StoreFullError(f"store {self.path}: the LMDB map is full and cannot grow") from None
            except lmdb.Error as exc:
                if isinstance(exc, lmdb.DiskError) or any(s in str(exc) for s in _DISK_FULL_MESSAGES):
                    raise StoreFullError(f"store {self.path}: the disk is full ({exc}); nothing was stored") from exc
                raise
        raise AssertionError("unreachable")

    def _apply_pending(self, txn) -> None:
        for name in ("hits", "misses", "bad", "evicted", "written"):
            delta = getattr(self.counters, name) - getattr(self._flushed, name)
            if delta:
                current = txn.get(name.encode(), db=self.info)
                txn.put(name.encode(), _U64.pack((_U64.unpack(current)[0] if current else 0) + delta), db=self.info)
        self._flushed = Counters(**vars(self.counters))
        for key in self._pending.bad:
            self._delete(txn, key)
        for key, when in self._pending.touches.items():
            meta = txn.get(key, db=self.meta)
            if meta is not None:
                created, _, size = _META.unpack(meta)
                txn.put(key, _META.pack(created, when, size), db=self.meta)

    def _delete(self, txn, key: bytes) -> None:
        meta = txn.get(key, db=self.meta)
        size = _META.unpack(meta)[2] if meta is not None else len(txn.get(key, db=self.blocks) or b"")
        if txn.delete(key, db=self.blocks) or meta is not None:
            txn.delete(key, db=self.meta)
            self._add_bytes(txn, -size)

    def _add_bytes(self, txn, delta: int) -> None:
        if delta:
            current = _U64.unpack(txn.get(b"bytes", db=self.info))[0]
            txn.put(b"bytes", _U64.pack(current + delta), db=self.info)

    # -- capacity, retention, eviction ---------------------------------------------------------------

    def stored_bytes(self) -> int:
        with self.env.begin(db=self.info) as txn:
            return _U64.unpack(txn.get(b"bytes"))[0]

    def _make_room(self, incoming: int) -> None:
        cap = self.config.capacity_bytes
        if incoming > cap:
            raise StoreFullError(f"a batch of {incoming} bytes exceeds the store capacity of {cap} bytes")
        if self.stored_bytes() + incoming <= self.config.high_watermark * cap:
            return
        target = max(0, int(self.config.low_watermark * cap) - incoming)
        self.gc(target_bytes=target)
        if self.stored_bytes() + incoming > cap:
            raise StoreFullError(f"store {self.path} is at capacity ({cap} bytes) with entries younger than the "
                                 f"minimum age of {self.config.min_age_s / 3600:g} h; not storing {incoming} bytes")

    def gc(self, target_bytes: int | None = None, ignore_min_age: bool = False) -> int:
        """Evict least recently used entries old enough to go until at most `target_bytes` (default:
        the low watermark) are stored; returns how many were evicted."""
        self._require_writer()
        target = int(self.config.low_watermark * self.config.capacity_bytes) if target_bytes is None else target_bytes
        now = self.clock()
        with self.env.begin(db=self.meta) as txn:
            candidates = sorted(
                (_META.unpack(v)[1], k) for k, v in txn.cursor()
                if ignore_min_age or now - _META.unpack(v)[0] >= self.config.min_age_s)
        victims, excess = [], self.stored_bytes() - target
        with self.env.begin(db=self.meta) as txn:
            for _, key in candidates:
                if excess <= 0:
                    break
                victims.append(key)
                excess -= _META.unpack(txn.get(key))[2]
        if victims:
            self._write(lambda txn: [self._delete(txn, key) for key in victims])
            self._write(lambda txn: None)  # one more commit: a full map frees its pages only after it
            self.counters.evicted += len(victims)
        return len(victims)

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
        """Check every block (header, layout, checksum) and the metadata; returns the problems."""
        problems, total = [], 0
        with self.env.begin(buffers=True) as txn:
            for key, value in txn.cursor(db=self.blocks):
                try:
                    blockfmt.decode(self.layout, value)
                except BadBlock as exc:
                    problems.append((bytes(key), str(exc)))
                meta = txn.get(key, db=self.meta)
                if meta is None:
                    problems.append((bytes(key), "block without metadata"))
                else:
                    total += _META.unpack(meta)[2]
            stored = _U64.unpack(txn.get(b"bytes", db=self.info))[0]
        if stored != total:
            problems.append((b"", f"byte total {stored} does not match the blocks' {total}"))
        return problems

    def totals(self) -> dict[str, int]:
        """Cumulative counters of every process that wrote to this store, plus this one's unflushed."""
        with self.env.begin(db=self.info) as txn:
            out = {}
            for name in ("hits", "misses", "bad", "evicted", "written"):
                raw = txn.get(name.encode())
                out[name] = (_U64.unpack(raw)[0] if raw else 0) + getattr(self.counters, name) - getattr(
                    self._flushed, name)
            return out

    def entries(self) -> Iterator[tuple[bytes, float, float, int]]:
        """(key, created, last access, bytes) of every entry."""
        with self.env.begin(db=self.meta) as txn:
            for key, value in txn.cursor():
                yield (bytes(key), *_META.unpack(value))

    def compact_to(self, dest: str | Path) -> None:
        Path(dest).mkdir(parents=True, exist_ok=False)
        self.env.copy(str(dest), compact=True)

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
    if not (Path(path) / "data.mdb").is_file():
        raise StoreError(f"no store at {path}")
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
