"""Start a pipeline's components, watch them, restart the ones that die, and stop them cleanly.

Components start in dependency order and the launcher waits for each to answer a ping before
a deadline. A `process` component is a child process that dies with the launcher
(PR_SET_PDEATHSIG); a `thread` component runs in this process. A dead component is restarted
after a backoff that doubles with each restart in the window; more than `max_restarts` restarts
within `restart_window_s` is a crash loop: the supervisor gives up and says so, with the
component's last log lines. Requests that were inside a dead component fail at their caller with
an UNAVAILABLE error naming it; the next requests go to the restarted one.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from functools import cached_property
from pathlib import Path

import msgspec

from dsv41 import messages as m
from dsv41.components.context import COMPONENTS, ComponentContext
from dsv41.components.host import build_server, serve_forever
from dsv41.components.runtime import ComponentError, Peer
from dsv41.pipelines.schema import Pipeline, placement_of, resolve_endpoints

PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    pass


def default_runtime_dir(pipeline: Pipeline) -> Path:
    """A private directory for ipc sockets and lock files, the same for every command that names
    this pipeline (so `dsv41 status` finds a pipeline that `dsv41 serve` started)."""
    if pipeline.runtime_dir:
        return Path(pipeline.runtime_dir).expanduser()
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or "/tmp")
    return base / f"dsv41-{os.getuid()}" / pipeline.name


def prepare_runtime_dir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise LaunchError(f"runtime directory {path} must be private to this user (mode 0700); "
                          f"fix it with chmod 700 {path} or set runtime_dir")


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class _Child:
    """What the supervisor drives of a component: `request_stop` returns at once, so that several
    can stop at the same time; `wait_stopped` waits for one."""

    def request_stop(self) -> None:
        raise NotImplementedError

    def wait_stopped(self, timeout_s: float) -> None:
        raise NotImplementedError

    def stop(self, timeout_s: float) -> None:
        self.request_stop()
        self.wait_stopped(timeout_s)


class ProcessChild(_Child):
    def __init__(self, name: str, pipeline_file: Path, runtime_dir: Path):
        self.name, self.pipeline_file, self.runtime_dir = name, pipeline_file, runtime_dir
        self.log_path = runtime_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        # Idle OpenMP threads of one component spinning on the cores the next one computes on cost
        # several times the step time on a small machine; passive waiting gives the cores back.
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dsv41.components.host", self.name, str(self.pipeline_file),
                 str(self.runtime_dir)], stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env,
                preexec_fn=_die_with_parent)

    def exit_code(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def request_stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self, timeout_s: float) -> None:
        """After `request_stop`: the process's exit, killed if it takes longer than timeout_s."""
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def last_lines(self, n: int = 12) -> str:
        try:
            return "".join(deque(self.log_path.read_text(errors="replace").splitlines(keepends=True), n))
        except OSError:
            return ""


class ThreadChild(_Child):
    def __init__(self, name: str, pipeline: Pipeline, runtime_dir: Path):
        self.name, self.pipeline, self.runtime_dir = name, pipeline, runtime_dir
        self.server, self.thread, self.error = None, None, ""
        self._built = threading.Event()

    def start(self) -> None:
        self._built.clear()
        self.thread = threading.Thread(target=self._run, name=f"dsv41-{self.name}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.server = build_server(self.name, self.pipeline, self.runtime_dir)
        except Exception as e:  # noqa: BLE001 - reported through exit_code/last_lines
            self.error = f"{type(e).__name__}: {e}"
            return
        finally:
            self._built.set()
        serve_forever(self.server)

    def exit_code(self) -> int | None:
        return None if self.thread is None or self.thread.is_alive() else 1

    def request_stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def wait_stopped(self, timeout_s: float) -> None:
        self._built.wait(timeout_s)  # a server still being built is stopped once it exists
        self.request_stop()
        if self.thread is not None:
            self.thread.join(timeout_s)

    pid = None

    def last_lines(self, n: int = 12) -> str:
        return self.error


class Supervisor:
    def __init__(self, pipeline: Pipeline, runtime_dir: Path | None = None, log=None):
        self.pipeline = pipeline
        self.runtime_dir = runtime_dir or default_runtime_dir(pipeline)
        self.log = log or (lambda text: None)
        self.endpoints = resolve_endpoints(pipeline, self.runtime_dir)
        self.children: dict[str, ProcessChild | ThreadChild] = {}
        self.restarts: dict[str, deque[float]] = {name: deque() for name in COMPONENTS}
        self.failure: str | None = None
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._lock = threading.Lock()
        self._dir_lock: int | None = None

    # --- start -------------------------------------------------------------------------------------
    def start(self) -> Supervisor:
        prepare_runtime_dir(self.runtime_dir)
        self._take_runtime_dir()
        pipeline_file = self.runtime_dir / "pipeline.yaml"
        pipeline_file.write_bytes(msgspec.yaml.encode(self.pipeline))
        for name in COMPONENTS:
            if placement_of(self.pipeline, name) == "thread":
                self.children[name] = ThreadChild(name, self.pipeline, self.runtime_dir)
            else:
                self.children[name] = ProcessChild(name, pipeline_file, self.runtime_dir)
        try:
            for name in COMPONENTS:
                self.children[name].start()
            for name in COMPONENTS:
                self.wait_ready(name, time.monotonic() + self.pipeline.supervisor.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        self._watcher = threading.Thread(target=self._watch, name="dsv41-supervisor", daemon=True)
        self._watcher.start()
        return self

    def _take_runtime_dir(self) -> None:
        """One supervisor per runtime directory: a second would rewrite the first one's pipeline
        file and fight over its sockets."""
        self._dir_lock = os.open(self.runtime_dir / "supervisor.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(self._dir_lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._dir_lock)
            self._dir_lock = None
            raise LaunchError(f"a pipeline is already running in {self.runtime_dir}; use `dsv41 status` to see it, "
                              "or another --runtime-dir") from None

    def wait_ready(self, name: str, deadline: float) -> None:
        """Ping until the component answers; a component that exits or stays silent is an error.
        Returns once the pipeline is stopping: `stop` ends a restart's wait (and empties
        `children` while it may still run)."""
        child = self.children.get(name)
        if child is None:  # stopped already
            return
        peer = Peer(self.endpoints[name], name, self._keys_dir(), timeout_s=1.0)
        try:
            while time.monotonic() < deadline:
                if self._stopping.is_set():
                    return
                code = child.exit_code()
                if code is not None:
                    raise LaunchError(f"{name} exited with code {code} while starting:\n{child.last_lines()}")
                try:
                    peer.ping(timeout_s=min(1.0, max(0.05, deadline - time.monotonic())))
                    self.log(f"{name} ready")
                    return
                except ComponentError:
                    continue
            raise LaunchError(f"{name} did not become ready within {self.pipeline.supervisor.ready_timeout_s:.0f} s "
                              f"(raise supervisor.ready_timeout_s if it loads a large model)")
        finally:
            peer.close()

    def _keys_dir(self) -> Path | None:
        keys = self.pipeline.security.keys_dir
        return Path(keys).expanduser() if keys else None

    # --- watch and restart -------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stopping.wait(0.2):
            for name, child in self.children.items():
                code = child.exit_code()
                if code is not None and not self._stopping.is_set():
                    self._restart(name, child, code)
            if self.failure:
                return

    def _restart(self, name: str, child, code: int) -> None:
        spec, now = self.pipeline.supervisor, time.monotonic()
        history = self.restarts[name]
        while history and now - history[0] > spec.restart_window_s:
            history.popleft()
        if len(history) >= spec.max_restarts:
            self.failure = (f"crash loop: {name} exited {len(history) + 1} times within {spec.restart_window_s:.0f} s "
                            f"(last exit code {code}); last log lines:\n{child.last_lines()}")
            self.log(self.failure)
            threading.Thread(target=self.stop, daemon=True).start()
            return
        delay = spec.backoff_s * 2 ** len(history)
        self.log(f"{name} exited with code {code}; restarting in {delay:.1f} s")
        history.append(now)
        if self._stopping.wait(delay):
            return
        with self._lock:  # never started after `stop` has told the components to stop
            if self._stopping.is_set():
                return
            child.start()
        try:
            self.wait_ready(name, time.monotonic() + spec.ready_timeout_s)
        except LaunchError as e:
            self.log(str(e))

    # --- stop --------------------------------------------------------------------------------------
    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every component, idempotent: each is told to stop, in reverse dependency order,
        before the first is waited for, so their shutdowns overlap (each takes about half a
        second, most of it the interpreter's exit)."""
        with self._lock:
            self._stopping.set()
            stopping = [self.children[name] for name in reversed(COMPONENTS) if name in self.children]
            for child in stopping:
                child.request_stop()
            for child in stopping:
                child.wait_stopped(timeout_s)
            self.children = {}
            if self._dir_lock is not None:
                (self.runtime_dir / "pipeline.yaml").unlink(missing_ok=True)
                os.close(self._dir_lock)
                self._dir_lock = None
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(2.0)

    def __enter__(self) -> Supervisor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def peer(self, name: str = "dspark", timeout_s: float | None = None) -> Peer:
        """A caller of `name`, its socket sized for that component's replies."""
        return Peer(self.endpoints[name], name, self._keys_dir(),
                    timeout_s=timeout_s or self.pipeline.generation.request_timeout_s, limits=self.limits)

    @cached_property
    def limits(self) -> m.Limits:
        return ComponentContext(self.pipeline, self.endpoints, self.runtime_dir).limits

    def pids(self) -> dict[str, int | None]:
        return {name: child.pid for name, child in self.children.items()}


def with_overrides(pipeline: Pipeline, **sections) -> Pipeline:
    """A copy with some fields of some sections replaced, e.g. store={"path": ...}."""
    changes = {}
    for section, fields in sections.items():
        current = getattr(pipeline, section)
        nested = isinstance(current, msgspec.Struct) and isinstance(fields, dict)
        changes[section] = msgspec.structs.replace(current, **fields) if nested else fields
    return msgspec.structs.replace(pipeline, **changes)
