"""Requests sent to a peer whose replies are still to come, each with what to do with its reply.

The encoder hands every step and prefill on to the decoder. Waiting for the decoder's answer would
leave one of the two compute processes idle at any time; instead the encoder sends, goes on with
other work (the next prefill chunk, the next request's step) and acts on each reply when it comes.
A peer answers the messages of one connection in the order they were sent, so the replies to one
request id come in the order of its messages.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import zmq

from dsv41 import messages as m
from dsv41.components.runtime import ComponentError, Peer

Outcome = tuple[m.Message, list[memoryview]] | ComponentError
Then = Callable[[Outcome], None]


def raise_error(outcome: Outcome) -> tuple[m.Message, list[memoryview]]:
    """The reply itself; an `Error` reply, a lost peer or a missed deadline as a ComponentError."""
    if isinstance(outcome, ComponentError):
        raise outcome
    message, frames = outcome
    if isinstance(message, m.Error):
        raise ComponentError(message.code, message.component, message.text)
    return message, frames


class InFlight:
    """The requests on one peer that await their replies, in the order they were sent."""

    def __init__(self, peer: Peer, timeout_s: float, clock: Callable[[], float] = time.monotonic):
        self.peer, self.timeout_s, self.clock = peer, timeout_s, clock
        self._pending: dict[int, deque[tuple[float, float, Then]]] = {}

    def __len__(self) -> int:
        return sum(len(waiting) for waiting in self._pending.values())

    def send(self, message: m.Message, frames: m.Frames | None, then: Then, timeout_s: float | None = None) -> None:
        """Send; `then(outcome)` runs in a later `poll` with the reply or the ComponentError that
        stands for it (an unsendable message raises here and registers nothing)."""
        self.peer.send(message, frames)
        timeout_s = timeout_s or self.timeout_s
        self._pending.setdefault(m.request_id_of(message), deque()).append((self.clock() + timeout_s, timeout_s, then))

    def call(self, message: m.Message, frames: m.Frames | None = None,
             timeout_s: float | None = None) -> tuple[m.Message, list[memoryview]]:
        """Send and wait for this reply, acting meanwhile on the replies to earlier requests; raises
        ComponentError for an Error reply, a lost peer or the deadline."""
        box: list[Outcome] = []
        self.send(message, frames, box.append, timeout_s)
        while not box:
            self.poll(0.05)
        return raise_error(box[0])

    def poll(self, timeout_s: float = 0.0, wake: zmq.Socket | None = None) -> int:
        """Act on the replies that are there (waiting up to timeout_s for the first, or until `wake`
        becomes readable) and fail the requests past their deadline; returns how many were settled."""
        settled = 0
        try:
            while self._pending and (got := self.peer.receive_any(0.0 if settled else timeout_s, wake)) is not None:
                settled += self._settle(m.request_id_of(got[0]), got)
        except ComponentError as e:  # the peer is gone: nothing sent to it will be answered
            settled += self.fail_all(e)
        return settled + self._expire()

    def fail_all(self, error: ComponentError) -> int:
        waiting = [then for queue in self._pending.values() for _, _, then in queue]
        self._pending.clear()
        for then in waiting:
            then(error)
        return len(waiting)

    def _settle(self, request_id: int, got: tuple[m.Message, list[memoryview]]) -> int:
        queue = self._pending.get(request_id)
        if queue is None:
            if isinstance(got[0], m.Error) and request_id == 0:  # a message of ours it could not read
                return self.fail_all(ComponentError(got[0].code, got[0].component, got[0].text))
            return 0  # the reply to a request already failed by its deadline
        then = queue.popleft()[2]
        if not queue:
            del self._pending[request_id]
        then(got)
        return 1

    def _expire(self) -> int:
        now, expired = self.clock(), []
        for request_id, queue in list(self._pending.items()):
            while queue and queue[0][0] <= now:
                expired.append(queue.popleft()[1:])
            if not queue:
                del self._pending[request_id]
        for timeout_s, then in expired:
            then(ComponentError(m.ErrorCode.UNAVAILABLE, self.peer.name, f"no reply within {timeout_s:.1f} s"))
        return len(expired)
