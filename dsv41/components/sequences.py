"""Per-request sequence state in the encoder and decoder, dropped when left idle.

A request's state is released by its owner when it ends, giving its global KV pages back; if the
owner died first (a killed scheduler), nobody will, so entries untouched for `idle_s` are dropped
by a periodic sweep.
"""

from __future__ import annotations

import time

from dsv41 import messages as m
from dsv41.engine.core import Sequence


class Sequences:
    def __init__(self, idle_s: float, clock=time.monotonic):
        self.idle_s, self.clock = idle_s, clock
        self._items: dict[int, tuple[Sequence, float]] = {}
        self._next_sweep = 0.0

    def __len__(self) -> int:
        return len(self._items)

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
        item = self._items.pop(request_id, None)
        if item is not None:
            item[0].cache.release()

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
