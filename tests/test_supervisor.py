"""The supervisor: readiness deadline, start-up failure, crash loop, graceful stop, and no orphans
when the supervisor itself is killed (RELIABILITY.md 7.4)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from dsv41.pipelines import launch
from dsv41.pipelines.launch import LaunchError, Supervisor, with_overrides
from tests.helpers.pipelines import pipeline_for

pytestmark = pytest.mark.timeout(300)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited; only its parent's wait is missing
        return f.read().split(")")[-1].split()[0] != "Z"


def test_graceful_stop_leaves_nothing_behind(root):
    supervisor = Supervisor(pipeline_for("process", root), root / "run").start()
    with pytest.raises(LaunchError, match="already running"):  # one supervisor per runtime directory
        Supervisor(pipeline_for("process", root), root / "run").start()
    children = dict(supervisor.children)
    supervisor.stop()
    assert {name: child.exit_code() for name, child in children.items()} == dict.fromkeys(children, 0)
    assert not list((root / "run").glob("*.sock*"))


class _RecordingChild(launch._Child):
    def __init__(self, name: str, calls: list[tuple[str, str]]):
        self.name, self.calls = name, calls

    def request_stop(self) -> None:
        self.calls.append(("request_stop", self.name))

    def wait_stopped(self, timeout_s: float) -> None:
        self.calls.append(("wait_stopped", self.name))


def test_stop_tells_every_component_before_waiting_for_any(root):
    """Shutdowns overlap: all are asked to stop (downstream first) before the first is waited for."""
    supervisor = Supervisor(pipeline_for("process", root), root / "run")
    calls: list[tuple[str, str]] = []
    supervisor.children = {name: _RecordingChild(name, calls) for name in launch.COMPONENTS}
    supervisor.stop()
    order = list(reversed(launch.COMPONENTS))
    assert calls == [("request_stop", n) for n in order] + [("wait_stopped", n) for n in order]
    assert supervisor.children == {}


class _SilentAfterCrash(_RecordingChild):
    """Has exited when the supervisor first looks; once restarted it runs but never answers."""

    def __init__(self, name: str, calls: list[tuple[str, str]]):
        super().__init__(name, calls)
        self.running = False

    def exit_code(self) -> int | None:
        return None if self.running else 1

    def start(self) -> None:
        self.running = True
        self.calls.append(("start", self.name))

    def last_lines(self, n: int = 12) -> str:
        return ""


def test_stop_during_a_restart_ends_the_restart_without_an_error(root, monkeypatch):
    """A component killed mid-request is being restarted (the supervisor pings it until ready)
    when the pipeline stops: the restart ends quietly, nothing is started after the stop, and the
    watcher thread raises nothing (it used to look the component up after `stop` had emptied the
    table: a KeyError in the supervisor thread)."""
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    pipeline = with_overrides(pipeline_for("process", root), supervisor={"backoff_s": 0.01, "ready_timeout_s": 60.0})
    supervisor = Supervisor(pipeline, root / "run")
    calls: list[tuple[str, str]] = []
    supervisor.children = {name: _RecordingChild(name, calls) for name in launch.COMPONENTS}
    for child in supervisor.children.values():
        child.exit_code = lambda: None
    supervisor.children["dspark"] = _SilentAfterCrash("dspark", calls)
    supervisor._watcher = threading.Thread(target=supervisor._watch, name="dsv41-supervisor", daemon=True)
    supervisor._watcher.start()
    deadline = time.monotonic() + 30
    while ("start", "dspark") not in calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ("start", "dspark") in calls
    time.sleep(0.3)  # the restart is waiting for an answer
    supervisor.stop()
    assert not supervisor._watcher.is_alive()
    assert errors == []
    assert calls.count(("start", "dspark")) == 1 and calls[-1] == ("wait_stopped", launch.COMPONENTS[0])


def test_a_component_that_fails_to_start_is_reported_with_its_log(root):
    pipeline = pipeline_for("process", root, engram={"tables": str(root / "missing.safetensors")})
    with pytest.raises(LaunchError) as e:
        Supervisor(pipeline, root / "run").start()
    assert "engram exited with code 1 while starting" in str(e.value)
    assert "missing.safetensors" in str(e.value)
    assert not list((root / "run").glob("*.sock"))


def test_a_component_that_never_gets_ready_times_out_and_is_cleaned_up(root, monkeypatch):
    silent = []

    class Silent(launch.ProcessChild):
        def start(self):
            if self.name != "kvstore":  # the first one waited for
                return super().start()
            self.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
            silent.append(self.proc)

    monkeypatch.setattr(launch, "ProcessChild", Silent)
    pipeline = with_overrides(pipeline_for("process", root), supervisor={"ready_timeout_s": 3.0})
    with pytest.raises(LaunchError) as e:
        Supervisor(pipeline, root / "run").start()
    assert "kvstore did not become ready within 3 s" in str(e.value)
    assert silent[0].poll() is not None  # stopped, not orphaned


def test_restarts_then_gives_up_on_a_crash_loop(root):
    pipeline = with_overrides(pipeline_for("process", root),
                              supervisor={"max_restarts": 2, "restart_window_s": 120.0, "backoff_s": 0.1})
    supervisor = Supervisor(pipeline, root / "run").start()
    try:
        for attempt in range(3):
            pid = supervisor.pids()["tokenizer"]
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if supervisor.failure or (supervisor.pids().get("tokenizer") not in (None, pid)
                                          and attempt < 2 and supervisor.restarts["tokenizer"]):
                    break
                time.sleep(0.05)
            if attempt < 2:
                supervisor.wait_ready("tokenizer", time.monotonic() + 60)
        deadline = time.monotonic() + 30
        while supervisor.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert supervisor.failure is not None and supervisor.failure.startswith("crash loop: tokenizer exited 3 times")
    finally:
        supervisor.stop()


SUPERVISED = """
import sys, time, msgspec
from pathlib import Path
from dsv41.pipelines.launch import Supervisor
from dsv41.pipelines.schema import load_pipeline
supervisor = Supervisor(load_pipeline(Path(sys.argv[1])), Path(sys.argv[2])).start()
print(" ".join(str(pid) for pid in supervisor.pids().values()), flush=True)
time.sleep(600)
"""


def test_killing_the_supervisor_leaves_no_orphans_and_no_stale_locks(root):
    pipeline_file = root / "p.yaml"
    pipeline_file.write_bytes(msgspec.yaml.encode(pipeline_for("process", root)))
    run = root / "run"
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISED, str(pipeline_file), str(run)],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 6 and all(_alive(pid) for pid in pids)
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 20
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(pid) for pid in pids)
    with Supervisor(pipeline_for("process", root), run) as supervisor:  # same sockets, same store
        assert all(supervisor.pids().values())
