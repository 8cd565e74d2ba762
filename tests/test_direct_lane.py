"""A component's direct lane (`Server`, `direct_endpoint`): requests, pings, failures and garbage
answered by the compute thread itself, the endpoint still answering health checks meanwhile, routed
replies, the socket file's life, and the endpoints that have no direct lane."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from dsv41 import messages as m
from dsv41.components.runtime import DIRECT_SUFFIX, IPC_PATH_LIMIT, ComponentError, Peer, direct_endpoint
from tests.test_transport import (
    GARBAGE,
    TRANSPORTS,
    WAIT_MS,
    Echo,
    Net,
    Stepper,
    _connected,
    _echo_call,
    _free_port,
    _receive,
    _step,
)

pytestmark = pytest.mark.timeout(30)


class DirectEcho(Echo):
    """Echo with a direct lane; Detokenize is an `early` kind (taken on the I/O thread)."""

    direct_lane = True
    early = frozenset({m.KIND.DETOKENIZE})


class DirectStepper(Stepper):
    direct_lane = True


@pytest.fixture
def net() -> Iterator[Net]:
    root = Path(tempfile.mkdtemp(prefix="dsv41-", dir="/tmp"))  # short: ipc paths are limited
    network = Net(root)
    try:
        yield network
    finally:
        try:
            network.close()
        finally:
            shutil.rmtree(root, ignore_errors=True)


def direct_peer(net: Net, endpoint: str, routing_id: bytes | None = None) -> Peer:
    peer = Peer(endpoint, "echo", timeout_s=30.0, routing_id=routing_id, direct=True)
    net.peers.append(peer)
    return peer


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_direct_lane_serves_requests_pings_and_failures(net, transport):
    endpoint = net.endpoint(transport)
    served = net.serve(endpoint, DirectEcho())
    assert served.server.direct_endpoint == endpoint + DIRECT_SUFFIX
    peer = direct_peer(net, endpoint)
    assert peer.endpoint == endpoint + DIRECT_SUFFIX
    assert _echo_call(peer, "direct", 1) == list(b"direct")
    with pytest.raises(ComponentError) as info:
        peer.call(m.Tokenize(request_id=2, text="boom"))
    assert (info.value.code, info.value.text) == (m.ErrorCode.INTERNAL, "KeyError: 'boom'")
    assert peer.ping(timeout_s=10).pid == os.getpid()  # answered by the compute thread
    assert _echo_call(net.peer(endpoint), "endpoint", 3) == list(b"endpoint")  # the endpoint serves as before
    counters = net.peer(endpoint).ping(timeout_s=10).counters
    assert (counters["requests"], counters["internal_errors"]) == (3, 1)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_garbage_on_the_direct_lane_gets_error_replies(net, transport):
    """Every malformed message the endpoint refuses is refused on the direct lane too, with the same
    error; an `early` kind is refused there (it needs the I/O thread), and serving goes on."""
    endpoint = net.endpoint(transport)
    net.serve(endpoint, DirectEcho())
    raw = net.raw(zmq.DEALER, direct_endpoint(endpoint))
    early = [bytes([m.KIND.DETOKENIZE]), bytes(m.encode(m.Detokenize(request_id=1, ids=m.pack_ids([1])))[1])]
    for what, parts, code, text in [*GARBAGE, ("early kind", early, m.ErrorCode.UNEXPECTED,
                                               "does not take Detokenize messages")]:
        raw.send_multipart(parts)
        reply, frames = m.decode(_receive(raw))
        assert isinstance(reply, m.Error), what
        assert (reply.code, reply.request_id, reply.component, frames) == (code, 0, "echo", []), what
        assert text.lower() in reply.text.lower(), f"{what}: {reply.text}"
    peer = direct_peer(net, endpoint)
    assert _echo_call(peer, "after", 2) == list(b"after")
    assert peer.ping(timeout_s=10).counters["bad_messages"] == len(GARBAGE) + 1


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_the_endpoint_answers_pings_while_a_direct_request_computes(net, transport):
    """The compute thread holds a direct-lane request: health checks on the endpoint are answered,
    and a second direct request waits its turn and is answered after the first."""
    endpoint = net.endpoint(transport)
    served = net.serve(endpoint, DirectEcho())
    peer = direct_peer(net, endpoint)
    peer.send(m.Tokenize(request_id=1, text="hold"))
    peer.send(m.Tokenize(request_id=2, text="next"))
    assert served.component.entered.wait(10)
    assert net.peer(endpoint).ping(timeout_s=10).pid == os.getpid()
    assert not served.component.release.is_set()  # the handler is still blocked: the I/O thread answered
    served.component.release.set()
    assert peer.receive(1)[0] == m.Tokens(request_id=1, ids=m.pack_ids(list(b"hold")))
    assert peer.receive(2)[0] == m.Tokens(request_id=2, ids=m.pack_ids(list(b"next")))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_routed_reply_leaves_on_the_direct_lane_to_the_asker_there(net, transport):
    """The decoder's case: the encoder relays a step on the direct lane, the scheduler that asked is
    connected there too, and the reply goes to it, not to the relay."""
    endpoint = net.endpoint(transport)
    net.serve(endpoint, DirectStepper(routed=True))
    relay, asker = direct_peer(net, endpoint), direct_peer(net, endpoint, routing_id=b"asker-1")
    _connected(asker)
    relay.send(_step(11, 5, b"asker-1"))
    assert asker.sock.poll(WAIT_MS) and not relay.sock.poll(0)
    reply, _ = relay.receive_any(WAIT_MS / 1000, also=(asker,))
    assert (type(reply), reply.request_id) == (m.BatchLogits, 11)
    relay.send(_step(12, 5, b"nobody"))  # a route the lane does not hold: dropped and counted
    assert not relay.sock.poll(100) and not asker.sock.poll(100)
    assert relay.ping(timeout_s=10).counters["unroutable_replies"] == 1


def test_the_direct_socket_file_goes_with_its_server_and_a_stale_one_is_replaced(net):
    endpoint = net.endpoint("ipc")
    first = net.serve(endpoint, DirectEcho())
    path = Path(direct_endpoint(endpoint).removeprefix("ipc://"))
    assert path.exists()
    assert _echo_call(direct_peer(net, endpoint), "first", 1) == list(b"first")
    first.stop()
    assert not path.exists() and not Path(endpoint.removeprefix("ipc://")).exists()
    path.write_bytes(b"stale")  # as a killed process leaves it
    net.serve(endpoint, DirectEcho())
    assert _echo_call(direct_peer(net, endpoint), "second", 2) == list(b"second")


def test_endpoints_without_a_direct_lane_serve_direct_peers_on_the_endpoint(net):
    """tcp (one socket, which carries CURVE and heartbeats) and an ipc path the suffix would take
    over the limit have no direct lane: server and peer both fall back to the endpoint."""
    tcp = f"tcp://127.0.0.1:{_free_port()}"
    longest = f"{net.root}/" + "a" * (IPC_PATH_LIMIT - len(f"{net.root}/"))
    for endpoint in (tcp, f"ipc://{longest}"):
        assert direct_endpoint(endpoint) is None
        served = net.serve(endpoint, DirectEcho())
        assert served.server.direct_endpoint is None
        peer = direct_peer(net, endpoint)
        assert peer.endpoint == endpoint
        assert _echo_call(peer, "fallback", 1) == list(b"fallback")
        served.stop()
    assert list(net.root.iterdir()) == []


def test_a_component_without_a_direct_lane_binds_none(net):
    endpoint = net.endpoint("ipc")
    served = net.serve(endpoint)
    assert served.server.direct_endpoint is None
    assert sorted(p.name for p in net.root.iterdir()) == ["echo.sock", "echo.sock.lock"]
