"""Requests in flight on a peer (the encoder's hand-off to the decoder): replies reach their own
continuations in order, a blocking call acts on earlier replies meanwhile, errors, deadlines and a
lost peer settle every waiting request exactly once."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dsv41 import messages as m
from dsv41.components.inflight import InFlight, raise_error
from dsv41.components.runtime import ComponentError, Peer, new_request_id
from tests.test_transport import TRANSPORTS, WAIT_MS, Net

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def net() -> Iterator[Net]:
    root = Path(tempfile.mkdtemp(prefix="dsv41-", dir="/tmp"))  # short: ipc paths are limited
    network = Net(root)
    try:
        yield network
    finally:
        network.close()
        shutil.rmtree(root, ignore_errors=True)


def tokenize(text: str, request_id: int | None = None) -> m.Tokenize:
    return m.Tokenize(request_id=request_id or new_request_id(), text=text)


def texts(outcomes: list) -> list[str]:
    """What each settled outcome carried: the echoed text, or the error's code."""
    out = []
    for outcome in outcomes:
        try:
            message, _ = raise_error(outcome)
            out.append(bytes(m.unpack_ids(message.ids)).decode())
        except ComponentError as e:
            out.append(e.code.name)
    return out


def served_flight(net: Net, transport: str):
    """An Echo server on `transport` and an InFlight over a peer of it."""
    endpoint = net.endpoint(transport)
    served = net.serve(endpoint)
    return served, InFlight(net.peer(endpoint), timeout_s=30.0)


def settle(flight: InFlight, count: int) -> None:
    deadline = time.monotonic() + WAIT_MS / 1000
    while len(flight) > count and time.monotonic() < deadline:
        flight.poll(0.05)
    assert len(flight) == count


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_replies_reach_their_own_continuations_and_a_call_acts_on_earlier_ones(net: Net, transport):
    _, flight = served_flight(net, transport)
    got: list = []
    for text in ("alpha", "beta", "boom", "gamma"):
        flight.send(tokenize(text), None, got.append)
    assert len(flight) == 4
    answer, _ = flight.call(tokenize("delta"))  # the four earlier replies are acted on while it waits
    assert bytes(m.unpack_ids(answer.ids)).decode() == "delta"
    assert texts(got) == ["alpha", "beta", "INTERNAL", "gamma"]
    assert len(flight) == 0
    with pytest.raises(ComponentError, match="kvstore went away"):
        flight.call(tokenize("upstream"))


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_requests_under_one_id_settle_in_sending_order(net: Net, transport):
    _, flight = served_flight(net, transport)
    got: list = []
    rid = new_request_id()
    flight.send(tokenize("first", rid), None, got.append)
    flight.send(tokenize("second", rid), None, got.append)
    settle(flight, 0)
    assert texts(got) == ["first", "second"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_request_past_its_deadline_fails_once_and_its_late_reply_is_dropped(net: Net, transport):
    served, flight = served_flight(net, transport)
    held, after = [], []
    flight.send(tokenize("hold"), None, held.append, timeout_s=0.2)
    assert served.component.entered.wait(WAIT_MS / 1000)
    settle(flight, 0)  # the deadline passes while the server still holds the request
    assert texts(held) == ["UNAVAILABLE"] and "no reply within 0.2 s" in str(held[0])
    flight.send(tokenize("next"), None, after.append)
    served.component.release.set()  # the late reply comes first and settles nothing
    settle(flight, 0)
    assert texts(held) == ["UNAVAILABLE"] and texts(after) == ["next"]


def test_a_lost_peer_fails_every_waiting_request(net: Net):
    served, flight = served_flight(net, "ipc")
    got: list = []
    flight.send(tokenize("hold"), None, got.append)
    assert served.component.entered.wait(WAIT_MS / 1000)
    flight.send(tokenize("queued"), None, got.append)
    served.stop()  # the server goes away with both requests unanswered
    settle(flight, 0)
    assert texts(got) == ["UNAVAILABLE", "UNAVAILABLE"]


def test_an_unsendable_message_raises_and_registers_nothing(net: Net):
    endpoint = net.endpoint("inproc")
    net.serve(endpoint)
    peer = Peer(endpoint, "echo", limits=m.Limits.flat(1000))
    net.peers.append(peer)
    flight = InFlight(peer, timeout_s=30.0)
    with pytest.raises(ComponentError, match="over the 1000 bytes"):
        flight.send(tokenize("x" * 2000), None, lambda outcome: None)
    assert len(flight) == 0
    assert texts([flight.call(tokenize("small"))]) == ["small"]


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_message_into_the_inbox_ends_a_wait_for_a_peers_replies(net: Net, transport):
    """A component waiting on a peer's replies (the encoder on the decoder's) waits on its inbox
    bell too: a request that comes in meanwhile ends the wait at once, not at its timeout, and the
    rings are consumed."""
    held, flight = served_flight(net, transport)
    waiting = net.serve(net.endpoint(transport, "waiting"))
    bell = waiting.component.inbox_bell
    flight.send(tokenize("hold"), None, lambda outcome: None)
    assert held.component.entered.wait(WAIT_MS / 1000)
    assert flight.poll(0.0, bell) == 0 and bell.poll(0) == 0  # nothing rang yet
    ring = Peer(waiting.server.endpoint, "echo")
    net.peers.append(ring)
    ring.send(tokenize("new request"))
    started = time.monotonic()
    assert flight.poll(WAIT_MS / 1000, bell) == 0  # woken by the bell: the held reply has not come
    assert time.monotonic() - started < WAIT_MS / 2000 and len(flight) == 1
    assert bell.poll(0) == 0
