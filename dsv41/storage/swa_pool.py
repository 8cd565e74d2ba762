"""Host-memory pool of encoder SWA snapshots: bounded by bytes and by age, least recently used first.

A snapshot is the encoder's SWA rings (layers 0..L/2-1, W entries of 528 B each) of one sequence
at one position, keyed by the prefix identity of that position. The pool lives in one process's
memory, so it is empty after a restart by design: a missing snapshot only costs an encoder replay
of W tokens. Ages use a monotonic clock, so wall-clock jumps do not expire or revive anything.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


class SWAPoolError(ValueError):
    """A snapshot that can never fit the pool."""


def default_pool_bytes(fraction: float = 0.10) -> int:
    """10 % of this host's physical memory."""
    return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * fraction)


@dataclass
class PoolCounters:
    hits: int = 0
    misses: int = 0
    expired: int = 0
    evicted: int = 0


class SWAPool:
    def __init__(self, capacity_bytes: int | None = None, ttl_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic):
        self.capacity = default_pool_bytes() if capacity_bytes is None else capacity_bytes
        self.ttl, self.clock = ttl_s, clock
        self.counters = PoolCounters()
        self._items: OrderedDict[bytes, tuple[float, bytes]] = OrderedDict()  # key -> (stored at, snapshot)
        self.bytes_used = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: bytes, snapshot: bytes) -> None:
        """Pool `snapshot` (any object with a length in bytes; it is kept, not copied)."""
        if len(snapshot) > self.capacity:
            raise SWAPoolError(f"a snapshot of {len(snapshot)} bytes cannot fit a pool of {self.capacity} bytes")
        self._drop(key)
        self._items[key] = (self.clock(), snapshot)
        self.bytes_used += len(snapshot)
        self._expire()
        while self.bytes_used > self.capacity:
            self._drop(next(iter(self._items)))
            self.counters.evicted += 1

    def get(self, key: bytes) -> bytes | None:
        self._expire()
        item = self._items.get(key)
        if item is None:
            self.counters.misses += 1
            return None
        self._items.move_to_end(key)
        self.counters.hits += 1
        return item[1]

    def _expire(self) -> None:
        now = self.clock()
        for key in [k for k, (at, _) in self._items.items() if now - at > self.ttl]:
            self._drop(key)
            self.counters.expired += 1

    def _drop(self, key: bytes) -> None:
        item = self._items.pop(key, None)
        if item is not None:
            self.bytes_used -= len(item[1])
