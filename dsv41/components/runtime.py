"""The one component runtime: sockets, a serving loop, and calls to other components.

A component binds one ROUTER socket. Its I/O thread owns that socket: it decodes every incoming
message (a malformed one gets an `Error` reply there and then, and is counted), answers `Ping`
itself so health checks work while the compute loop is busy, and queues the rest. The compute
loop only reads that queue and writes replies to an inproc socket that the I/O thread forwards,
so no socket is ever touched by two threads. A request that makes the component raise fails
alone with an INTERNAL error; the component keeps serving.

Calls to other components go through a `Peer` (one DEALER per peer, used by one thread): every
call has a deadline, and a monitor socket turns a peer's disconnect (its process died) into an
UNAVAILABLE error at once instead of a wait that ZeroMQ would never end.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import zmq
from zmq.utils.monitor import parse_monitor_message

from dsv41 import messages as m
from dsv41.components.security import CurveServer, apply_curve_client, check_bind_allowed
from dsv41.pipelines.schema import endpoint_problem

LINGER_MS = 200
HEARTBEAT_MS = 1000
IPC_PATH_LIMIT = 107
_ids = itertools.count(int(time.time() * 1000) << 16)


def new_request_id() -> int:
    return next(_ids)


class ComponentError(RuntimeError):
    """An `Error` reply, or a peer that is gone: names the component and the problem."""

    def __init__(self, code: m.ErrorCode, component: str, text: str):
        super().__init__(f"{component}: {text}")
        self.code, self.component, self.text = code, component, text


class EndpointInUse(RuntimeError):
    pass


def check_endpoint(endpoint: str) -> None:
    problem = endpoint_problem(endpoint)
    path = os.fsencode(endpoint.removeprefix("ipc://")) if endpoint.startswith("ipc://") else b""
    if not problem and len(path) > IPC_PATH_LIMIT:
        problem = f"socket path is {len(path)} bytes; Unix sockets allow at most {IPC_PATH_LIMIT}"
    if problem:
        raise ValueError(f"Invalid zmq endpoint {endpoint!r}: {problem}")


# Seconds a closed listener's ipc file is given to disappear. A libzmq before 4.2.3 removes it in the
# background after the close; later ones never remove a named socket file (zeromq/libzmq#2765), so
# waiting would only add a second to every component's stop.
IPC_FILE_SETTLE_S = 0.0 if zmq.zmq_version_info() >= (4, 2, 3) else 1.0


class _IpcLock:
    """An exclusive lock beside an ipc socket file, taken before bind: a second process binding
    the same path would otherwise silently take over its traffic."""

    def __init__(self, endpoint: str):
        check_endpoint(endpoint)
        self.path = Path(endpoint.removeprefix("ipc://"))
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.fd = os.open(f"{self.path}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise EndpointInUse(f"{endpoint} is bound by another running process (lock {self.path}.lock)") from None
        self.path.unlink(missing_ok=True)  # a stale socket file left by a killed process

    def release(self) -> None:
        """After the socket is closed: waiting for a libzmq that removes the socket file itself
        (`IPC_FILE_SETTLE_S`) keeps its late removal from deleting the socket file of the next
        process to bind this path."""
        deadline = time.monotonic() + IPC_FILE_SETTLE_S
        while self.path.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        self.path.unlink(missing_ok=True)
        Path(f"{self.path}.lock").unlink(missing_ok=True)
        os.close(self.fd)


def make_socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool, keys_dir: Path | None = None,
                curve: CurveServer | None = None, max_bytes: int = m.DEFAULT_MAX_BYTES,
                routing_id: bytes | None = None, prepare: Callable[[zmq.Socket], None] | None = None) -> zmq.Socket:
    """Every socket of dsv41 comes from here: size cap (`max_bytes`: the largest message it can
    legitimately receive; a bigger frame drops the sender's connection before it is allocated),
    bounded linger, strict routing, deadlines possible on send, CURVE on tcp when keys are
    configured, loopback-only tcp without them. `routing_id`: how the peer's ROUTER names this
    connection (else one of ZeroMQ's choosing). `prepare(socket)` runs just before it binds or
    connects (a monitor set up later can miss the first events)."""
    check_endpoint(endpoint)
    sock = ctx.socket(kind)
    try:
        if routing_id is not None:
            sock.setsockopt(zmq.ROUTING_ID, routing_id)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        if kind == zmq.ROUTER:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        if kind == zmq.DEALER:
            sock.setsockopt(zmq.IMMEDIATE, 1)
        tcp = endpoint.startswith("tcp://")
        if tcp:  # a frozen or unplugged peer drops its connection (and fails its calls) within about 3 s
            sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_MS)
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * HEARTBEAT_MS)
            sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * HEARTBEAT_MS)
        if prepare is not None:
            prepare(sock)
        if bind:
            if tcp:
                check_bind_allowed(endpoint, keys_dir)
            if curve is not None:
                curve.apply(sock)
            sock.bind(endpoint)
        else:
            if tcp and keys_dir is not None:
                apply_curve_client(sock, keys_dir)
            sock.connect(endpoint)
    except BaseException:  # a refused bind must not leave an open socket behind (ctx.term() would hang)
        sock.close(0)
        raise
    return sock


Reply = Callable[[m.Message, "m.Frames | None"], None]


class Component:
    """What a component implements; the runtime does the rest."""

    name = "component"
    accepts: frozenset[m.KIND] = frozenset()
    early: frozenset[m.KIND] = frozenset()  # delivered on the I/O thread, even while a request computes
    # kinds whose reply goes to the connection their `reply_to` names, when it names one, rather than
    # to the connection they came on (a relayed request answered straight to the one who asked)
    routed: frozenset[m.KIND] = frozenset()

    def __init__(self):
        self.counters: Counter[str] = Counter()
        # messages waiting in the runtime's inbox (set by the Server): work can wait for more of its kind
        self.inbox_size: Callable[[], int] = lambda: 0
        # readable whenever a message has come into the inbox (set by the Server): a component that
        # waits on a peer's replies waits on this too, so that a new request does not wait for them
        self.inbox_bell: zmq.Socket | None = None

    def handle(self, message: m.Message, frames: list[memoryview], reply: Reply) -> None:
        raise NotImplementedError

    def error_fields(self, error: Exception) -> tuple[m.ErrorCode, str, str]:
        """How a request that failed with `error` is answered: the code, the component that failed
        and why. Anything but a MessageError or ComponentError is an internal error (counted)."""
        if isinstance(error, m.MessageError):
            return error.code, self.name, str(error)
        if isinstance(error, ComponentError):
            return error.code, error.component, error.text
        self.counters["internal_errors"] += 1
        return m.ErrorCode.INTERNAL, self.name, f"{type(error).__name__}: {error}"

    def deliver(self, message: m.Message, frames: list[memoryview]) -> None:
        """Take an `early` message on the I/O thread (it must not block)."""

    def tick(self) -> bool:
        """Background work between messages (a scheduler's decode steps); True if any was done."""
        return False

    def close(self) -> None:
        """Release what the component holds (stores, files); called once, on shutdown."""


class Server:
    """Serves one component on one endpoint: an I/O thread plus the compute loop (`run`)."""

    def __init__(self, component: Component, endpoint: str, keys_dir: Path | None = None,
                 ctx: zmq.Context | None = None, limits: m.Limits = m.DEFAULT_LIMITS):
        self.component, self.endpoint, self.limits = component, endpoint, limits
        self.kinds = component.accepts | component.early | {m.KIND.PING}
        self.ctx = ctx or zmq.Context.instance()
        self.stop_event = threading.Event()
        self.inbox: queue.Queue = queue.Queue()
        component.inbox_size = self.inbox.qsize
        self._out_endpoint = f"inproc://dsv41-out-{id(self)}"
        self._lock = _IpcLock(endpoint) if endpoint.startswith("ipc://") else None
        tcp_keys = keys_dir if endpoint.startswith("tcp://") else None
        self._curve = CurveServer(self.ctx, tcp_keys) if tcp_keys is not None else None
        try:
            self._router = make_socket(self.ctx, zmq.ROUTER, endpoint, bind=True, keys_dir=keys_dir, curve=self._curve,
                                       max_bytes=limits.largest(self.kinds))
        except Exception:
            self._release()
            raise
        self._pull = self.ctx.socket(zmq.PULL)
        self._pull.bind(self._out_endpoint)
        self._bell_endpoint = f"inproc://dsv41-bell-{id(self)}"
        self._bell = self.ctx.socket(zmq.PULL)  # the compute thread's end; the I/O thread rings it
        self._bell.setsockopt(zmq.LINGER, 0)
        self._bell.bind(self._bell_endpoint)
        self._ran = False
        component.inbox_bell = self._bell
        self._started = time.monotonic()
        self._io = threading.Thread(target=self._io_loop, name=f"{component.name}-io", daemon=True)
        self._io.start()

    # --- I/O thread ------------------------------------------------------------------------------
    def _io_loop(self) -> None:
        ring = self.ctx.socket(zmq.PUSH)
        ring.setsockopt(zmq.LINGER, 0)
        ring.setsockopt(zmq.SNDHWM, 1)  # one ring wakes the compute thread; more add nothing
        ring.connect(self._bell_endpoint)
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._pull, zmq.POLLIN)
        while not self.stop_event.is_set():
            for sock, _ in poller.poll(100):
                if sock is self._router:
                    if self._receive(self._router.recv_multipart(copy=False)):
                        with contextlib.suppress(zmq.Again):  # a ring is already waiting to be heard
                            ring.send(b"", zmq.NOBLOCK)
                else:
                    self._forward(self._pull.recv_multipart(copy=False))
        ring.close()
        self._router.close()
        self._pull.close()

    def _receive(self, parts: list) -> bool:
        """Answer, deliver or queue one incoming message; True if it went into the inbox."""
        counters = self.component.counters
        if len(parts) < 2:
            counters["dropped_frames"] += 1
            return False
        identity, body = parts[0], parts[1:]
        try:
            message, frames = m.decode(body, self.kinds, self.limits)
        except m.MessageError as e:
            counters["bad_messages"] += 1
            self._forward([identity, *m.encode(m.error_reply(0, e.code, self.component.name, str(e)))])
            return False
        if isinstance(message, m.Ping):
            self._forward([identity, *m.encode(self._pong(message.request_id))])
            return False
        if m.KIND_OF[type(message)] in self.component.early:
            try:
                self.component.deliver(message, frames)
            except Exception:  # noqa: BLE001 - one bad delivery must not stop the I/O thread
                counters["bad_deliveries"] += 1
            return False
        counters["requests"] += 1
        self.inbox.put((identity, message, frames))
        return True

    def _pong(self, request_id: int) -> m.Pong:
        counters = {k: int(v) for k, v in self.component.counters.items()}
        return m.Pong(request_id=request_id, component=self.component.name, pid=os.getpid(),
                      uptime_s=time.monotonic() - self._started, counters=counters)

    def _forward(self, parts: list) -> None:
        try:
            self._router.send_multipart(parts, copy=False, flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # the peer is gone (ROUTER_MANDATORY) or not reading: its loss alone
            self.component.counters["unroutable_replies"] += 1

    # --- compute loop ----------------------------------------------------------------------------
    def run(self) -> None:
        """The compute loop, until `stop()`; closes the component on the way out."""
        self._ran = True
        push = self.ctx.socket(zmq.PUSH)
        push.setsockopt(zmq.LINGER, LINGER_MS)
        push.connect(self._out_endpoint)
        try:
            while not self.stop_event.is_set():
                busy = self.component.tick()
                try:
                    identity, message, frames = self.inbox.get(timeout=0 if busy else 0.05)
                except queue.Empty:
                    continue
                self._dispatch(push, identity, message, frames)
        finally:
            push.close()
            self._bell.close()
            self.component.close()

    def _dispatch(self, push: zmq.Socket, identity, message: m.Message, frames: list[memoryview]) -> None:
        if m.KIND_OF[type(message)] in self.component.routed and message.reply_to:
            identity = message.reply_to  # unknown to the ROUTER: dropped and counted (`unroutable_replies`)

        def reply(answer: m.Message, out: m.Frames | None = None) -> None:
            parts = [identity, *m.encode(answer, out)]
            while True:
                try:
                    push.send_multipart(parts, copy=False, flags=zmq.NOBLOCK)
                    return
                except zmq.Again:  # forwarding is behind, or the I/O thread has stopped and never will
                    if self.stop_event.is_set():
                        return
                    push.poll(100, zmq.POLLOUT)

        try:
            self.component.handle(message, frames, reply)
        except Exception as e:  # noqa: BLE001 - a failing request fails alone
            reply(m.error_reply(m.request_id_of(message), *self.component.error_fields(e)))

    def stop(self) -> None:
        self.stop_event.set()

    def join(self, timeout: float = 5.0) -> None:
        self._io.join(timeout)
        if not self._ran:  # the compute loop closes its end of the bell; it never ran
            self._bell.close()
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if self._curve is not None:
            self._curve.stop()
            self._curve = None


_MONITORS = itertools.count()  # each Peer's monitor endpoint


class Peer:
    """Calls to one component, from one thread: request/reply with a deadline, or a stream."""

    def __init__(self, endpoint: str, name: str, keys_dir: Path | None = None, timeout_s: float = 600.0,
                 ctx: zmq.Context | None = None, limits: m.Limits = m.DEFAULT_LIMITS, routing_id: bytes | None = None):
        self.name, self.endpoint, self.timeout_s, self.limits = name, endpoint, timeout_s, limits
        self.routing_id = routing_id
        self.ctx = ctx or zmq.Context.instance()
        self.monitor: zmq.Socket | None = None
        try:
            self.sock = make_socket(self.ctx, zmq.DEALER, endpoint, bind=False, keys_dir=keys_dir,
                                    max_bytes=limits.replies_of(name), routing_id=routing_id,
                                    prepare=None if endpoint.startswith("inproc://") else self._watch)
        except BaseException:
            if self.monitor is not None:
                self.monitor.close(0)
            raise
        self.sock.setsockopt(zmq.SNDTIMEO, 1000)
        # whether the component holds this connection now (its handshake done, no disconnect since):
        # an inproc connection is there from the start and has no monitor
        self.connected = self.monitor is None
        self._pollers: dict[tuple[int, ...], zmq.Poller] = {}

    def _watch(self, sock: zmq.Socket) -> None:
        """Monitor the connection's handshakes and disconnects, from before it connects. The monitor
        gets a name of its own: pyzmq's default (from the socket's fd) can still be bound by a closed
        peer's monitor, which libzmq takes down in the background, when a new peer reuses the fd."""
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED,
                                               f"inproc://dsv41-monitor-{os.getpid()}-{next(_MONITORS)}")

    def send(self, message: m.Message, frames: m.Frames | None = None) -> None:
        """Send without waiting for a reply. A message that cannot be encoded, or is over its kind's
        limit (the component would drop the connection), fails here as a ComponentError."""
        self._drain_monitor()
        try:
            parts = m.encode(message, frames)
            self.limits.check(m.KIND_OF[type(message)], m.encoded_size(parts))
        except m.MessageError as e:
            raise ComponentError(e.code, self.name, str(e)) from None
        try:
            self.sock.send_multipart(parts, copy=False)
        except zmq.Again:
            raise ComponentError(m.ErrorCode.UNAVAILABLE, self.name,
                                 f"not reachable at {self.endpoint} (no connection within 1 s)") from None

    def call(self, message: m.Message, frames: m.Frames | None = None,
             timeout_s: float | None = None) -> tuple[m.Message, list[memoryview]]:
        self.send(message, frames)
        return self.receive(message.request_id, timeout_s)

    def receive(self, request_id: int, timeout_s: float | None = None) -> tuple[m.Message, list[memoryview]]:
        """The next reply to request_id; raises ComponentError for an Error reply, a disconnect or
        the deadline. Replies to other (earlier, abandoned) requests are dropped."""
        deadline = time.monotonic() + (timeout_s or self.timeout_s)
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.monitor is not None:
            poller.register(self.monitor, zmq.POLLIN)
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(min(left, 1.0) * 1000))
            if self.monitor is not None and self.monitor in ready and self._drain_monitor():
                raise ComponentError(m.ErrorCode.UNAVAILABLE, self.name, "disconnected while answering "
                                     "(the component died or restarted)")
            if self.sock in ready:
                reply = self._take(request_id)
                if reply is not None:
                    return reply
        raise ComponentError(m.ErrorCode.UNAVAILABLE, self.name,
                             f"no reply within {timeout_s or self.timeout_s:.1f} s")

    def receive_any(self, timeout_s: float, wake: zmq.Socket | None = None,
                    also: tuple[Peer, ...] = ()) -> tuple[m.Message, list[memoryview]] | None:
        """The next reply to any request, from this peer or those `also` named (an `Error` is
        returned, not raised), or None when none comes within timeout_s or `wake` becomes readable
        first (its messages are consumed); raises ComponentError, naming the peer, when one of them
        disconnects or sends garbage. For a caller with several requests in flight (a scheduler's
        prefills and steps, whose replies may come straight from a component further on)."""
        peers = (self, *also)
        ready = dict(self._poller(wake, also).poll(max(0.0, timeout_s) * 1000))
        if wake is not None and wake in ready:
            while wake.poll(0):
                wake.recv()
        for peer in peers:
            if peer.monitor is not None and peer.monitor in ready and peer._drain_monitor():
                raise ComponentError(m.ErrorCode.UNAVAILABLE, peer.name, "disconnected while answering "
                                     "(the component died or restarted)")
        for peer in peers:
            if peer.sock in ready:
                try:
                    return m.decode(peer.sock.recv_multipart(copy=False), limits=peer.limits)
                except m.MessageError as e:
                    raise ComponentError(e.code, peer.name, f"sent an unreadable reply: {e}") from None
        return None

    def _poller(self, wake: zmq.Socket | None, also: tuple[Peer, ...] = ()) -> zmq.Poller:
        """A poller of the reply sockets and disconnect monitors of this peer and `also`, and of
        `wake`, kept per combination."""
        key = (id(wake), *map(id, also))
        poller = self._pollers.get(key)
        if poller is None:
            poller = self._pollers[key] = zmq.Poller()
            for sock in (self.sock, self.monitor, wake, *(s for p in also for s in (p.sock, p.monitor))):
                if sock is not None:
                    poller.register(sock, zmq.POLLIN)
        return poller

    def _take(self, request_id: int):
        try:
            message, frames = m.decode(self.sock.recv_multipart(copy=False), limits=self.limits)
        except m.MessageError as e:
            raise ComponentError(e.code, self.name, f"sent an unreadable reply: {e}") from None
        if isinstance(message, m.Error) and message.request_id in (request_id, 0):
            raise ComponentError(message.code, message.component, message.text)
        return (message, frames) if m.request_id_of(message) == request_id else None

    def stream(self, message: m.Message, timeout_s: float | None = None,
               frames: m.Frames | None = None) -> Iterator[m.Message]:
        """Replies to one request until a `Finished` (inclusive)."""
        self.send(message, frames)
        while True:
            reply, _ = self.receive(message.request_id, timeout_s)
            yield reply
            if isinstance(reply, m.Finished):
                return

    def _drain_monitor(self) -> bool:
        """Consume pending monitor events (keeping `connected` up to date); True if the peer
        disconnected."""
        if self.monitor is None:
            return False
        gone = False
        while self.monitor.poll(0):
            event = parse_monitor_message(self.monitor.recv_multipart())["event"]
            gone |= event == zmq.EVENT_DISCONNECTED
            self.connected = event == zmq.EVENT_HANDSHAKE_SUCCEEDED
        return gone

    def check_connection(self) -> bool:
        """Whether the component holds this connection now (its ROUTER can route to `routing_id`);
        raises ComponentError when it disconnected since last asked (what was in flight is lost)."""
        if self._drain_monitor():
            raise ComponentError(m.ErrorCode.UNAVAILABLE, self.name, "disconnected (the component died or restarted)")
        return self.connected

    def ping(self, timeout_s: float = 2.0) -> m.Pong:
        pong, _ = self.call(m.Ping(request_id=new_request_id()), timeout_s=timeout_s)
        return pong

    def close(self) -> None:
        if self.sock.closed:
            return
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(0)
        self.sock.close(0)
