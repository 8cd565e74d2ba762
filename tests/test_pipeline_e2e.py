"""Whole pipelines: real processes (`local`) and threads (`inproc`) give exactly the greedy tokens
of the in-process inference core, share prefixes through the persistent store, and keep hitting
it after a restart."""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest
import torch

from dsv41 import messages as m
from dsv41.components.runtime import ComponentError, Peer
from dsv41.components.security import SERVER, generate_keys
from dsv41.engine.core import InferenceCore
from dsv41.engine.prefix_cache import CachedPrefill
from dsv41.model.reference import random_model
from dsv41.pipelines.client import generate
from dsv41.pipelines.launch import Supervisor, with_overrides
from dsv41.pipelines.schema import load_pipeline
from dsv41.storage.blockfmt import BlockLayout
from dsv41.storage.policy import PrefixCachePolicy
from dsv41.storage.prefix import Fingerprint
from dsv41.storage.store import GlobalKVStore
from dsv41.storage.swa_pool import SWAPool
from tests.helpers.pipelines import pipeline_for, short_dir

pytestmark = pytest.mark.timeout(600)
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    first = torch.randint(3, 300, (40,), generator=gen).tolist()
    return [first, first[:36] + torch.randint(3, 300, (10,), generator=gen).tolist(),
            torch.randint(3, 300, (5,), generator=gen).tolist()]


def in_process(prompts: list[list[int]], root, restart_before: int | None = None):
    """Greedy tokens and (cached, encoder, replayed) counts of the in-process core with its own
    store; before prompt `restart_before` the host SWA pool starts empty, as after a restart."""
    model = random_model("micro", seed=3)
    core = InferenceCore(model, chunk_size=512)
    layout = BlockLayout.of(model.config, 16)
    fingerprint = Fingerprint.of(model.config, "random:micro:3")
    results = []
    with GlobalKVStore(root / "reference-kv", layout) as store:
        cached = CachedPrefill(core, PrefixCachePolicy(store, SWAPool(2**26), fingerprint, 16))
        for i, ids in enumerate(prompts):
            if i == restart_before:
                cached = CachedPrefill(core, PrefixCachePolicy(store, SWAPool(2**26), fingerprint, 16))
            result = cached.prefill(ids, capacity=len(ids) + NEW_TOKENS)
            seq, logits, tokens = result.sequence, result.logits, []
            counts = (result.cached_tokens, seq.counters.encoder_layer_tokens, seq.counters.replayed_layer_tokens)
            for _ in range(NEW_TOKENS):
                tokens.append(int(logits.argmax()))
                if len(tokens) < NEW_TOKENS:
                    logits = core.step(seq, tokens[-1:])[-1]
            results.append((tokens, *counts))
    return results


def through_pipeline(supervisor: Supervisor, prompts: list[list[int]]) -> list[tuple[list[int], int, int, int]]:
    peer, results = supervisor.peer(), []
    try:
        for ids in prompts:
            events = list(generate(peer, ids=ids, max_new_tokens=NEW_TOKENS, stop_at_eos=False))
            done = events[-1]
            assert isinstance(done, m.Finished) and done.generated_tokens == NEW_TOKENS
            results.append(([e.token for e in events[:-1]], done.cached_tokens, done.encoder_layer_tokens,
                            done.replayed_layer_tokens))
    finally:
        peer.close()
    return results


@pytest.fixture(scope="module")
def expected(prompts):
    """The in-process run, ending with the first prompt again: a hit, as after the pipeline's restart."""
    path = short_dir()
    try:
        results = in_process([*prompts, prompts[0]], path, restart_before=3)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    assert results[1][1] == 32 and results[3][1] == 32  # two 16-token blocks come from the store
    return results


def test_local_and_inproc_pipelines_equal_the_in_process_core(prompts, expected, root):
    local = pipeline_for("process", root)
    with Supervisor(local, root / "run") as supervisor:
        assert through_pipeline(supervisor, prompts) == expected[:3]
    first, second, after_restart = expected[0], expected[1], expected[3]
    assert second[2] < first[2]  # fewer encoder layer-tokens on the hit ...
    assert second[3] == first[3]  # ... and no encoder replay: the first request pooled the rings
    assert after_restart[3] > first[3]  # the pool does not survive a restart: the encoder replays
    threads = pipeline_for("thread", root / "threads")
    with Supervisor(threads, root / "run-threads") as supervisor:
        assert through_pipeline(supervisor, prompts) == expected[:3]
    with Supervisor(local, root / "run") as supervisor:  # a restarted pipeline, the same persistent store
        assert through_pipeline(supervisor, prompts[:1]) == expected[3:]


def test_epd_over_tcp_with_curve_keys(prompts, expected, root):
    generate_keys(root / "keys")
    pipeline = with_overrides(load_pipeline("epd"), model={"config": "micro", "seed": 3, "checkpoint": None},
                              store={"path": str(root / "kv"), "block_tokens": 16},
                              security={"keys_dir": str(root / "keys")})
    with Supervisor(pipeline, root / "run") as supervisor:
        assert through_pipeline(supervisor, prompts[:1]) == expected[:1]
        # a client whose own pair is valid but that trusts another server key: its call fails by its
        # deadline with a ComponentError (no handshake completes, nothing reaches the component),
        # and the pipeline goes on serving the clients that hold the right key
        wrong = root / "wrong-server-key"
        shutil.copytree(root / "keys", wrong)
        generate_keys(wrong, names=(SERVER,), overwrite=True)
        stranger = Peer(supervisor.endpoints["dspark"], "dspark", wrong, timeout_s=1.0)
        try:
            with pytest.raises(ComponentError) as refused:
                stranger.ping(timeout_s=1.0)
            assert refused.value.code == m.ErrorCode.UNAVAILABLE and refused.value.component == "dspark"
        finally:
            stranger.close()
        assert through_pipeline(supervisor, prompts[:1])[0][0] == expected[0][0]  # now from the prefix cache


def test_a_frozen_component_over_tcp_is_marked_down_and_its_request_fails(prompts, expected, root):
    """The encoder stopped by SIGSTOP keeps its TCP connections open but answers nothing: dspark's
    heartbeats drop the link and the request fails with the encoder named, long before the request
    deadline; a ping marks the encoder down (as `dsv41 status` does); once it resumes, the same
    pipeline serves again."""
    pipeline = with_overrides(load_pipeline("epd"), model={"config": "micro", "seed": 3, "checkpoint": None},
                              store={"path": str(root / "kv"), "block_tokens": 16},
                              generation={"request_timeout_s": 120.0})
    with Supervisor(pipeline, root / "run") as supervisor:
        assert through_pipeline(supervisor, prompts[:1]) == expected[:1]
        encoder = supervisor.pids()["encoder"]
        os.kill(encoder, signal.SIGSTOP)
        try:
            peer = supervisor.peer()
            try:
                with pytest.raises(ComponentError) as failed:
                    list(generate(peer, ids=prompts[2], max_new_tokens=NEW_TOKENS, stop_at_eos=False))
            finally:
                peer.close()
            assert failed.value.code == m.ErrorCode.UNAVAILABLE and "encoder" in str(failed.value)
            assert "disconnected" in str(failed.value)  # the heartbeat, not the 120 s deadline
            probe = supervisor.peer("encoder", timeout_s=1.0)
            try:
                with pytest.raises(ComponentError) as down:  # a new connection's handshake never completes
                    probe.ping(timeout_s=1.0)
                assert down.value.code == m.ErrorCode.UNAVAILABLE and "not reachable" in down.value.text
            finally:
                probe.close()
        finally:
            os.kill(encoder, signal.SIGCONT)
        assert supervisor.pids()["encoder"] == encoder  # resumed, not restarted
        supervisor.wait_ready("encoder", time.monotonic() + 30)  # it answers pings again: `dsv41 status` shows it up
        assert through_pipeline(supervisor, prompts[2:])[0][0] == expected[2][0]


def test_requests_in_flight_together_are_stepped_in_batches(prompts, root):
    """Four requests at once: their steps go out as batches of several (two batches in flight)."""
    with Supervisor(pipeline_for("process", root), root / "run") as supervisor:
        through_pipeline(supervisor, prompts[:1])  # a request first: dspark's connection to the decoder is up
        encoder = supervisor.peer("encoder")
        before = encoder.ping().counters
        clients = [supervisor.peer() for _ in range(4)]
        requests = [m.Generate(request_id=1000 + i, ids=m.pack_ids(ids), max_new_tokens=30, stop_at_eos=False)
                    for i, ids in enumerate(prompts + prompts[:1])]
        for client, request in zip(clients, requests, strict=True):
            client.send(request)
        for client, request in zip(clients, requests, strict=True):
            events = []
            while not isinstance((event := client.receive(request.request_id)[0]), m.Finished):
                events.append(event)
            assert len(events) == event.generated_tokens == 30
            client.close()
        after = encoder.ping().counters
        encoder.close()
    counters = {name: after[name] - before.get(name, 0) for name in after}
    assert counters["step_tokens"] == 4 * 29 and counters["batches"] < counters["step_tokens"]
    # with dspark's connection to the decoder up, the decoder answers every step directly
    assert counters["steps_answered_by_decoder"] == counters["batches"]
