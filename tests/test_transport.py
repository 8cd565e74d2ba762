"""The component runtime over real ZeroMQ sockets: garbage and oversized input, failing requests,
dead and restarted peers, deadlines, shutdown, endpoint hijack and exposure (RELIABILITY 7.3)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from dsv41 import messages as m
from dsv41.components.runtime import (
    IPC_PATH_LIMIT,
    Component,
    ComponentError,
    EndpointInUse,
    Peer,
    Server,
    check_endpoint,
    make_socket,
)
from dsv41.components.security import SecurityError

WAIT_MS = 10_000  # generous bound for a reply that must come; a hang fails the test, never a slow reply
TRANSPORTS = ["ipc", "inproc"]
ROOT = Path(__file__).resolve().parents[1]


class Echo(Component):
    """Tokenize -> Tokens of the text's UTF-8 bytes; a few texts fail or block on purpose."""

    name = "echo"
    accepts = frozenset({m.KIND.TOKENIZE})

    def __init__(self):
        super().__init__()
        self.entered, self.release, self.closed = threading.Event(), threading.Event(), threading.Event()

    def handle(self, message, frames, reply):
        if message.text == "boom":
            raise KeyError("boom")
        if message.text == "odd ids":
            m.unpack_ids(b"abc")
        if message.text == "upstream":
            raise ComponentError(m.ErrorCode.UNAVAILABLE, "kvstore", "kvstore went away")
        if message.text == "hold":
            self.entered.set()
            assert self.release.wait(20), "the test never released the held request"
        reply(m.Tokens(request_id=message.request_id, ids=m.pack_ids(list(message.text.encode()))))

    def close(self):
        self.closed.set()


class Served:
    """A Server with its compute loop on a daemon thread."""

    def __init__(self, endpoint: str, component: Echo | None = None, ctx: zmq.Context | None = None,
                 limits: m.Limits = m.DEFAULT_LIMITS):
        self.component = component or Echo()
        self.server = Server(self.component, endpoint, ctx=ctx, limits=limits)
        self.thread = threading.Thread(target=self.server.run, name="echo-compute", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.stop()
        self.server.join()
        self.component.release.set()
        self.thread.join(10)
        assert not self.thread.is_alive(), "the compute loop did not stop"
        assert self.component.closed.is_set()


class Net:
    """Servers, peers and raw sockets of one test, all closed (linger 0) and stopped at teardown."""

    def __init__(self, root: Path):
        self.root = root
        self.servers: list[Served] = []
        self.sockets: list[zmq.Socket] = []
        self.peers: list[Peer] = []

    def endpoint(self, transport: str, name: str = "echo") -> str:
        if transport == "ipc":
            return f"ipc://{self.root}/{name}.sock"
        return f"inproc://test-{name}-{uuid.uuid4().hex[:8]}"

    def serve(self, endpoint: str, component: Echo | None = None, ctx: zmq.Context | None = None,
              limits: m.Limits = m.DEFAULT_LIMITS) -> Served:
        served = Served(endpoint, component, ctx, limits)
        self.servers.append(served)
        return served

    def peer(self, endpoint: str, timeout_s: float = 30.0, ctx: zmq.Context | None = None) -> Peer:
        peer = Peer(endpoint, "echo", timeout_s=timeout_s, ctx=ctx)
        self.peers.append(peer)
        return peer

    def raw(self, kind: int, endpoint: str, bind: bool = False, ctx: zmq.Context | None = None) -> zmq.Socket:
        sock = (ctx or zmq.Context.instance()).socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.sockets.append(sock)
        sock.bind(endpoint) if bind else sock.connect(endpoint)
        return sock

    def drop(self, peer: Peer) -> None:
        """Close one peer now, as a caller that dies does."""
        self.peers.remove(peer)
        peer.close()

    def close(self) -> None:
        while self.peers:
            self.peers.pop().close()
        while self.sockets:
            self.sockets.pop().close(0)
        while self.servers:
            served = self.servers.pop()
            if not served.server.stop_event.is_set():
                served.stop()


@pytest.fixture
def net() -> Iterator[Net]:
    root = Path(tempfile.mkdtemp(prefix="dsv41-", dir="/tmp"))
    network = Net(root)
    try:
        yield network
    finally:
        try:
            network.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)


def _receive(sock: zmq.Socket) -> list[bytes]:
    assert sock.poll(WAIT_MS), "no reply"
    return sock.recv_multipart()


def _tokenize(text: str, request_id: int = 1) -> list[bytes]:
    return [bytes(p) for p in m.encode(m.Tokenize(request_id=request_id, text=text))]


def _echo_call(peer: Peer, text: str, request_id: int) -> list[int]:
    reply, frames = peer.call(m.Tokenize(request_id=request_id, text=text))
    assert reply == m.Tokens(request_id=request_id, ids=m.pack_ids(list(text.encode())))
    assert frames == []
    return m.unpack_ids(reply.ids)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- garbage in, errors out (T1) ------------------------------------------------------------------

TOKENIZE = bytes([m.KIND.TOKENIZE])
_noise = random.Random(41)
GARBAGE = [
    ("random body", [TOKENIZE, b"\xc1" + _noise.randbytes(40)], m.ErrorCode.MALFORMED, "malformed Tokenize"),
    ("random frames", [b"\xee\x01", _noise.randbytes(33), _noise.randbytes(7)], m.ErrorCode.MALFORMED,
     "unknown message kind"),
    ("truncated", [TOKENIZE, _tokenize("truncated")[1][:-3]], m.ErrorCode.MALFORMED, "Input data was truncated"),
    ("unknown kind", [b"\xee", _tokenize("x")[1]], m.ErrorCode.MALFORMED, "unknown message kind frame"),
    ("not accepted", [bytes([m.KIND.DETOKENIZE]), msgspec.msgpack.encode([1, b"", 1])], m.ErrorCode.UNEXPECTED,
     "does not take Detokenize messages"),
    ("invalid utf-8", [TOKENIZE, _tokenize("abc")[1].replace(b"abc", b"\xff\xfe\xfd")], m.ErrorCode.MALFORMED,
     "utf-8"),
    ("one frame", [TOKENIZE], m.ErrorCode.MALFORMED, "got 1"),
    ("70 frames", [TOKENIZE, _tokenize("x")[1], *[b"f"] * 68], m.ErrorCode.MALFORMED, "got 70"),
    ("deep nesting", [TOKENIZE, b"\x91" * 5000 + b"\xc0"], m.ErrorCode.MALFORMED, "malformed Tokenize"),
    ("extra frame", [*_tokenize("x"), b"tensor"], m.ErrorCode.BAD_TENSOR, "describes frames [] but carries 1"),
    ("version 2", [TOKENIZE, msgspec.msgpack.encode(m.Tokenize(request_id=1, text="x", version=2))],
     m.ErrorCode.VERSION, "protocol version 2"),
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_garbage_gets_error_replies_and_the_server_keeps_serving(net, transport):
    endpoint = net.endpoint(transport)
    net.serve(endpoint)
    peer = net.peer(endpoint)
    assert _echo_call(peer, "before", 1) == list(b"before")
    raw = net.raw(zmq.DEALER, endpoint)
    for what, parts, code, text in GARBAGE:
        raw.send_multipart(parts)
        reply, frames = m.decode(_receive(raw))
        assert isinstance(reply, m.Error), what
        assert (reply.code, reply.request_id, reply.component, frames) == (code, 0, "echo", []), what
        assert text.lower() in reply.text.lower(), f"{what}: {reply.text}"
    assert _echo_call(peer, "after", 2) == list(b"after")
    raw.send_multipart(_tokenize("raw after", 3))
    assert m.decode(_receive(raw))[0] == m.Tokens(request_id=3, ids=m.pack_ids(list(b"raw after")))
    counters = peer.ping(timeout_s=10).counters
    assert counters["bad_messages"] == len(GARBAGE)
    assert counters["requests"] == 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_failing_request_fails_alone(net, transport):
    endpoint = net.endpoint(transport)
    net.serve(endpoint)
    peer = net.peer(endpoint)
    failures = [("boom", m.ErrorCode.INTERNAL, "echo", "KeyError: 'boom'"),
                ("odd ids", m.ErrorCode.MALFORMED, "echo", "token id bytes must be a multiple of 4, got 3"),
                ("upstream", m.ErrorCode.UNAVAILABLE, "kvstore", "kvstore went away")]
    for request_id, (text, code, component, detail) in enumerate(failures, 1):
        with pytest.raises(ComponentError) as info:
            peer.call(m.Tokenize(request_id=request_id, text=text))
        assert (info.value.code, info.value.component, info.value.text) == (code, component, detail)
        assert _echo_call(peer, f"next {request_id}", 100 + request_id) == list(f"next {request_id}".encode())
    counters = peer.ping(timeout_s=10).counters
    assert (counters["internal_errors"], counters["requests"], counters.get("bad_messages", 0)) == (1, 6, 0)


# --- oversized messages (T2) ----------------------------------------------------------------------

@pytest.mark.timeout(30)
def test_make_socket_sets_the_limits():
    ctx = zmq.Context.instance()
    for kind in (zmq.ROUTER, zmq.DEALER):
        sock = make_socket(ctx, kind, f"inproc://limits-{uuid.uuid4().hex[:8]}", bind=kind == zmq.ROUTER)
        try:
            assert sock.getsockopt(zmq.MAXMSGSIZE) == m.DEFAULT_MAX_BYTES
            assert sock.getsockopt(zmq.LINGER) == 200
            if kind == zmq.DEALER:
                assert sock.getsockopt(zmq.IMMEDIATE) == 1
            else:  # ROUTER_MANDATORY: a reply to a peer that is gone raises instead of vanishing
                with pytest.raises(zmq.ZMQError) as e:
                    sock.send_multipart([b"nobody", b"reply"], flags=zmq.NOBLOCK)
                assert e.value.errno == zmq.EHOSTUNREACH
        finally:
            sock.close(0)


@pytest.mark.timeout(30)
def test_oversized_message_drops_its_connection_only(net):
    endpoint = net.endpoint("ipc")
    net.serve(endpoint, limits=m.Limits.flat(4096))
    peer = net.peer(endpoint)
    assert _echo_call(peer, "hello", 1) == list(b"hello")
    raw = net.raw(zmq.DEALER, endpoint)
    monitor = raw.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        raw.send_multipart(_tokenize("x" * 10_000, 2))
        assert monitor.poll(WAIT_MS), "the oversized sender was not disconnected"
        assert parse_monitor_message(monitor.recv_multipart())["event"] == zmq.EVENT_DISCONNECTED
    finally:
        raw.disable_monitor()
        monitor.close(0)
    assert _echo_call(peer, "unaffected", 3) == list(b"unaffected")
    raw.send_multipart(_tokenize("small", 4))  # the first reply the raw socket ever gets: none for the big one
    assert m.decode(_receive(raw))[0] == m.Tokens(request_id=4, ids=m.pack_ids(list(b"small")))
    counters = peer.ping(timeout_s=10).counters
    assert (counters["requests"], counters.get("bad_messages", 0)) == (3, 0)


# --- dead, stopped and restarted peers (T4, T6) ---------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_stopped_server_fails_the_waiting_call_then_a_restart_serves(net, transport):
    """ipc: the peer's monitor reports the disconnect; inproc has no such events, so the deadline answers."""
    endpoint = net.endpoint(transport)
    first = net.serve(endpoint)
    peer = net.peer(endpoint, timeout_s=30.0 if transport == "ipc" else 1.0)
    peer.send(m.Tokenize(request_id=1, text="hold"))
    assert first.component.entered.wait(10)
    first.stop()
    with pytest.raises(ComponentError) as info:
        peer.receive(1)
    assert (info.value.code, info.value.component) == (m.ErrorCode.UNAVAILABLE, "echo")
    expected = "disconnected while answering" if transport == "ipc" else "no reply within 1.0 s"
    assert expected in info.value.text
    net.serve(endpoint)
    again = peer if transport == "ipc" else net.peer(endpoint)  # an inproc connect does not outlive its binder
    assert _echo_call(again, "restarted", 2) == list(b"restarted")


CHILD = """
import sys, time
from dsv41 import messages as m
from dsv41.components.runtime import Component, Server

class Stuck(Component):
    name = "echo"
    accepts = frozenset({m.KIND.TOKENIZE})

    def handle(self, message, frames, reply):
        print("busy", flush=True)
        time.sleep(120)

server = Server(Stuck(), sys.argv[1])
print("ready", flush=True)
server.run()
"""


@pytest.fixture
def child(net) -> Iterator[tuple[subprocess.Popen, str]]:
    endpoint = net.endpoint("ipc", "killed")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, endpoint], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        yield proc, endpoint
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


@pytest.mark.timeout(30)
def test_killed_server_process_fails_the_call_and_its_endpoint_is_reusable(net, child):
    proc, endpoint = child
    assert proc.stdout.readline() == "ready\n"
    peer = net.peer(endpoint, timeout_s=30.0)
    peer.send(m.Tokenize(request_id=1, text="never answered"))
    assert proc.stdout.readline() == "busy\n"
    os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    with pytest.raises(ComponentError) as info:
        peer.receive(1)
    assert (info.value.code, info.value.component) == (m.ErrorCode.UNAVAILABLE, "echo")
    assert "disconnected while answering" in info.value.text
    path = Path(endpoint.removeprefix("ipc://"))
    assert path.exists() and Path(f"{path}.lock").exists()  # left behind by the killed process
    net.serve(endpoint)
    assert _echo_call(peer, "after the kill", 2) == list(b"after the kill")  # the same peer reconnects


@pytest.mark.timeout(30)
def test_a_frozen_tcp_peer_is_dropped_by_heartbeats(net):
    with socket.socket() as probe:  # a free loopback port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-c", CHILD, endpoint], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        peer = net.peer(endpoint, timeout_s=25.0)
        assert peer.ping(timeout_s=10).component == "echo"
        os.killpg(proc.pid, signal.SIGSTOP)  # frozen: the connection stays open, nothing answers
        peer.send(m.Tokenize(request_id=1, text="never answered"))
        with pytest.raises(ComponentError) as info:
            peer.receive(1)
        assert "disconnected while answering" in info.value.text  # the heartbeat, well before the deadline
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()


# --- deadlines ------------------------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_call_to_nobody_is_unavailable(net, transport):
    """ipc: the send finds no connection; inproc queues it for a later binder, and the deadline answers."""
    endpoint = net.endpoint(transport, "nobody")
    peer = net.peer(endpoint, timeout_s=0.5)
    with pytest.raises(ComponentError) as info:
        peer.call(m.Tokenize(request_id=1, text="anyone?"))
    assert (info.value.code, info.value.component) == (m.ErrorCode.UNAVAILABLE, "echo")
    expected = f"not reachable at {endpoint} (no connection within 1 s)" if transport == "ipc" else \
        "no reply within 0.5 s"
    assert info.value.text == expected


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_call_to_a_silent_server_hits_its_deadline(net, transport):
    endpoint = net.endpoint(transport, "silent")
    silent = net.raw(zmq.ROUTER, endpoint, bind=True)
    peer = net.peer(endpoint, timeout_s=30.0)
    with pytest.raises(ComponentError) as info:
        peer.call(m.Tokenize(request_id=1, text="hello?"), timeout_s=0.3)
    assert (info.value.code, info.value.text) == (m.ErrorCode.UNAVAILABLE, "no reply within 0.3 s")
    assert m.decode(silent.recv_multipart(zmq.NOBLOCK)[1:])[0] == m.Tokenize(request_id=1, text="hello?")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_replies_to_abandoned_requests_are_skipped(net, transport):
    endpoint = net.endpoint(transport)
    served = net.serve(endpoint)
    peer = net.peer(endpoint, timeout_s=0.3)
    peer.send(m.Tokenize(request_id=1, text="hold"))
    assert served.component.entered.wait(10)
    with pytest.raises(ComponentError, match="no reply within 0.3 s"):
        peer.receive(1)
    served.component.release.set()
    peer.timeout_s = 30.0
    assert _echo_call(peer, "fresh", 2) == list(b"fresh")  # the late reply to 1 arrives first and is dropped


# --- replies routed past a relay ------------------------------------------------------------------

class Stepper(Echo):
    """BatchStep -> an empty BatchLogits; items of request 0 fail. `routed`: whether a BatchStep's
    reply goes where its reply_to says."""

    accepts = frozenset({m.KIND.TOKENIZE, m.KIND.BATCH_STEP})

    def __init__(self, routed: bool):
        super().__init__()
        self.routed = frozenset({m.KIND.BATCH_STEP}) if routed else frozenset()

    def handle(self, message, frames, reply):
        if not isinstance(message, m.BatchStep):
            return super().handle(message, frames, reply)
        if message.items[0].request_id == 0:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, "request 0 cannot step")
        out = m.Frames()
        reply(m.BatchLogits(request_id=message.request_id, request_ids=[], sizes=[],
                            logits=out.add(torch.empty(0))), out)


def _step(request_id: int, item: int, reply_to: bytes) -> m.BatchStep:
    return m.BatchStep(request_id=request_id, items=[m.StepItem(request_id=item, ids=m.pack_ids([1]))],
                       reply_to=reply_to)


def _connected(peer: Peer) -> None:
    deadline = time.monotonic() + WAIT_MS / 1000
    while not peer.check_connection():
        assert time.monotonic() < deadline, "the handshake never completed"
        time.sleep(0.01)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_routed_reply_goes_to_the_connection_reply_to_names(net, transport):
    endpoint = net.endpoint(transport)
    served = net.serve(endpoint, Stepper(routed=True))
    relay = net.peer(endpoint)
    asker = Peer(endpoint, "echo", timeout_s=30.0, routing_id=b"asker-1")
    net.peers.append(asker)
    _connected(asker)
    relay.send(_step(11, 5, b"asker-1"))
    assert asker.sock.poll(WAIT_MS) and not relay.sock.poll(0)  # the reply is on the asker's connection
    reply, _ = relay.receive_any(WAIT_MS / 1000, also=(asker,))  # which a wait on both takes
    assert (type(reply), reply.request_id) == (m.BatchLogits, 11)
    relay.send(_step(12, 0, b"asker-1"))  # a failing request's error goes there too
    with pytest.raises(ComponentError, match="request 0 cannot step"):
        asker.receive(12, timeout_s=WAIT_MS / 1000)
    relay.send(_step(13, 5, b"nobody"))  # a route the server does not hold: dropped and counted
    relay.send(_step(14, 5, b""))  # no route: answered on its own connection
    assert relay.receive(14, timeout_s=WAIT_MS / 1000)[0].request_id == 14
    assert not relay.sock.poll(100) and not asker.sock.poll(100)
    assert relay.ping(timeout_s=10).counters["unroutable_replies"] == 1
    assert _echo_call(relay, "still serving", 15) == list(b"still serving")
    assert served.server.component.counters["requests"] == 5


@pytest.mark.timeout(30)
def test_a_kind_not_routed_is_answered_on_its_own_connection(net):
    endpoint = net.endpoint("ipc")
    net.serve(endpoint, Stepper(routed=False))
    relay = net.peer(endpoint)
    asker = Peer(endpoint, "echo", timeout_s=30.0, routing_id=b"asker-2")
    net.peers.append(asker)
    _connected(asker)
    relay.send(_step(21, 5, b"asker-2"))
    assert relay.receive(21, timeout_s=WAIT_MS / 1000)[0].request_id == 21
    assert not asker.sock.poll(100)


@pytest.mark.timeout(30)
def test_a_peer_reports_its_connection_and_its_loss_once(net):
    endpoint = net.endpoint("ipc")
    asker = Peer(endpoint, "echo", timeout_s=30.0, routing_id=b"asker-3")
    net.peers.append(asker)
    assert not asker.check_connection()  # nobody listens yet
    served = net.serve(endpoint, Stepper(routed=True))
    _connected(asker)
    served.stop()
    deadline = time.monotonic() + WAIT_MS / 1000
    with pytest.raises(ComponentError, match="disconnected") as info:  # noqa: PT012 - waits for the event
        while time.monotonic() < deadline:
            asker.check_connection()
            time.sleep(0.01)
    assert info.value.code == m.ErrorCode.UNAVAILABLE
    assert not asker.check_connection()  # reported once; no connection now


@pytest.mark.timeout(30)
def test_waiting_on_two_peers_reports_which_one_was_lost(net):
    first, second = net.endpoint("ipc", "first"), net.endpoint("ipc", "second")
    net.serve(first)
    served = net.serve(second, Stepper(routed=True))
    waiter = net.peer(first)
    lost = Peer(second, "second", timeout_s=30.0)
    net.peers.append(lost)
    _connected(lost)
    served.stop()
    with pytest.raises(ComponentError) as info:
        while True:  # (the timeout mark bounds the wait for the disconnect event)
            waiter.receive_any(0.1, also=(lost,))
    assert (info.value.code, info.value.component) == (m.ErrorCode.UNAVAILABLE, "second")


# --- shutdown with dead peers (T7) ----------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_shutdown_with_queued_messages_and_dead_peers_terminates(net, transport):
    ctx = zmq.Context()
    try:
        sink_endpoint = net.endpoint(transport, "sink")
        sink = net.raw(zmq.ROUTER, sink_endpoint, bind=True, ctx=ctx)
        queued = net.peer(sink_endpoint, ctx=ctx)
        for request_id in range(200):
            queued.send(m.Tokenize(request_id=request_id, text="never read " * 20))
        net.drop(queued)
        sink.close(0)

        endpoint = net.endpoint(transport)
        served = net.serve(endpoint, ctx=ctx)
        dying = net.peer(endpoint, ctx=ctx)
        dying.send(m.Tokenize(request_id=1, text="hold"))
        for request_id in range(2, 50):
            dying.send(m.Tokenize(request_id=request_id, text="queued behind the held one"))
        assert served.component.entered.wait(10)
        assert dying.ping(timeout_s=10).counters["requests"] == 49  # all 49 wait in the server's queue
        net.drop(dying)  # the caller dies with its requests in flight
        served.component.release.set()
        witness = net.peer(endpoint, ctx=ctx)
        assert _echo_call(witness, "still serving", 100) == list(b"still serving")
        assert witness.ping(timeout_s=10).counters["requests"] == 50
        served.stop()
    finally:
        net.close()
        ctx.term()  # hangs, and the test times out, if any socket of the context is still open


@pytest.mark.timeout(30)
def test_stop_during_a_request_lets_the_compute_loop_finish(net):
    """The reply of a request that outlives stop() is dropped, not sent into the closed I/O thread forever."""
    ctx = zmq.Context()
    try:
        endpoint = net.endpoint("ipc")
        served = net.serve(endpoint, ctx=ctx)
        peer = net.peer(endpoint, ctx=ctx)
        peer.send(m.Tokenize(request_id=1, text="hold"))
        assert served.component.entered.wait(10)
        served.server.stop()
        served.server.join()
        served.component.release.set()
        served.thread.join(10)
        assert not served.thread.is_alive()
        assert served.component.closed.is_set()
    finally:
        net.close()
        ctx.term()


# --- ping while the compute loop is busy ----------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_ping_is_answered_while_a_request_computes(net, transport):
    endpoint = net.endpoint(transport)
    served = net.serve(endpoint)
    peer = net.peer(endpoint)
    peer.send(m.Tokenize(request_id=1, text="hold"))
    assert served.component.entered.wait(10)
    pong = peer.ping(timeout_s=10)
    assert not served.component.release.is_set()  # the handler is still blocked: the I/O thread answered
    assert (pong.component, pong.pid, pong.counters["requests"]) == ("echo", os.getpid(), 1)
    served.component.release.set()
    reply, _ = peer.receive(1)
    assert reply == m.Tokens(request_id=1, ids=m.pack_ids(list(b"hold")))


# --- ipc hijack and path length (T8) --------------------------------------------------------------

@pytest.mark.timeout(30)
def test_second_bind_of_an_ipc_path_is_refused(net):
    endpoint = net.endpoint("ipc")
    first = net.serve(endpoint)
    with pytest.raises(EndpointInUse, match="is bound by another running process"):
        Server(Echo(), endpoint)
    peer = net.peer(endpoint)
    assert peer.ping(timeout_s=10).pid == os.getpid()
    assert _echo_call(peer, "first", 1) == list(b"first")
    first.stop()
    path = Path(endpoint.removeprefix("ipc://"))
    assert not path.exists() and not Path(f"{path}.lock").exists()
    path.write_bytes(b"stale")  # a leftover file where the socket goes
    net.serve(endpoint)
    assert _echo_call(net.peer(endpoint), "second", 2) == list(b"second")


@pytest.mark.timeout(30)
def test_ipc_paths_over_the_limit_are_refused(net):
    fits = f"{net.root}/" + "a" * (IPC_PATH_LIMIT - len(f"{net.root}/"))
    assert len(fits) == IPC_PATH_LIMIT
    check_endpoint(f"ipc://{fits}")
    ctx = zmq.Context.instance()
    attempts = [check_endpoint, lambda e: make_socket(ctx, zmq.DEALER, e, bind=False),
                lambda e: make_socket(ctx, zmq.ROUTER, e, bind=True), lambda e: Server(Echo(), e),
                lambda e: Peer(e, "echo")]
    for path in (fits + "a", f"{net.root}/" + "\u00e9" * 60):  # the second is short in characters, long in bytes
        message = f"socket path is {len(path.encode())} bytes; Unix sockets allow at most {IPC_PATH_LIMIT}"
        for attempt in attempts:
            with pytest.raises(ValueError) as info:
                attempt(f"ipc://{path}")
            assert message in str(info.value)
    assert list(net.root.iterdir()) == []


# --- tcp exposure (T9) ----------------------------------------------------------------------------

class RecordingContext(zmq.Context):
    made: list

    def socket(self, *args, **kwargs):
        sock = super().socket(*args, **kwargs)
        self.made = [*getattr(self, "made", []), sock]
        return sock


@pytest.mark.timeout(30)
@pytest.mark.parametrize("host", ["0.0.0.0", "*", "192.0.2.1"])
def test_tcp_bind_beyond_loopback_without_keys_is_refused(host):
    ctx = RecordingContext()
    try:
        endpoint = f"tcp://{host}:{_free_port()}"
        with pytest.raises(SecurityError) as info:
            make_socket(ctx, zmq.ROUTER, endpoint, bind=True)
        assert "without CURVE keys is refused" in str(info.value) and "dsv41 keys" in str(info.value)
        with pytest.raises(SecurityError, match="dsv41 keys"):
            Server(Echo(), endpoint, ctx=ctx)
        assert len(ctx.made) == 2 and all(sock.closed for sock in ctx.made)
    finally:
        ctx.term()  # would hang on a socket left open by the refused bind


@pytest.mark.timeout(30)
def test_tcp_loopback_serves_without_keys(net):
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    net.serve(endpoint)
    assert _echo_call(net.peer(endpoint), "over tcp", 1) == list(b"over tcp")


@pytest.mark.timeout(30)
def test_port_scanner_traffic_is_dropped_and_the_server_keeps_serving(net):
    """Raw TCP to a component's port (T12): a bare connect, an HTTP request, random bytes and a
    ZMTP-looking greeting cut short. Each connection is dropped by the server; the process stays up and
    a real peer is served before, between and after."""
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    net.serve(endpoint)
    peer = net.peer(endpoint)
    assert _echo_call(peer, "before", 1) == list(b"before")
    port = int(endpoint.rsplit(":", 1)[1])
    noise = random.Random(12)
    probes = [b"", b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", noise.randbytes(4096),
              b"\xff" + bytes(8) + b"\x7f\x03\x00NULL", b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03"]
    for i, probe in enumerate(probes):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(probe)
            raw.shutdown(socket.SHUT_WR)
            raw.settimeout(5)
            try:
                while raw.recv(4096):  # at most ZMTP's greeting comes back, then the server hangs up
                    pass
            except ConnectionResetError:
                pass
        assert _echo_call(peer, f"after probe {i}", 10 + i) == list(f"after probe {i}".encode())
    counters = peer.ping(timeout_s=10).counters
    assert counters["requests"] == 1 + len(probes)


@pytest.mark.timeout(60)
def test_a_peer_that_stops_reading_loses_only_its_own_replies(net):
    """A slow consumer (T5): a peer sends 3,000 requests with 16 KB replies and reads none. The server's
    queue to it holds at most its high-water mark; beyond it the replies to that peer are dropped and
    counted (ROUTER_MANDATORY makes the send fail instead of blocking the server or growing without
    bound), while another peer is served as usual. The slow peer later reads every reply that was not
    counted as dropped, intact."""
    endpoint = net.endpoint("ipc")
    net.serve(endpoint)
    peer = net.peer(endpoint)
    slow = net.raw(zmq.DEALER, endpoint)
    text = "x" * 4000
    for i in range(3000):
        slow.send_multipart(_tokenize(text, 100_000 + i))
    assert _echo_call(peer, "still served", 1) == list(b"still served")
    deadline = time.monotonic() + 30
    while (counters := peer.ping(timeout_s=10).counters)["requests"] < 3001:  # every request was received
        assert time.monotonic() < deadline, counters
        time.sleep(0.05)
    # requests are answered in order, and replies forwarded in order: once a call made now is answered,
    # every reply to the slow peer has been forwarded or counted as dropped
    assert _echo_call(peer, "after the flood", 2) == list(b"after the flood")
    counters = peer.ping(timeout_s=10).counters
    assert counters["unroutable_replies"] >= 1  # far more replies than its queue and the socket buffers hold
    got = 0
    while slow.poll(500):
        reply, _ = m.decode(slow.recv_multipart())
        assert reply == m.Tokens(request_id=reply.request_id, ids=m.pack_ids(list(text.encode())))
        got += 1
    assert got == 3000 - counters["unroutable_replies"] > 0  # every reply not counted as dropped arrives
