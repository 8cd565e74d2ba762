"""Fault tests on the `local` pipeline: SIGKILL each component kind in the middle of two requests.

Each request either fails with an error naming a component or completes (where the loss is safe:
a dead kvstore is a cache miss, a dead engram component makes the encoder look rows up itself).
The supervisor restarts the component, the next request succeeds, and the store verifies clean.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time

import pytest
import torch
from click.testing import CliRunner

from dsv41 import messages as m
from dsv41.cli.main import cli
from dsv41.components.context import COMPONENTS
from dsv41.components.runtime import ComponentError
from dsv41.engine.core import InferenceCore
from dsv41.model.reference import random_model
from dsv41.pipelines.client import generate
from dsv41.pipelines.launch import Supervisor
from tests.helpers.pipelines import pipeline_for, short_dir

pytestmark = pytest.mark.timeout(600)
SAFE_TO_LOSE = {"kvstore", "engram"}  # the request goes on without them


def _request(supervisor: Supervisor, ids: list[int], new_tokens: int, first_token: threading.Event, outcome: dict):
    peer = supervisor.peer(timeout_s=60)
    try:
        events = []
        for event in generate(peer, ids=ids, max_new_tokens=new_tokens, stop_at_eos=False):
            events.append(event)
            first_token.set()
        outcome["finished"] = events[-1]
    except ComponentError as e:
        outcome["error"] = e
    finally:
        first_token.set()
        peer.close()


def _wait_restarted(supervisor: Supervisor, name: str, old_pid: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pid = supervisor.pids().get(name)
        if pid is not None and pid != old_pid:
            peer = supervisor.peer(name, timeout_s=2)
            try:
                peer.ping(timeout_s=2)
                return
            except ComponentError:
                pass
            finally:
                peer.close()
        time.sleep(0.1)
    raise AssertionError(f"{name} was not restarted")


def test_sigkill_each_component_mid_request(rng):
    root = short_dir()
    try:
        pipeline = pipeline_for("process", root)
        prompts = [torch.randint(3, 300, (n,), generator=rng).tolist() for n in (70, 45)]
        prompt = prompts[0]
        with Supervisor(pipeline, root / "run") as supervisor:
            for name in COMPONENTS:
                # two requests: their steps are two batches in flight when the component dies
                started = [(threading.Event(), {}) for _ in prompts]
                clients = [threading.Thread(target=_request, args=(supervisor, ids, 150, first_token, outcome))
                           for ids, (first_token, outcome) in zip(prompts, started, strict=True)]
                for client in clients:
                    client.start()
                assert all(first_token.wait(60) for first_token, _ in started)
                old_pid = supervisor.pids()[name]
                os.kill(old_pid, signal.SIGKILL)
                for client in clients:
                    client.join(90)
                    assert not client.is_alive()
                for _, outcome in started:
                    if "error" in outcome:
                        error = outcome["error"]
                        assert name not in SAFE_TO_LOSE, f"losing {name} failed the request: {error}"
                        assert error.code in (m.ErrorCode.UNAVAILABLE, m.ErrorCode.UNKNOWN_REQUEST), error
                        assert error.component in COMPONENTS, error
                    else:
                        assert outcome["finished"].generated_tokens == 150
                    print(f"killed {name}: {outcome.get('error') or 'request completed'}")
                _wait_restarted(supervisor, name, old_pid)
                after = list(generate(supervisor.peer(), ids=prompt[:30], max_new_tokens=3, stop_at_eos=False))
                assert after[-1].generated_tokens == 3, f"after restarting {name}"
            assert supervisor.failure is None
        result = CliRunner().invoke(cli, ["kv", "verify", "--path", str(root / "kv")])
        assert result.exit_code == 0, result.output
    finally:
        shutil.rmtree(root, ignore_errors=True)


def plain_greedy_tokens(prompt: list[int], new_tokens: int) -> list[int]:
    """The in-process core's greedy tokens with no prefix cache (one CED prefill, then steps)."""
    core = InferenceCore(random_model("micro", seed=3))
    with torch.inference_mode():
        seq, logits = core.prefill(prompt, capacity=len(prompt) + new_tokens, packed=True)
        tokens = []
        for _ in range(new_tokens):
            tokens.append(int(logits.argmax()))
            logits = core.step(seq, tokens[-1:])[-1]
    return tokens


def test_a_store_file_cut_short_under_a_running_kvstore_is_a_cache_miss_then_quarantined(rng):
    """The store file truncated while the pipeline runs (the kvstore has it mapped): the kvstore dies
    of SIGBUS at its next read, and the request that asked it is computed as with no prefix cache (a
    store failure is a cache miss, never a failed or wrong answer): the in-process core's tokens.
    (With a store, a cold prefill is split at its snapshot position, which can change `micro`'s
    tokens; tests/test_pipeline_e2e.py compares that path with its own oracle.) The supervisor
    restarts the kvstore once: it finds the file corrupt before mapping it, moves it aside and
    starts empty, then caches again."""
    root = short_dir()
    try:
        pipeline = pipeline_for("process", root)
        prompt = torch.randint(3, 300, (70,), generator=rng).tolist()

        def run() -> tuple[list[int], m.Finished]:
            events = list(generate(supervisor.peer(), ids=prompt, max_new_tokens=4, stop_at_eos=False))
            return [e.token for e in events[:-1]], events[-1]

        log: list[str] = []
        with Supervisor(pipeline, root / "run", log=log.append) as supervisor:
            cold, _ = run()
            assert run()[1].cached_tokens == 64  # four 16-token blocks came from the store
            old_pid = supervisor.pids()["kvstore"]
            os.truncate(root / "kv" / "data.mdb", 2 * 4096)  # the two meta pages left, every tree page gone
            tokens, done = run()
            assert done.cached_tokens == 0 and tokens == plain_greedy_tokens(prompt, 4)
            _wait_restarted(supervisor, "kvstore", old_pid)
            assert f"kvstore exited with code {-signal.SIGBUS}; restarting in 0.1 s" in log, log
            assert len(list(root.glob("kv.corrupt-*"))) == 1  # the damaged files, kept for inspection
            assert run()[0] == cold  # a cold prefill into the new, empty store
            assert run()[1].cached_tokens == 64  # which holds the blocks again
            assert supervisor.failure is None
        result = CliRunner().invoke(cli, ["kv", "verify", "--path", str(root / "kv")])
        assert result.exit_code == 0, result.output
    finally:
        shutil.rmtree(root, ignore_errors=True)
