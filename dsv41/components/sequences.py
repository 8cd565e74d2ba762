"""Per-request sequence state in the encoder and decoder, dropped when left idle.

A request's state is released by its owner when it ends, giving its global KV pages back; if the
owner died first (a killed scheduler), nobody will, so entries untouched for `idle_s` are dropped
by a periodic sweep.
"""

from __future__ import annotations

import ctypes
import functools
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

from dsv41 import messages as m
from dsv41.engine.core import InferenceCore, Sequence
from dsv41.model.pages import PagePools, PoolFull

NATIVE_CACHE_ENTRIES = 64


def bound_native_caches(entries: int = NATIVE_CACHE_ENTRIES) -> None:
    """Cap oneDNN's two caches of compiled bf16 matmuls (oneDNN's primitive cache and ideep's,
    1024 entries each by default). They are keyed by shape, so every new prompt length adds about
    0.6 MB of kernels that are never freed: a model process grew by hundreds of MB over a few
    hundred requests, in native memory that tracemalloc does not see. Both are read when the first
    matmul is made, so this must run before the model computes; a value already set wins."""
    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        os.environ.setdefault(name, str(entries))


MALLOC_MMAP_THRESHOLD = 1 << 30  # bytes from which glibc's malloc maps each allocation afresh
MALLOC_TRIM_THRESHOLD = 2 << 30  # free bytes at the heap's top that glibc's malloc keeps mapped


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc's malloc serve allocations up to 1 GiB from its heap and keep what is freed
    mapped, so a step's large temporaries reuse pages instead of faulting in fresh ones. By default
    every allocation from 32 MB on is a fresh mapping: a 512-token prompt chunk over a 64K-token
    cache makes key tables of tens of MB in every layer, and allocating and filling 61 MB took 17 ms
    against 5 ms from the heap (the whole chunk 10.9-11.3 s against 9.0-9.4 s on `mini`). The heap
    then stays at its peak rather than shrinking after each step. `DSV41_MALLOC=system` leaves the
    allocator as it is; so does a C library other than glibc. True where the policy was applied."""
    choice = os.environ.get("DSV41_MALLOC", "keep")
    if choice not in ("keep", "system"):
        raise ValueError(f"DSV41_MALLOC={choice!r}: use keep (the default) or system")
    if choice == "system":
        return False
    try:
        libc = ctypes.CDLL(None)  # the process's own symbols, its C library's among them
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version"):  # glibc's alone: the mallopt parameters below are glibc's
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(libc.mallopt(m_mmap_threshold, MALLOC_MMAP_THRESHOLD)) and bool(
        libc.mallopt(m_trim_threshold, MALLOC_TRIM_THRESHOLD))


def model_core(context, name: str) -> InferenceCore:
    """The core a model component runs, warmed up: the pipeline's chunk size, and global KV page
    pools bounded by the component's `kv_pages` option (pages per pool; unset: they grow with the
    requests)."""
    bound_native_caches()
    keep_freed_memory()
    pages = context.option(name, "kv_pages", None)
    if pages is not None and (not isinstance(pages, int) or isinstance(pages, bool) or pages < 1):
        raise ValueError(f"components.{name}.options.kv_pages must be a positive integer, got {pages!r}")
    core = InferenceCore(context.build_model(), context.pipeline.generation.chunk_size, PagePools(max_pages=pages))
    core.warm_up()  # before the component reports ready: the first request does not pay the first calls
    return core


@contextmanager
def page_capacity() -> Iterator[None]:
    """A full page pool fails the request at hand with CAPACITY (pages are taken before any work,
    so nothing else changes); the other requests go on."""
    try:
        yield
    except PoolFull as e:
        raise m.MessageError(m.ErrorCode.CAPACITY, f"{e}; retry when other requests have finished") from None


class Sequences:
    def __init__(self, idle_s: float, clock=time.monotonic):
        self.idle_s, self.clock = idle_s, clock
        self._items: dict[int, tuple[Sequence, float]] = {}
        self._next_sweep = 0.0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._items

    def add(self, request_id: int, seq: Sequence) -> None:
        if request_id in self._items:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"request {request_id} already has a sequence")
        self._items[request_id] = (seq, self.clock())

    def get(self, request_id: int) -> Sequence:
        if request_id not in self._items:
            raise m.MessageError(m.ErrorCode.UNKNOWN_REQUEST, f"no sequence for request {request_id} "
                                 "(never prefilled, released, idle too long, or lost in a restart)")
        seq = self._items[request_id][0]
        self._items[request_id] = (seq, self.clock())
        return seq

    def pages_in_use(self) -> int:
        """Global KV pages the live sequences hold (a gauge for `dsv41 status`)."""
        return sum(seq.cache.pages_in_use() for seq, _ in self._items.values())

    def pop(self, request_id: int) -> None:
        """Release the request's pages, then forget it: whoever sees it gone (another thread's
        `dsv41 status`, a test) also sees its pages back."""
        item = self._items.get(request_id)
        if item is not None:
            item[0].cache.release()
            del self._items[request_id]

    def sweep(self) -> int:
        """Drop idle entries (at most once a second); returns how many were dropped."""
        now = self.clock()
        if now < self._next_sweep:
            return 0
        self._next_sweep = now + 1.0
        idle = [rid for rid, (_, used) in self._items.items() if now - used > self.idle_s]
        for rid in idle:
            self.pop(rid)
        return len(idle)
