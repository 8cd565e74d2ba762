"""Continuous batching in dspark: a long prompt is prefilled between the steps of a request that is
already decoding (asserted by the order of events), the tokens equal those of the requests served one
at a time, a request that finds no KV pages waits instead of failing, and a full queue refuses."""

from __future__ import annotations

import shutil
import threading
import time

import pytest
import torch

from dsv41 import messages as m
from dsv41.components.runtime import ComponentError
from dsv41.pipelines.client import generate
from dsv41.pipelines.launch import Supervisor, with_overrides
from tests.helpers.pipelines import pipeline_for, short_dir

pytestmark = pytest.mark.timeout(300)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SHORT, LONG = ids(20, 1), ids(400, 2)  # the long one is 25 prefill chunks of 16 tokens


def start(root, name: str, scheduling: dict | None = None, **options) -> Supervisor:
    """micro in threads; 4096-token blocks, so no prompt here is stored (a prefix hit's bounded
    replay would change the numbers of a repeated prompt)."""
    pipeline = with_overrides(pipeline_for("thread", root, block_tokens=4096, **options), name=name,
                              generation={"request_timeout_s": 60.0, "chunk_size": 16},
                              scheduling=scheduling or {})
    return Supervisor(pipeline, root / name).start()


def tokens_of(supervisor: Supervisor, prompt: list[int], n: int) -> list[int]:
    peer = supervisor.peer()
    try:
        return [e.token for e in generate(peer, ids=prompt, max_new_tokens=n, stop_at_eos=False)
                if isinstance(e, m.TokenEvent)]
    finally:
        peer.close()


def send_all(supervisor: Supervisor, prompts: list[list[int]], first_id: int, n: int) -> list[tuple]:
    """Send one greedy request per prompt at once, each on its own client: (peer, request) pairs."""
    sent = []
    for i, prompt in enumerate(prompts):
        peer, request = supervisor.peer(), m.Generate(request_id=first_id + i, ids=m.pack_ids(prompt),
                                                      max_new_tokens=n, stop_at_eos=False)
        peer.send(request)
        sent.append((peer, request))
    return sent


def assert_idle(supervisor: Supervisor) -> dict[str, int]:
    """Wait until dspark runs and queues nothing and the encoder and decoder hold no sequence or page
    (releases are sent without waiting, and the gauges are refreshed between messages); dspark's counters."""
    peers = {name: supervisor.peer(name) for name in ("dspark", "encoder", "decoder")}
    try:
        deadline = time.monotonic() + 30
        while True:
            counters = {name: peer.ping().counters for name, peer in peers.items()}
            if (counters["dspark"]["running"] == counters["dspark"]["waiting"] == 0
                    and all(counters[n]["sequences"] == counters[n]["pages_in_use"] == 0
                            for n in ("encoder", "decoder"))
                    and counters["encoder"].get("prefills_in_progress", 0) == 0):
                return counters["dspark"]
            assert time.monotonic() < deadline, counters
            time.sleep(0.05)
    finally:
        for peer in peers.values():
            peer.close()


def decoder_prefill(core, group: int, rid: int, prompt: list[int], step_follows: bool = False):
    """The `DecoderPrefill` the encoder sends for a `ced` prompt, computed by `core` in process, as
    the decoder receives it: (message, frames, the in-process sequence)."""
    seq, _ = core.new_sequence(prompt, len(prompt) + 8, packed=True)
    x, pre_mix, starts = core.encode_prompt(seq, torch.tensor([prompt]), False)
    entries, n, out = seq.cache.groups[group], len(prompt), m.Frames()
    request = m.DecoderPrefill(request_id=rid, length=n, capacity=seq.cache.capacity, starts=starts, kv_from=0,
                               main_kv=out.add(entries.main_kv.raw(slice(0, n))),
                               index_k=out.add(entries.index_k.raw(slice(0, n))), streams=out.add(x),
                               pre_mix=out.add(pre_mix), step_follows=step_follows)
    return *m.decode(m.encode(request, out)), seq


@pytest.fixture(scope="module")
def root():
    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_long_prompt_is_prefilled_between_the_steps_of_a_decoding_stream(root):
    supervisor = start(root, "interleave")
    log, lock, outputs = [], threading.Lock(), {}
    a_started = threading.Event()

    def run(name: str, prompt: list[int], n: int) -> None:
        peer = supervisor.peer()
        out = []
        try:
            for event in generate(peer, ids=prompt, max_new_tokens=n, stop_at_eos=False):
                if isinstance(event, m.TokenEvent):
                    out.append(event.token)
                    with lock:
                        log.append(name)
                    if name == "A" and len(out) == 2:
                        a_started.set()
        finally:
            peer.close()
        outputs[name] = out

    try:
        a = threading.Thread(target=run, args=("A", SHORT, 120))
        a.start()
        assert a_started.wait(60)
        with lock:
            log.append("B sent")
        b = threading.Thread(target=run, args=("B", LONG, 4))
        b.start()
        a.join(120)
        b.join(120)
        assert len(outputs["A"]) == 120 and len(outputs["B"]) == 4
        sent, b_first = log.index("B sent"), log.index("B")
        during = log[sent:b_first].count("A")
        # the 25 chunks of B's prompt leave room for about one step of A each; served without
        # interleaving, A would stall for the whole prefill (at most the step already in flight)
        assert during >= 8, log
        # some of B's chunks ran in the encoder passes of A's steps (a step that comes while a chunk
        # runs waits in the inbox, and takes the next chunk with it)
        encoder = supervisor.peer("encoder")
        assert encoder.ping().counters["chunks_beside_steps"] > 0
        encoder.close()
        assert_idle(supervisor)
        # one at a time, the same tokens (greedy)
        assert tokens_of(supervisor, SHORT, 120) == outputs["A"]
        assert tokens_of(supervisor, LONG, 4) == outputs["B"]
    finally:
        supervisor.stop()


def test_a_request_without_kv_pages_waits_for_one_to_finish(root):
    """Pools of 8 pages of 128 entries: a 400-token prompt takes 6 of the encoder's main KV pool; a
    second one waits in the queue (instead of failing with CAPACITY) and runs once the first has
    finished."""
    pages = {"encoder": {"kv_pages": 8}, "decoder": {"kv_pages": 8}}
    supervisor = start(root, "pages", **pages)
    try:
        peers = [supervisor.peer(), supervisor.peer()]
        requests = [m.Generate(request_id=7000 + i, ids=m.pack_ids(LONG if i == 0 else ids(400, 3)),
                               max_new_tokens=20, stop_at_eos=False) for i in range(2)]
        for peer, request in zip(peers, requests, strict=True):
            peer.send(request)
        order = []
        done = {}
        lock = threading.Lock()

        def read(peer, request):
            while not isinstance((event := peer.receive(request.request_id)[0]), m.Finished):
                with lock:
                    order.append(request.request_id)
            done[request.request_id] = event

        threads = [threading.Thread(target=read, args=pair) for pair in zip(peers, requests, strict=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert done[7000].generated_tokens == done[7001].generated_tokens == 20
        assert order == [7000] * 20 + [7001] * 20  # the second ran only after the first freed its pages
        dspark = supervisor.peer("dspark")
        counters = dspark.ping().counters
        dspark.close()
        assert counters["capacity_waits"] >= 1 and counters.get("failed_requests", 0) == 0
        for peer in peers:
            peer.close()
        # a prompt that can never fit fails at once instead of waiting forever
        with pytest.raises(ComponentError) as e:
            tokens_of(supervisor, ids(700, 4), 2)
        assert e.value.code == m.ErrorCode.CAPACITY
    finally:
        supervisor.stop()


def test_a_full_queue_refuses_and_a_release_cancels(root):
    supervisor = start(root, "queue", scheduling={"max_running": 1, "max_waiting": 1})
    try:
        peers = [supervisor.peer() for _ in range(3)]
        requests = [m.Generate(request_id=8000 + i, ids=m.pack_ids(SHORT), max_new_tokens=1000, stop_at_eos=False)
                    for i in range(3)]
        peers[0].send(requests[0])
        assert isinstance(peers[0].receive(8000)[0], m.TokenEvent)  # running
        peers[1].send(requests[1])  # waits: one running slot
        with pytest.raises(ComponentError) as e:
            peers[2].call(requests[2])
        assert e.value.code == m.ErrorCode.CAPACITY and "the queue is full: 1 requests wait" in e.value.text
        for rid, peer in ((8001, peers[1]), (8000, peers[0])):  # cancel the waiting one, then the running one
            peer.send(m.Release(request_id=rid))
            while not isinstance((event := peer.receive(rid)[0]), m.Finished):
                pass
            assert event.reason == m.FinishReason.CANCELLED
            assert isinstance(peer.receive(rid)[0], m.Ack)
        counters = assert_idle(supervisor)
        assert counters["cancelled"] == 2
        for peer in peers:
            peer.close()
    finally:
        supervisor.stop()


def test_prompts_prefilled_together_run_their_chunks_as_batches_and_equal_each_alone(root):
    """Four prompts sent at once: the encoder runs their chunks as batches (its counters show
    batches of several chunks), and each request's tokens are those it gets alone (greedy)."""
    supervisor = start(root, "prefill-batches")
    prompts = [ids(n, 20 + n) for n in (37, 50, 21, 64)]
    try:
        together = {}
        for peer, request in send_all(supervisor, prompts, 9000, 6):
            tokens = []
            while not isinstance((event := peer.receive(request.request_id)[0]), m.Finished):
                tokens.append(event.token)
            together[request.request_id] = tokens
            peer.close()
        encoder = supervisor.peer("encoder")
        counters = encoder.ping().counters
        encoder.close()
        assert counters["prefill_batched_chunks"] > counters["prefill_batches"] > 0, counters
        assert_idle(supervisor)
        for i, prompt in enumerate(prompts):
            assert tokens_of(supervisor, prompt, 6) == together[9000 + i], i
    finally:
        supervisor.stop()


def test_prompts_beside_a_decoding_request_take_one_chunk_and_one_replay_a_pass(root):
    """While a request decodes, prompts that arrive together are prefilled one chunk a pass in the
    encoder and replayed one at a time in the decoder (a decode step then waits on one chunk's or
    one replay's work, not on several prompts'); each request's tokens are those it gets alone."""
    supervisor = start(root, "beside-decoding")
    prompts = [ids(n, 60 + n) for n in (50, 45, 61)]
    try:
        encoder, decoder = supervisor.peer("encoder"), supervisor.peer("decoder")
        (peer, request), = send_all(supervisor, [SHORT], 9400, 160)
        first = []
        while len(first) < 2:
            first.append(peer.receive(request.request_id)[0].token)
        before = encoder.ping().counters, decoder.ping().counters
        joined = send_all(supervisor, prompts, 9401, 4)
        together = {}
        for other, sent in joined:
            tokens = []
            while not isinstance((event := other.receive(sent.request_id)[0]), m.Finished):
                tokens.append(event.token)
            together[sent.request_id] = tokens
            other.close()
        after = encoder.ping().counters, decoder.ping().counters
        while not isinstance(peer.receive(request.request_id)[0], m.Finished):
            pass
        peer.close()
        chunks, passes = (after[0][k] - before[0][k] for k in ("prefill_batched_chunks", "prefill_batches"))
        replays, replay_passes = (after[1][k] - before[1][k] for k in ("batched_replays", "replay_batches"))
        assert chunks == passes >= 3 * 3 and replays == replay_passes == 3, (before, after)
        encoder.close()
        decoder.close()
        assert_idle(supervisor)
        for i, prompt in enumerate(prompts):
            assert tokens_of(supervisor, prompt, 4) == together[9401 + i], i
    finally:
        supervisor.stop()


def test_decoder_replays_wait_for_the_inbox_and_a_release_answers_a_waiting_one(tmp_path):
    """The decoder holds `ced` replays while more messages wait in its inbox, then runs them as one
    batch: each answer has the logits of the same prefill in process. A Release of a held replay
    answers that prefill with an error and drops its sequence; a batch that fails answers each of
    its prefills with the error, and the decoder goes on."""
    from dsv41.components.context import ComponentContext
    from dsv41.components.decoder import DecoderComponent
    from dsv41.engine.core import InferenceCore

    decoder = DecoderComponent(ComponentContext(pipeline_for("thread", tmp_path), {}, tmp_path))
    inbox = [1]
    decoder.inbox_size = lambda: inbox[0]
    core = InferenceCore(decoder.core.model, chunk_size=16)
    prompts = {9100 + i: ids(n, 40 + n) for i, n in enumerate((23, 40, 17))}
    answers: dict[int, list] = {}

    def prefill(rid: int, prompt: list[int]) -> None:
        message, frames, _ = decoder_prefill(core, decoder.group, rid, prompt)
        decoder.handle(message, frames, lambda answer, out=None, rid=rid: answers.setdefault(rid, []).append(
            (answer, m.decode(m.encode(answer, out))[1])))

    for rid, prompt in prompts.items():
        prefill(rid, prompt)
    decoder.tick()
    assert not answers and len(decoder.replays) == 3  # more messages wait: the replays wait with them
    decoder.handle(m.Release(request_id=9101), [], lambda answer, out=None: answers.setdefault(9101, []).append(
        (answer, [])))
    error, ack = (answer for answer, _ in answers.pop(9101))
    assert error.code == m.ErrorCode.UNKNOWN_REQUEST and isinstance(ack, m.Ack)
    inbox[0] = 0
    assert decoder.tick()
    assert decoder.counters["replay_batches"] == 1 and decoder.counters["batched_replays"] == 2
    assert len(decoder.sequences) == 2
    for rid in (9100, 9102):
        (answer, frames), = answers[rid]
        _, want = core.prefill(prompts[rid], "ced", capacity=len(prompts[rid]) + 8, packed=True)
        assert torch.equal(m.tensor(answer.logits, frames)[-1], want)
    # a batch that fails answers each of its prefills with the error and drops their sequences
    real = decoder.core.decoder_replays
    decoder.core.decoder_replays = lambda replays: (_ for _ in ()).throw(RuntimeError("replay broke"))
    prefill(9103, prompts[9101])
    assert decoder.tick()
    (error, _), = answers[9103]
    assert error.code == m.ErrorCode.INTERNAL and "RuntimeError: replay broke" in error.text
    assert len(decoder.sequences) == 2 and decoder.counters["internal_errors"] == 1
    decoder.core.decoder_replays = real  # and the component goes on
    prefill(9104, prompts[9101])
    decoder.tick()
    (answer, frames), = answers[9104]
    _, want = core.prefill(prompts[9101], "ced", capacity=len(prompts[9101]) + 8, packed=True)
    assert torch.equal(m.tensor(answer.logits, frames)[-1], want)


def test_a_replay_the_encoder_sends_before_a_step_waits_for_it_and_runs_in_its_pass(tmp_path):
    """A `ced` replay marked `step_follows` is held even with an empty inbox until the batched step
    comes, then runs in that step's decoder pass: the prefill's logits and the step's are those of
    the same work in process. One whose step does not come within STEP_WAIT_S runs alone; if the
    shared pass fails, the replay's prefill and the step both get the error."""
    from dsv41.components.context import ComponentContext
    from dsv41.components.decoder import DecoderComponent
    from dsv41.engine.core import InferenceCore

    decoder = DecoderComponent(ComponentContext(pipeline_for("thread", tmp_path), {}, tmp_path))
    decoder.inbox_size = lambda: 0
    core = InferenceCore(decoder.core.model, chunk_size=16)
    answers: dict[int, list] = {}

    def answer_to(rid: int):
        return lambda answer, out=None: answers.setdefault(rid, []).append((answer, m.decode(m.encode(answer, out))[1]))

    def prefill(rid: int, prompt: list[int], step_follows: bool):
        message, frames, seq = decoder_prefill(core, decoder.group, rid, prompt, step_follows)
        decoder.handle(message, frames, answer_to(rid))
        return seq

    def step(batch_id: int, seq, rid: int, token: int):
        start = seq.cache.length
        x, pre_mix = core.encode_tokens_batch([seq], [[token]])
        out = m.Frames()
        request = m.DecoderBatchStep(request_id=batch_id, request_ids=[rid], starts=[start], sizes=[1],
                                     streams=out.add(x), pre_mix=out.add(pre_mix))
        decoder.handle(*m.decode(m.encode(request, out)), answer_to(batch_id))

    def expected_step(prompt: list[int], token: int) -> torch.Tensor:
        seq, _ = core.prefill(prompt, "ced", capacity=len(prompt) + 8, packed=True)
        return core.step(seq, [token])[-1]

    decoding, joining, late = ids(19, 71), ids(33, 72), ids(25, 73)
    seq = prefill(9200, decoding, step_follows=False)
    assert decoder.tick() and 9200 in answers  # not marked: with an empty inbox it runs at once
    prefill(9201, joining, step_follows=True)
    assert not decoder.tick() and 9201 not in answers  # held for the step that follows
    step(9202, seq, 9200, 7)
    assert decoder.counters["replays_beside_steps"] == 1
    (answer, frames), = answers[9201]
    _, want = core.prefill(joining, "ced", capacity=len(joining) + 8, packed=True)
    assert torch.equal(m.tensor(answer.logits, frames)[-1], want)
    (answer, frames), = answers[9202]
    assert answer.request_ids == [9200] and torch.equal(m.tensor(answer.logits, frames)[-1],
                                                        expected_step(decoding, 7))
    # a step none of whose requests can be stepped still ends the wait: the replay runs at the next turn
    prefill(9206, late, step_follows=True)
    out = m.Frames()
    empty = m.DecoderBatchStep(request_id=9207, request_ids=[4242], starts=[0], sizes=[1],
                               streams=out.add(torch.zeros(1, 1, 4, decoder.core.model.config.text_config.hidden_size,
                                                           dtype=torch.bfloat16)),
                               pre_mix=out.add(torch.zeros(1, 1, 4, dtype=torch.float32)))
    decoder.handle(*m.decode(m.encode(empty, out)), answer_to(9207))
    (answer, _), = answers[9207]
    assert answer.request_ids == [] and answer.errors[0].code == m.ErrorCode.UNKNOWN_REQUEST
    assert decoder.tick()
    (answer, frames), = answers[9206]
    _, want = core.prefill(late, "ced", capacity=len(late) + 8, packed=True)
    assert torch.equal(m.tensor(answer.logits, frames)[-1], want)
    # the step did not come in time: the replay runs alone
    prefill(9203, late, step_follows=True)
    decoder.replays[9203].step_due = time.monotonic() - 1
    assert decoder.tick()
    (answer, frames), = answers[9203]
    _, want = core.prefill(late, "ced", capacity=len(late) + 8, packed=True)
    assert torch.equal(m.tensor(answer.logits, frames)[-1], want)
    # a shared pass that fails fails the replay's prefill (its sequence dropped) and the step
    prefill(9204, joining, step_follows=True)
    real = decoder.core.decode_batch
    decoder.core.decode_batch = lambda *args: (_ for _ in ()).throw(RuntimeError("pass broke"))
    held = len(decoder.sequences)
    with pytest.raises(RuntimeError, match="pass broke"):  # (the runtime answers the step with it)
        step(9205, seq, 9200, 8)
    decoder.core.decode_batch = real
    (error, _), = answers[9204]
    assert error.code == m.ErrorCode.INTERNAL and "pass broke" in error.text
    assert len(decoder.sequences) == held - 1 and not decoder.replays


def test_decoding_requests_alternate_in_two_batches_in_flight_and_a_cancel_between_leaves_the_rest(root):
    """Four requests decoding at once are stepped as two batches in flight (dspark's counters show
    steps acted on while another was out); one cancelled after a few tokens ends with CANCELLED and
    frees its state, and the other three get the tokens they get alone (greedy)."""
    supervisor = start(root, "two-flights")
    prompts = [ids(n, 60 + n) for n in (19, 33, 26, 41)]
    try:
        sent, together, cancelled = send_all(supervisor, prompts, 9300, 24), {}, 9301
        for peer, request in sorted(sent, key=lambda pair: pair[1].request_id != cancelled):  # the cancelled first
            tokens = []
            while not isinstance((event := peer.receive(request.request_id)[0]), m.Finished):
                tokens.append(event.token)
                if request.request_id == cancelled and len(tokens) == 3:
                    peer.send(m.Release(request_id=cancelled))
            together[request.request_id] = (tokens, event.reason)
            if request.request_id == cancelled:
                assert isinstance(peer.receive(cancelled)[0], m.Ack)
            peer.close()
        tokens, reason = together.pop(cancelled)
        assert reason == m.FinishReason.CANCELLED and 3 <= len(tokens) < 24
        counters = assert_idle(supervisor)
        assert counters["steps_overlapped"] > 0 and counters["cancelled"] == 1, counters
        for i, prompt in enumerate(prompts):
            if 9300 + i in together:
                assert together[9300 + i] == (tokens_of(supervisor, prompt, 24), m.FinishReason.LENGTH), i
    finally:
        supervisor.stop()


def test_one_step_in_flight_puts_every_decoding_request_in_one_batch(root):
    supervisor = start(root, "one-flight", scheduling={"steps_in_flight": 1})
    prompts = [ids(n, 80 + n) for n in (12, 30, 22)]
    try:
        for peer, request in send_all(supervisor, prompts, 9400, 12):
            while not isinstance(peer.receive(request.request_id)[0], m.Finished):
                pass
            peer.close()
        counters = assert_idle(supervisor)
        encoder = supervisor.peer("encoder")
        stepped = encoder.ping().counters
        encoder.close()
        assert counters["steps_overlapped"] == 0, counters
        assert stepped["step_tokens"] == 3 * 11 and stepped["batches"] < stepped["step_tokens"], stepped
    finally:
        supervisor.stop()
