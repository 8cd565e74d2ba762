"""The HTTP front end's line to the dspark component: many requests over one ZeroMQ socket.

One thread owns the socket (a `Peer`). Requests from the server's event loop are queued to it and
sent; every reply is routed by request id to that request's asyncio queue. A request's stream ends
with `Finished` or `Error`; when dspark disconnects, or a request hears nothing for the request
timeout, its stream gets an UNAVAILABLE error (ZeroMQ itself never fails a pending request).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from dsv41 import messages as m
from dsv41.components.runtime import ComponentError, Peer

POLL_S = 0.002  # how long the socket thread waits for a reply before it looks for requests to send


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    last: float = field(default_factory=time.monotonic)


class Backend:
    """Sends `Generate` and `Release` messages to dspark and streams the replies back."""

    def __init__(self, endpoint: str, keys_dir: Path | None = None, limits: m.Limits = m.DEFAULT_LIMITS,
                 timeout_s: float = 600.0):
        self.endpoint, self.keys_dir, self.limits, self.timeout_s = endpoint, keys_dir, limits, timeout_s
        self._outbox: queue.Queue[tuple[m.Message, m.Frames | None]] = queue.Queue()
        self._streams: dict[int, _Stream] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="dsv41-http-backend", daemon=True)
        self._thread.start()
        self._ready.wait(10)
        if self._error is not None:
            raise self._error

    # --- event-loop side ---------------------------------------------------------------------------
    def submit(self, request: m.Generate, frames: m.Frames | None = None) -> asyncio.Queue:
        """Send a request (with its images' tensor frames); its replies (TokenEvent..., then Finished or
        Error) arrive on the queue."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            self._streams[request.request_id] = stream
        self._outbox.put((request, frames))
        return stream.events

    def cancel(self, request_id: int, keep: bool = False) -> None:
        """Ask dspark to drop the request and free its state. With `keep`, the request's closing
        `Finished` (reason CANCELLED, with its counts) still reaches its queue."""
        if not keep:
            with self._lock:
                self._streams.pop(request_id, None)
        self._outbox.put((m.Release(request_id=request_id), None))

    def in_flight(self) -> int:
        with self._lock:
            return len(self._streams)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    # --- socket thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            peer = Peer(self.endpoint, "dspark", self.keys_dir, timeout_s=self.timeout_s, limits=self.limits)
        except Exception as e:  # noqa: BLE001 - reported to the constructor
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                self._send_queued(peer)
                try:
                    got = peer.receive_any(POLL_S)
                except ComponentError as e:  # dspark died or restarted: every request in it is lost
                    self._fail_all(e)
                    continue
                if got is not None:
                    self._route(got[0])
                self._expire()
        finally:
            peer.close()

    def _send_queued(self, peer: Peer) -> None:
        while True:
            try:
                message, frames = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                peer.send(message, frames)
            except ComponentError as e:
                if not isinstance(message, m.Release):
                    self._deliver(message.request_id, m.error_reply(message.request_id, e.code, e.component, e.text))

    def _route(self, message: m.Message) -> None:
        if isinstance(message, m.Ack):
            return
        if isinstance(message, m.Error) and message.request_id == 0:  # dspark could not read a message
            self._fail_all(ComponentError(message.code, message.component, message.text))
            return
        self._deliver(message.request_id, message)

    def _deliver(self, request_id: int, message: m.Message) -> None:
        last = isinstance(message, m.Finished | m.Error)
        with self._lock:
            stream = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if stream is None:
            return  # a cancelled request's late replies
        stream.last = time.monotonic()
        stream.loop.call_soon_threadsafe(stream.events.put_nowait, message)

    def _fail_all(self, error: ComponentError) -> None:
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            self._deliver(rid, m.error_reply(rid, error.code, error.component, error.text))

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            late = [rid for rid, s in self._streams.items() if now - s.last > self.timeout_s]
        for rid in late:
            self._deliver(rid, m.error_reply(rid, m.ErrorCode.UNAVAILABLE, "dspark",
                                             f"no reply within {self.timeout_s:.0f} s"))
