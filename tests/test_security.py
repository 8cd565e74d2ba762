"""CURVE key handling, the bind guard, and real encrypted/authenticated links over loopback TCP."""

from __future__ import annotations

import shutil
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from dsv41.components.security import (
    CurveServer,
    SecurityError,
    allowed_client_keys,
    apply_curve_client,
    check_bind_allowed,
    generate_keys,
    is_loopback_host,
    load_keypair,
    load_public,
)

REJECT_WAIT_S = 1.5


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def keys(tmp_path: Path) -> Path:
    keys_dir = tmp_path / "keys"
    generate_keys(keys_dir)
    return keys_dir


@dataclass
class Link:
    """A CURVE ROUTER on loopback plus the client sockets a test opens against it."""

    ctx: zmq.Context
    router: zmq.Socket
    endpoint: str
    sockets: list[zmq.Socket] = field(default_factory=list)

    def client(self, keys_dir: Path) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.linger = 0
        self.sockets.append(sock)
        apply_curve_client(sock, keys_dir)
        return sock

    def monitor(self, sock: zmq.Socket) -> zmq.Socket:
        mon = sock.get_monitor_socket()
        self.sockets.append(mon)
        return mon


@pytest.fixture
def link(keys: Path) -> Iterator[Link]:
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    server = CurveServer(ctx, keys)
    clients: list[zmq.Socket] = []
    try:
        server.apply(router)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        yield Link(ctx, router, f"tcp://127.0.0.1:{port}", clients)
    finally:
        for sock in reversed(clients):
            sock.close(linger=0)
        router.close(linger=0)
        server.stop()
        ctx.term()


def _collect(seconds: float, *socks: zmq.Socket) -> dict[zmq.Socket, list[list[bytes]]]:
    """Every message each socket receives within the window."""
    poller = zmq.Poller()
    for sock in socks:
        poller.register(sock, zmq.POLLIN)
    got: dict[zmq.Socket, list[list[bytes]]] = {sock: [] for sock in socks}
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        for sock, _ in poller.poll(int(left * 1000) + 1):
            got[sock].append(sock.recv_multipart())
    return got


@pytest.mark.timeout(20)
def test_generate_keys_private_files_and_refuses_overwrite(tmp_path: Path) -> None:
    keys_dir = tmp_path / "keys"
    written = generate_keys(keys_dir)
    names = sorted(p.name for p in written)
    assert names == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    assert sorted(p.name for p in keys_dir.iterdir()) == names  # no staging leftovers
    assert _mode(keys_dir) == 0o700
    assert all(_mode(keys_dir / f"{n}.key_secret") == 0o600 for n in ("server", "client"))
    before = load_public(keys_dir, "server")
    with pytest.raises(SecurityError, match="overwrite"):
        generate_keys(keys_dir)
    assert load_public(keys_dir, "server") == before
    generate_keys(keys_dir, overwrite=True)
    assert load_public(keys_dir, "server") != before
    assert _mode(keys_dir / "server.key_secret") == 0o600


@pytest.mark.timeout(20)
def test_load_keypair_and_public_keys(keys: Path) -> None:
    public, secret = load_keypair(keys, "client")
    assert len(public) == len(secret) == 40  # z85 of 32 bytes
    assert load_public(keys, "client") == public
    assert sorted(allowed_client_keys(keys)) == sorted([public, load_public(keys, "server")])


@pytest.mark.timeout(20)
def test_load_keypair_refuses_readable_secret(keys: Path) -> None:
    (keys / "client.key_secret").chmod(0o644)
    with pytest.raises(SecurityError, match="chmod 600") as err:
        load_keypair(keys, "client")
    assert "client.key_secret" in str(err.value)


@pytest.mark.timeout(20)
def test_missing_keys_name_the_path_and_the_command(tmp_path: Path) -> None:
    with pytest.raises(SecurityError, match="dsv41 keys") as err:
        load_keypair(tmp_path, "client")
    assert str(tmp_path / "client.key_secret") in str(err.value)
    with pytest.raises(SecurityError, match="dsv41 keys"):
        load_public(tmp_path, "server")


@pytest.mark.timeout(20)
@pytest.mark.parametrize("host", ["127.0.0.1", "127.9.8.7", "::1", "[::1]", "localhost", "::ffff:127.0.0.1"])
def test_loopback_hosts(host: str) -> None:
    assert is_loopback_host(host)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("host", ["0.0.0.0", "*", "::", "[::]", "10.1.2.3", "eth0", "example.com", ""])
def test_non_loopback_hosts(host: str) -> None:
    assert not is_loopback_host(host)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://[::]:5555"])
def test_network_bind_needs_keys(endpoint: str, keys: Path) -> None:
    with pytest.raises(SecurityError, match="dsv41 keys"):
        check_bind_allowed(endpoint, None)
    check_bind_allowed(endpoint, keys)


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    "endpoint", ["tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:5555", "ipc:///tmp/x", "inproc://x"]
)
def test_local_bind_needs_no_keys(endpoint: str) -> None:
    check_bind_allowed(endpoint, None)


@pytest.mark.timeout(20)
def test_curve_round_trip(link: Link, keys: Path) -> None:
    client = link.client(keys)
    client.connect(link.endpoint)
    client.send(b"ping")
    assert link.router.poll(5000), "server got nothing over CURVE"
    identity, payload = link.router.recv_multipart(copy=False)
    assert payload.bytes == b"ping"
    assert payload.get("User-Id") == load_public(keys, "client").decode()  # the ZAP handler vouched for it
    link.router.send_multipart([identity.bytes, b"pong"])
    assert client.poll(5000), "no reply over CURVE"
    assert client.recv() == b"pong"


@pytest.mark.timeout(20)
def test_unknown_client_key_is_rejected(link: Link, keys: Path, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger"
    generate_keys(stranger, ["client"])
    shutil.copy(keys / "server.key", stranger / "server.key")  # trusts the right server
    client = link.client(stranger)
    monitor = link.monitor(client)
    client.connect(link.endpoint)
    client.send(b"ping")
    got = _collect(REJECT_WAIT_S, link.router, monitor)
    assert got[link.router] == []
    events = [parse_monitor_message(msg)["event"] for msg in got[monitor]]
    assert zmq.EVENT_HANDSHAKE_FAILED_AUTH in events


@pytest.mark.timeout(20)
def test_wrong_server_key_gets_no_reply(link: Link, tmp_path: Path) -> None:
    other = tmp_path / "other"
    generate_keys(other)  # its own server pair: the client expects a server it will not find
    client = link.client(other)
    client.connect(link.endpoint)
    client.send(b"ping")
    got = _collect(REJECT_WAIT_S, link.router, client)
    assert got[link.router] == []
    assert got[client] == []


@pytest.mark.timeout(20)
def test_stopped_server_refuses_to_apply(keys: Path) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        with CurveServer(ctx, keys) as server:
            pass
        with pytest.raises(SecurityError, match="stopped"):
            server.apply(sock)
    finally:
        sock.close(linger=0)
        ctx.term()
