"""kvstore: owns the LMDB global-KV store (and the host SWA pool) and serves the other components.

Only this process opens the store for writing. Lookups hash the prompt's complete blocks and
return the longest stored chain; reads return block payloads (a copy per block, as tensor
frames); writes are batched and durable when acknowledged. A full store answers `full=True`
and stores nothing: the caller has computed the KV anyway, so a full store costs only reuse.

A store that cannot be used (another model's, another format, a second writer holds it) is
logged once and the component runs without it: every lookup misses, nothing is stored, and the
pipeline recomputes. A corrupt store file is moved aside and replaced by an empty store.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from dsv41 import messages as m
from dsv41.components.context import ComponentContext
from dsv41.components.runtime import Component, Reply
from dsv41.storage.blockfmt import BlockLayout
from dsv41.storage.policy import PrefixCachePolicy
from dsv41.storage.prefix import Fingerprint
from dsv41.storage.store import GlobalKVStore, StoreBusyError, StoreConfig, StoreError, StoreFullError
from dsv41.storage.swa_pool import SWAPool

GIB = 2**30
log = logging.getLogger(__name__)


def store_path(context: ComponentContext) -> Path:
    return Path(context.pipeline.store.path.replace("{pipeline}", context.pipeline.name)).expanduser()


def open_policy(context: ComponentContext) -> PrefixCachePolicy | None:
    """The prefix cache over the pipeline's store, or None (logged) when the store cannot be used:
    a cache is never a reason for a pipeline not to run."""
    spec = context.pipeline.store
    layout = BlockLayout.of(context.config, spec.block_tokens)
    fingerprint = Fingerprint.of(context.config, context.weights_revision)
    try:
        store = GlobalKVStore(store_path(context), layout, StoreConfig(capacity_bytes=int(spec.capacity_gib * GIB)),
                              model_id=fingerprint.digest(), quarantine=True)
    except StoreError as exc:
        log.error("kvstore: %s; running without the prefix cache (requests recompute)", exc)
        return None
    pool = SWAPool(int(spec.swa_pool_gib * GIB), spec.swa_ttl_s)
    return PrefixCachePolicy(store, pool, fingerprint, spec.block_tokens)


class KVStoreComponent(Component):
    name = "kvstore"
    accepts = frozenset({m.KIND.LOOKUP, m.KIND.GET_BLOCKS, m.KIND.PUT_BLOCKS})

    def __init__(self, context: ComponentContext):
        super().__init__()
        self.block_tokens = context.pipeline.store.block_tokens
        self.policy = open_policy(context)
        self.counters["store_disabled"] = int(self.policy is None)
        self._next_gauges = 0.0

    def handle(self, message: m.Message, frames: list[memoryview], reply: Reply) -> None:
        rid = message.request_id
        if self.policy is None:  # no keys in a lookup: the encoder then neither loads nor stores
            match message:
                case m.Lookup():
                    reply(m.LookupResult(request_id=rid, keys=[], cached_blocks=0, block_tokens=self.block_tokens))
                case m.GetBlocks():
                    reply(m.Blocks(request_id=rid, payloads=[]))
                case m.PutBlocks():
                    reply(m.Stored(request_id=rid, stored=0))
            return
        try:
            self._serve(message, frames, reply)
        except StoreBusyError as e:  # the encoder recomputes, as for any kvstore failure
            raise m.MessageError(m.ErrorCode.UNAVAILABLE, str(e)) from None

    def _serve(self, message: m.Message, frames: list[memoryview], reply: Reply) -> None:
        rid = message.request_id
        match message:
            case m.Lookup():
                extra: dict[int, list[bytes]] = {}
                for item in message.image_keys:  # image content in the keys of the blocks holding spans
                    extra.setdefault(item.block, []).append(item.key)
                hit = self.policy.lookup(m.unpack_ids(message.ids), extra or None)
                self.counters.update(hit_blocks=hit.cached_blocks, snapshot_hits=hit.swa_snapshot is not None)
                out = m.Frames()
                snapshot = None if hit.swa_snapshot is None else out.add(
                    torch.frombuffer(bytearray(hit.swa_snapshot), dtype=torch.uint8))
                reply(m.LookupResult(request_id=rid, keys=hit.keys, cached_blocks=hit.cached_blocks,
                                     block_tokens=self.policy.block_size, snapshot=snapshot), out)
            case m.GetBlocks():
                out = m.Frames()
                payloads = []
                for key in message.keys:
                    payload = self.policy.store.get_copy(key)
                    if payload is None:
                        break
                    payloads.append(out.add(torch.frombuffer(bytearray(payload), dtype=torch.uint8)))
                    self.counters["store_read_bytes"] += len(payload)
                reply(m.Blocks(request_id=rid, payloads=payloads), out)
            case m.PutBlocks():
                reply(self._put(message, frames))

    def _put(self, message: m.PutBlocks, frames: list[memoryview]) -> m.Stored:
        if len(message.keys) != len(message.payloads):
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"{len(message.keys)} keys for "
                                 f"{len(message.payloads)} payloads")
        values = {key: bytes(frames[p.frame]) for key, p in zip(message.keys, message.payloads, strict=True)}
        if message.snapshot is not None and len(message.snapshot_key) == 32:
            self.policy.pool.put(message.snapshot_key, bytes(frames[message.snapshot.frame]))
            self.counters["snapshots_pooled"] += 1
        try:
            stored = self.policy.store.put_many(values)
        except ValueError as e:  # a payload that does not fit the block layout
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, str(e)) from None
        except StoreFullError:
            self.counters["store_full"] += 1
            return m.Stored(request_id=message.request_id, stored=0, full=True)
        self.counters["stored_blocks"] += stored
        if values:  # blocks already stored are skipped; all blocks of a layout are the same size
            self.counters["store_written_bytes"] += sum(map(len, values.values())) * stored // len(values)
        return m.Stored(request_id=message.request_id, stored=stored)

    def tick(self) -> bool:
        """Gauges of the host SWA pool and the store for `dsv41 status` and /metrics."""
        now = time.monotonic()
        if self.policy is not None and now >= self._next_gauges:
            self._next_gauges = now + 0.5
            pool = self.policy.pool
            gauges = {"swa_pool_entries": len(pool), "swa_pool_bytes": pool.bytes_used,
                      "swa_pool_expired": pool.counters.expired, "swa_pool_evicted": pool.counters.evicted,
                      "store_size_bytes": self.policy.store.stored_bytes(),
                      "store_reader_slots_freed": self.policy.store.reader_slots_freed}
            for key, value in gauges.items():  # set, not added (Counter.update adds)
                self.counters[key] = value
        return False

    def close(self) -> None:
        if self.policy is not None:
            self.policy.store.close()
