"""CURVE encryption and client authentication for the ZeroMQ sockets that link dsv41 components.

Components bound to loopback, ipc or inproc are reachable only from this machine, so they may run
without keys. Anything bound to a network address must use CURVE: the server proves its identity
with the `server` key pair, and a ZAP handler admits only clients whose public key file
(`<name>.key`) sits in the keys directory. Key files are the standard pyzmq/czmq certificate format.
"""

from __future__ import annotations

import ipaddress
import os
import stat
import tempfile
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
SERVER = "server"
CLIENT = "client"
_LOCAL_TRANSPORTS = ("ipc", "inproc")


class SecurityError(ValueError):
    """A key or endpoint problem the user must fix; the message says what and how."""


def _public_path(keys_dir: Path, name: str) -> Path:
    return keys_dir / f"{name}{PUBLIC_SUFFIX}"


def _secret_path(keys_dir: Path, name: str) -> Path:
    return keys_dir / f"{name}{SECRET_SUFFIX}"


def _make_keys_dir(keys_dir: Path) -> None:
    """Create the directory private to the owner; an existing directory is left as the user set it."""
    if keys_dir.is_dir():
        return
    keys_dir.mkdir(mode=0o700, parents=True)
    keys_dir.chmod(0o700)  # mkdir's mode is reduced by the umask; state it exactly


def _refuse_overwrite(keys_dir: Path, names: Sequence[str]) -> None:
    existing = [p for n in names for p in (_public_path(keys_dir, n), _secret_path(keys_dir, n)) if p.exists()]
    if existing:
        listed = ", ".join(str(p) for p in existing)
        raise SecurityError(
            f"refusing to overwrite existing key files {listed}; remove them or regenerate with overwrite "
            "(peers holding the old keys stop working)"
        )


def generate_keys(keys_dir: Path, names: Sequence[str] = (SERVER, CLIENT), overwrite: bool = False) -> list[Path]:
    """Write a CURVE key pair per name; returns the written paths, public then secret for each name.

    Keys are made in a private temporary directory and moved into place, so a secret file is never
    readable by others, even for a moment, whatever the umask or the directory's mode.
    """
    keys_dir = Path(keys_dir)
    _make_keys_dir(keys_dir)
    if not overwrite:
        _refuse_overwrite(keys_dir, names)
    written: list[Path] = []
    with tempfile.TemporaryDirectory(dir=keys_dir, prefix=".new-keys-") as staging:
        for name in names:
            public, secret = (Path(p) for p in zmq.auth.create_certificates(staging, name))
            secret.chmod(0o600)
            for path, target in ((public, _public_path(keys_dir, name)), (secret, _secret_path(keys_dir, name))):
                os.replace(path, target)
                written.append(target)
    return written


def _require_file(path: Path) -> None:
    if not path.is_file():
        raise SecurityError(f"key file {path} not found; create keys with `dsv41 keys {path.parent}`")


def _check_secret_mode(path: Path) -> None:
    """Refuse a secret key that others can read: it would let them impersonate this component."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        raise SecurityError(
            f"secret key {path} is accessible by group/others (mode {mode:o}); restrict it with `chmod 600 {path}`"
        )


def _load(path: Path) -> tuple[bytes, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as err:
        raise SecurityError(
            f"key file {path} is unreadable or malformed ({err}); recreate it with `dsv41 keys {path.parent}`"
        ) from err


def load_keypair(keys_dir: Path, name: str) -> tuple[bytes, bytes]:
    """Return (public, secret) z85 keys of a pair, after checking the secret file is private."""
    path = _secret_path(Path(keys_dir), name)
    _require_file(path)
    _check_secret_mode(path)
    public, secret = _load(path)
    if secret is None:
        raise SecurityError(f"key file {path} holds no secret key; recreate it with `dsv41 keys {path.parent}`")
    return public, secret


def load_public(keys_dir: Path, name: str) -> bytes:
    """Return the z85 public key of one name."""
    path = _public_path(Path(keys_dir), name)
    _require_file(path)
    return _load(path)[0]


def allowed_client_keys(keys_dir: Path) -> list[bytes]:
    """Public keys the server admits: every `*.key` file in the directory (the same set the ZAP handler loads)."""
    return [_load(path)[0] for path in sorted(Path(keys_dir).glob(f"*{PUBLIC_SUFFIX}"))]


def is_loopback_host(host: str) -> bool:
    """True for hosts only this machine can reach: 127.0.0.0/8, ::1 (bracketed or not), localhost."""
    host = host.strip("[]")
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False  # interface names and other hostnames may face the network
    mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
    return (mapped if mapped is not None else addr).is_loopback


def _endpoint_host(address: str) -> str:
    """Host part of `host:port` or `host:port/path` (ws); the whole address when there is no port."""
    host_port = address.split("/", 1)[0]
    host, sep, _ = host_port.rpartition(":")
    return host if sep else host_port


def check_bind_allowed(endpoint: str, keys_dir: Path | None) -> None:
    """Refuse to expose an unencrypted, unauthenticated socket beyond this machine."""
    transport, sep, address = endpoint.partition("://")
    if keys_dir is not None or (sep and transport.lower() in _LOCAL_TRANSPORTS):
        return
    if sep and is_loopback_host(_endpoint_host(address)):
        return
    raise SecurityError(
        f"binding {endpoint!r}, a non-loopback address, without CURVE keys is refused; "
        "create keys with `dsv41 keys DIR` and set `security.keys_dir`, or bind 127.0.0.1"
    )


class CurveServer:
    """ZAP authentication for the CURVE server sockets of one context.

    libzmq admits any CURVE client when no ZAP handler runs, so keep this object started for as long
    as the sockets it was applied to are open. Only one ZAP handler can run per context.
    """

    def __init__(self, ctx: zmq.Context, keys_dir: Path) -> None:
        self.keys_dir = Path(keys_dir)
        self._public, self._secret = load_keypair(self.keys_dir, SERVER)  # fail before starting a thread
        self._auth: ThreadAuthenticator | None = ThreadAuthenticator(ctx)
        self._auth.start()
        self._auth.configure_curve(domain="*", location=str(self.keys_dir))

    def apply(self, socket: zmq.Socket) -> None:
        """Make the socket a CURVE server with the `server` pair; call before bind."""
        if self._auth is None:
            raise SecurityError("CurveServer is stopped; without it any client key would be admitted")
        socket.curve_secretkey = self._secret
        socket.curve_publickey = self._public
        socket.curve_server = True

    def stop(self) -> None:
        """Stop the ZAP handler; close the sockets it guarded first."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def __enter__(self) -> CurveServer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def apply_curve_client(socket: zmq.Socket, keys_dir: Path, client: str = CLIENT, server: str = SERVER) -> None:
    """Make the socket a CURVE client with its own pair that trusts only the `server` public key."""
    public, secret = load_keypair(keys_dir, client)
    socket.curve_serverkey = load_public(keys_dir, server)
    socket.curve_publickey = public
    socket.curve_secretkey = secret
