"""Each component alone, as a real process and as a thread, with stand-ins for its peers.

The same tests run in both placements. Model outputs are compared bit for bit with the
in-process inference core on the same weights (the micro model: 8 layers, W = 8).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from dsv41 import messages as m
from dsv41.components.dspark import DSparkComponent
from dsv41.components.limits import pipeline_limits
from dsv41.components.runtime import ComponentError, Peer, new_request_id
from dsv41.config import load_config
from dsv41.engine.core import InferenceCore
from dsv41.model.pages import PAGE_ENTRIES
from dsv41.model.reference import random_model
from dsv41.model.tokenizer import BYTE_OFFSET, byte_tokenizer, encode
from dsv41.storage.blockfmt import BlockLayout
from dsv41.storage.store import GlobalKVStore
from tests.helpers.pipelines import StandIn, endpoints, pipeline_for, start_alone

pytestmark = pytest.mark.timeout(180)
STORE_WORKER = Path(__file__).parent / "helpers" / "store_worker.py"


@pytest.fixture(params=["thread", "process"])
def placement(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model():
    return random_model("micro", seed=3)


class Running:
    """A component started alone, its endpoints, and cleanup of everything the test opened."""

    def __init__(self, name: str, placement: str, root: Path, **options):
        self.pipeline = pipeline_for(placement, root, **options)
        self.runtime_dir = root / "run"
        self.endpoints = endpoints(self.pipeline, self.runtime_dir)
        self.stand_ins: list[StandIn] = []
        self.peers: list[Peer] = []
        self.name, self.child = name, None

    def stand_in(self, name: str, answer) -> StandIn:
        self.runtime_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        stand_in = StandIn(self.endpoints[name], answer)
        self.stand_ins.append(stand_in)
        return stand_in

    def start(self) -> Peer:
        self.child = start_alone(self.name, self.pipeline, self.runtime_dir)
        return self.peer()

    def peer(self) -> Peer:
        peer = Peer(self.endpoints[self.name], self.name, timeout_s=60)
        self.peers.append(peer)
        return peer

    def stop(self) -> None:
        for peer in self.peers:
            peer.close()
        if self.child is not None:
            self.child.stop(10)
        for stand_in in self.stand_ins:
            stand_in.close()


@pytest.fixture
def running(placement, root):
    started = []

    def start(name: str, **options) -> Running:
        started.append(Running(name, placement, root, **options))
        return started[-1]

    yield start
    for r in started:
        r.stop()


def _rid() -> int:
    return new_request_id()


def test_tokenizer_round_trip_refusals_and_shutdown(running, placement):
    r = running("tokenizer")
    peer = r.start()
    text = "Grüße, the quick brown fox ✓"
    reply, _ = peer.call(m.Tokenize(request_id=_rid(), text=text))
    ids = m.unpack_ids(reply.ids)
    assert ids == encode(byte_tokenizer(320), text)
    back, _ = peer.call(m.Detokenize(request_id=_rid(), ids=reply.ids))
    assert text in back.text
    with pytest.raises(ComponentError) as e:
        peer.call(m.Tokenize(request_id=_rid(), text="look", images=1))
    assert e.value.code == m.ErrorCode.INVALID_REQUEST and "vision" in e.value.text
    with pytest.raises(ComponentError) as e:  # a message this component does not take
        peer.call(m.Prefill(request_id=_rid(), ids=reply.ids))
    assert e.value.code == m.ErrorCode.UNEXPECTED
    assert peer.ping().counters["bad_messages"] == 1
    r.child.stop(10)
    if placement == "process":
        assert r.child.exit_code() == 0
        assert not (r.runtime_dir / "tokenizer.sock").exists()
        assert not (r.runtime_dir / "tokenizer.sock.lock").exists()


def test_kvstore_serves_lookups_reads_writes(running, root, model, rng):
    r = running("kvstore")
    peer = r.start()
    layout = BlockLayout.of(model.config, 16)
    ids = torch.randint(3, 300, (50,), generator=rng).tolist()
    hit, _ = peer.call(m.Lookup(request_id=_rid(), ids=m.pack_ids(ids)))
    assert (hit.cached_blocks, len(hit.keys), hit.block_tokens) == (0, 3, 16)
    payloads = [torch.randint(0, 256, (layout.payload_bytes,), dtype=torch.uint8, generator=rng) for _ in range(2)]
    out = m.Frames()
    put = m.PutBlocks(request_id=_rid(), keys=hit.keys[:2], payloads=[out.add(p) for p in payloads])
    stored, _ = peer.call(put, out)
    assert (stored.stored, stored.full) == (2, False)
    hit, _ = peer.call(m.Lookup(request_id=_rid(), ids=m.pack_ids(ids)))
    assert hit.cached_blocks == 2
    blocks, frames = peer.call(m.GetBlocks(request_id=_rid(), keys=hit.keys))
    assert len(blocks.payloads) == 2  # stops at the first missing block
    for descriptor, payload in zip(blocks.payloads, payloads, strict=True):
        assert torch.equal(m.tensor(descriptor, frames), payload)
    out = m.Frames()
    wrong = m.PutBlocks(request_id=_rid(), keys=hit.keys[2:], payloads=[out.add(torch.zeros(10, dtype=torch.uint8))])
    with pytest.raises(ComponentError) as e:
        peer.call(wrong, out)
    assert e.value.code == m.ErrorCode.INVALID_REQUEST and "payload" in e.value.text
    r.stop()
    with GlobalKVStore(root / "kv", layout, readonly=True) as store:
        assert store.verify() == []


def test_kvstore_answers_unavailable_while_every_reader_slot_is_taken(running, root, model, rng):
    """Another process holds every reader slot of the store: a lookup is answered UNAVAILABLE by name
    (the encoder then recomputes) instead of an internal error; once that process dies, lookups work."""
    r = running("kvstore")
    peer = r.start()
    ids = torch.randint(3, 300, (40,), generator=rng).tolist()
    holder = subprocess.Popen([sys.executable, str(STORE_WORKER), "hold", str(root / "kv")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().split()[0] == "holding"
        with pytest.raises(ComponentError) as e:
            peer.call(m.Lookup(request_id=_rid(), ids=m.pack_ids(ids)))
        assert e.value.code == m.ErrorCode.UNAVAILABLE and "reader slots" in e.value.text
    finally:
        holder.kill()
        holder.wait(30)
    hit, _ = peer.call(m.Lookup(request_id=_rid(), ids=m.pack_ids(ids)))
    assert hit.cached_blocks == 0 and len(hit.keys) == 2
    _wait_for(lambda: peer.ping().counters.get("store_reader_slots_freed", 0) >= 1)  # the dead holder's
    r.stop()


def test_engram_pushes_the_rows_the_model_would_look_up(running, model, rng):
    r = running("engram")
    pushed = r.stand_in("encoder", lambda message, frames: None)
    peer = r.start()
    ids = torch.randint(3, 300, (40,), generator=rng).tolist()
    peer.send(m.EngramPrefetch(request_id=7, ids=m.pack_ids(ids), offset=0, start=0))
    lookback = model.config.text_config.engram_max_ngram_size - 1
    window_start = 30
    peer.send(m.EngramPrefetch(request_id=8, ids=m.pack_ids(ids[window_start - lookback:]),
                               offset=window_start - lookback, start=window_start))
    _wait_for(lambda: len(pushed.received) == 2)
    row_ids = model.hasher(torch.tensor([ids]))
    tables = [model.layers[layer].engram.embed for layer in model.config.text_config.engram_layer_ids]
    for (message, frames), first in zip(pushed.received, (0, window_start), strict=True):
        rows = m.tensor(message.rows, [memoryview(f) for f in frames])
        assert message.start == first and rows.size(1) == len(ids) - first
        for index, table in enumerate(tables):
            assert torch.equal(rows[index], table(row_ids[0, first:, index]))
    with pytest.raises(ComponentError) as e:  # a window that misses the n-gram look-back
        peer.call(m.EngramPrefetch(request_id=9, ids=m.pack_ids(ids[35:]), offset=35, start=36))
    assert e.value.code == m.ErrorCode.INVALID_REQUEST
    with pytest.raises(ComponentError) as e:  # ids past the vocabulary (320) never reach the hasher
        peer.call(m.EngramPrefetch(request_id=10, ids=m.pack_ids([5, 320]), offset=0, start=0))
    assert (e.value.code, e.value.text) == (m.ErrorCode.INVALID_REQUEST, "token id 320 is out of range: ids must "
                                                                         "be in [0, 320) (the model's vocabulary)")


def _wait_for(condition, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def _encoded_prompt(model, ids: list[int]):
    core = InferenceCore(model, chunk_size=512)
    seq, _ = core.new_sequence(ids, len(ids) + 16, packed=True)
    x, pre_mix, starts = core.encode_prompt(seq, torch.tensor([ids]), exact=False)
    return core, seq, x, pre_mix, starts


def test_decoder_matches_the_in_process_decoder_half(running, model, rng):
    r = running("decoder")
    peer = r.start()
    ids = torch.randint(3, 300, (29,), generator=rng).tolist()
    core, seq, x, pre_mix, starts = _encoded_prompt(model, ids)
    group = seq.cache.groups[model.config.plan.decoder_start]
    out = m.Frames()
    prefill = m.DecoderPrefill(request_id=11, length=len(ids), capacity=seq.cache.capacity, starts=starts, kv_from=0,
                               main_kv=out.add(group.main_kv.raw(slice(0, 29))),
                               index_k=out.add(group.index_k.raw(slice(0, 29))),
                               streams=out.add(x), pre_mix=out.add(pre_mix))
    answer, frames = peer.call(prefill, out)
    expected = core.decoder_replay(seq, x, pre_mix, starts, len(ids))
    assert torch.equal(m.tensor(answer.logits, frames)[0], expected)
    token = int(expected.argmax())
    sx, spm = core.encode_tokens(seq, [token])
    expected_logits, expected_hidden = core.decode_streams(seq, sx, spm, len(ids))
    out = m.Frames()
    answer, frames = peer.call(m.DecoderStep(request_id=11, start=len(ids), streams=out.add(sx), pre_mix=out.add(spm)),
                               out)
    assert torch.equal(m.tensor(answer.logits, frames), expected_logits)
    assert torch.equal(m.tensor(answer.main_hidden, frames), expected_hidden)
    for rid, start, code in ((99, 0, m.ErrorCode.UNKNOWN_REQUEST), (11, 5, m.ErrorCode.INVALID_REQUEST)):
        out = m.Frames()
        with pytest.raises(ComponentError) as e:
            peer.call(m.DecoderStep(request_id=rid, start=start, streams=out.add(sx), pre_mix=out.add(spm)), out)
        assert e.value.code == code
    out = m.Frames()
    bad_kv = m.DecoderPrefill(request_id=12, length=29, capacity=64, starts=starts, kv_from=0,
                              main_kv=out.add(torch.zeros(29, 7)), index_k=out.add(group.index_k.raw(slice(0, 29))),
                              streams=out.add(x), pre_mix=out.add(pre_mix))
    with pytest.raises(ComponentError) as e:
        peer.call(bad_kv, out)
    assert e.value.code == m.ErrorCode.BAD_TENSOR
    held = 2 * -(-30 // PAGE_ENTRIES)  # request 11's 30 decoder entries, main KV and index keys; 12 kept nothing
    assert _gauges(peer, sequences=1, pages_in_use=held)
    assert peer.call(m.Release(request_id=11))[0] == m.Ack(request_id=11)
    assert _gauges(peer, sequences=0, pages_in_use=0)


def _gauges(peer, deadline_s: float = 5.0, **expected: int) -> bool:
    """Whether the component's gauges reach `expected` (they are refreshed between messages)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        counters = peer.ping().counters
        if all(counters.get(name) == value for name, value in expected.items()):
            return True
        time.sleep(0.02)
    print(f"gauges {counters}, expected {expected}")
    return False


def _prefill_message(rid: int, seq, x, pre_mix, starts, n: int, group: int):
    out = m.Frames()
    kv = seq.cache.groups[group]
    return m.DecoderPrefill(request_id=rid, length=n, capacity=seq.cache.capacity, starts=starts, kv_from=0,
                            main_kv=out.add(kv.main_kv.raw(slice(0, n))), index_k=out.add(kv.index_k.raw(slice(0, n))),
                            streams=out.add(x), pre_mix=out.add(pre_mix)), out


def test_decoder_steps_a_batch_like_the_in_process_batch(running, model, rng):
    r = running("decoder")
    peer = r.start()
    group, seqs = model.config.plan.decoder_start, {}
    for rid, n in ((31, 6), (32, 19)):
        ids = torch.randint(3, 300, (n,), generator=rng).tolist()
        core, seq, x, pre_mix, starts = _encoded_prompt(model, ids)
        peer.call(*_prefill_message(rid, seq, x, pre_mix, starts, n, group))
        core.decoder_replay(seq, x, pre_mix, starts, n)
        seqs[rid] = seq
    tokens = [[7], [8, 9]]
    starts = [seqs[31].cache.length, seqs[32].cache.length]
    x, pre_mix = core.encode_tokens_batch(list(seqs.values()), tokens)
    out = m.Frames()
    batch = m.DecoderBatchStep(request_id=40, request_ids=[31, 99, 32], starts=[starts[0], 0, starts[1]],
                               sizes=[1, 1, 2], streams=out.add(torch.cat([x[:, :1], x[:, :1], x[:, 1:]], dim=1)),
                               pre_mix=out.add(torch.cat([pre_mix[:, :1], pre_mix[:, :1], pre_mix[:, 1:]], dim=1)))
    lying = m.Frames()
    with pytest.raises(ComponentError) as e:  # sizes that do not match the streams
        peer.call(m.DecoderBatchStep(request_id=41, request_ids=[31, 32], starts=starts, sizes=[1, 5],
                                     streams=lying.add(x), pre_mix=lying.add(pre_mix)), lying)
    assert e.value.code == m.ErrorCode.BAD_TENSOR
    answer, frames = peer.call(batch, out)
    expected, hidden = core.decode_streams_batch(list(seqs.values()), x, pre_mix, starts, [1, 2])
    assert (answer.request_ids, answer.sizes) == ([31, 32], [1, 2])
    assert [(e.request_id, e.code) for e in answer.errors] == [(99, m.ErrorCode.UNKNOWN_REQUEST)]
    assert torch.equal(m.tensor(answer.logits, frames), torch.cat(expected))
    assert torch.equal(m.tensor(answer.main_hidden, frames), torch.cat(hidden))
    # a step with a reply route is answered on the connection it names, the encoder's errors first
    asker = Peer(r.endpoints["decoder"], "decoder", timeout_s=60, routing_id=b"dspark-test")
    r.peers.append(asker)
    _wait_for(asker.check_connection)
    starts = [seqs[31].cache.length, seqs[32].cache.length]
    x, pre_mix = core.encode_tokens_batch(list(seqs.values()), [[3], [4]])
    out = m.Frames()
    passed_on = m.ItemError(request_id=77, code=m.ErrorCode.UNKNOWN_REQUEST, component="encoder", text="unknown")
    peer.send(m.DecoderBatchStep(request_id=42, request_ids=[31, 32, 98], starts=[*starts, 0], sizes=[1, 1, 1],
                                 streams=out.add(torch.cat([x, x[:, :1]], dim=1)),
                                 pre_mix=out.add(torch.cat([pre_mix, pre_mix[:, :1]], dim=1)), errors=[passed_on],
                                 reply_to=b"dspark-test"), out)
    answer, frames = asker.receive(42)
    expected, _ = core.decode_streams_batch(list(seqs.values()), x, pre_mix, starts, [1, 1])
    assert (answer.request_ids, answer.sizes) == ([31, 32], [1, 1])
    assert [(e.request_id, e.component) for e in answer.errors] == [(77, "encoder"), (98, "decoder")]
    assert torch.equal(m.tensor(answer.logits, frames), torch.cat(expected))
    assert not peer.sock.poll(200)  # nothing came back on the connection that sent it


def test_a_full_page_pool_fails_only_the_request_that_needs_a_page(running, model, rng):
    """kv_pages = 2 per pool: a sequence of 127 positions and one of 5 fill both pools (one page of
    128 decoder entries each). A third prefill and a step that needs a second page get CAPACITY;
    the other request of that batch is stepped, and a released sequence's pages serve the next."""
    r = running("decoder", decoder={"kv_pages": 2})
    peer = r.start()
    group, seqs, core = model.config.plan.decoder_start, {}, None
    for rid, n in ((61, 127), (62, 5), (63, 9)):
        ids = torch.randint(3, 300, (n,), generator=rng).tolist()
        core, seq, x, pre_mix, starts = _encoded_prompt(model, ids)
        if rid == 63:
            with pytest.raises(ComponentError) as e:
                peer.call(*_prefill_message(rid, seq, x, pre_mix, starts, n, group))
            assert e.value.code == m.ErrorCode.CAPACITY and "page pool is full: 2 of 2 pages" in str(e.value)
            continue
        peer.call(*_prefill_message(rid, seq, x, pre_mix, starts, n, group))
        core.decoder_replay(seq, x, pre_mix, starts, n)
        seqs[rid] = seq
    assert _gauges(peer, sequences=2, pages_in_use=4)
    out = m.Frames()  # a `full` prefill's first chunk makes a new sequence: refused, it keeps none
    first_chunk = m.DecoderStep(request_id=63, start=0, capacity=32, streams=out.add(x[:, :4]),
                                pre_mix=out.add(pre_mix[:, :4]))
    with pytest.raises(ComponentError) as e:
        peer.call(first_chunk, out)
    assert e.value.code == m.ErrorCode.CAPACITY
    assert _gauges(peer, sequences=2, pages_in_use=4)
    starts = [seqs[61].cache.length, seqs[62].cache.length]
    x, pre_mix = core.encode_tokens_batch(list(seqs.values()), [[7, 8], [9]])
    out = m.Frames()
    answer, frames = peer.call(m.DecoderBatchStep(request_id=64, request_ids=[61, 62], starts=starts, sizes=[2, 1],
                                                  streams=out.add(x), pre_mix=out.add(pre_mix)), out)
    assert answer.request_ids == [62] and [(e.request_id, e.code) for e in answer.errors] == [
        (61, m.ErrorCode.CAPACITY)]
    expected, _ = core.decode_streams(seqs[62], x[:, 2:], pre_mix[:, 2:], starts[1])
    assert torch.equal(m.tensor(answer.logits, frames), expected)
    peer.call(m.Release(request_id=62))
    out = m.Frames()  # request 61's state did not move: its step now runs at the same position
    answer, frames = peer.call(m.DecoderStep(request_id=61, start=starts[0], streams=out.add(x[:, :2]),
                                             pre_mix=out.add(pre_mix[:, :2])), out)
    expected, _ = core.decode_streams(seqs[61], x[:, :2], pre_mix[:, :2], starts[0])
    assert torch.equal(m.tensor(answer.logits, frames), expected)
    assert _gauges(peer, sequences=1, pages_in_use=4)


def _logits_answer(vocab: int):
    def answer(message, frames):
        if isinstance(message, m.Release):
            return m.Ack(request_id=message.request_id), None
        out = m.Frames()
        if isinstance(message, m.DecoderBatchStep):
            return m.BatchLogits(request_id=message.request_id, request_ids=message.request_ids, sizes=message.sizes,
                                 logits=out.add(torch.zeros(sum(message.sizes), vocab))), out
        return m.Logits(request_id=message.request_id, logits=out.add(torch.zeros(1, vocab))), out
    return answer


def test_encoder_hands_the_decoder_the_in_process_encoder_output(running, model, rng):
    # no kvstore and no engram component run: every lookup is a miss, and rows that do not come are
    # looked up by the encoder itself; neither fails the request or changes its numbers
    r = running("encoder", engram={"rows_timeout_s": 0.2})
    decoder = r.stand_in("decoder", _logits_answer(320))
    peer = r.start()
    ids = torch.randint(3, 300, (37,), generator=rng).tolist()
    answer, _ = peer.call(m.Prefill(request_id=21, ids=m.pack_ids(ids), capacity=64))
    assert answer.cached_tokens == 0 and answer.encoder_layer_tokens == 37 * 4
    sent, frames = decoder.received[0]
    frames = [memoryview(f) for f in frames]
    core, seq, x, pre_mix, starts = _encoded_prompt(model, ids)
    group = seq.cache.groups[model.config.plan.decoder_start]
    assert sent.starts == starts and sent.length == 37
    assert torch.equal(m.tensor(sent.streams, frames), x) and torch.equal(m.tensor(sent.pre_mix, frames), pre_mix)
    assert torch.equal(m.tensor(sent.main_kv, frames), group.main_kv.raw(slice(0, 37)))
    assert torch.equal(m.tensor(sent.index_k, frames), group.index_k.raw(slice(0, 37)))
    peer.call(m.Step(request_id=21, ids=m.pack_ids([5]), engram_prefetch=True))
    step, frames = decoder.received[1]
    sx, _ = core.encode_tokens(seq, [5])
    assert step.start == 37 and torch.equal(m.tensor(step.streams, [memoryview(f) for f in frames]), sx)
    with pytest.raises(ComponentError) as e:
        peer.call(m.Step(request_id=22, ids=m.pack_ids([5])))
    assert e.value.code == m.ErrorCode.UNKNOWN_REQUEST
    with pytest.raises(ComponentError) as e:
        peer.call(m.Prefill(request_id=23, ids=m.pack_ids(ids * 200)))  # 7,400 tokens > the 4,096 limit
    assert e.value.code == m.ErrorCode.INVALID_REQUEST and "context limit" in e.value.text
    peer.call(m.Release(request_id=21))  # the encoder answers before the decoder's half is released
    _wait_for(lambda: isinstance(decoder.received[-1][0], m.Release))
    counters = peer.ping().counters
    assert counters["store_unavailable"] >= 1 and counters["engram_fallbacks"] == 1


def _token_12_encoder(seen: list):
    """A stand-in encoder that answers every prefill and batched step with token 12 (one-hot
    logits over `micro`'s 320 ids) and keeps each of those messages in `seen`."""

    def answer(message, frames):
        if isinstance(message, m.Release):
            return m.Ack(request_id=message.request_id), None
        seen.append(message)
        out = m.Frames()
        logits = torch.zeros(1, 320)
        logits[0, 12] = 1.0
        if isinstance(message, m.Prefill):
            return m.Logits(request_id=message.request_id, logits=out.add(logits)), out
        ids = [item.request_id for item in message.items]
        return m.BatchLogits(request_id=message.request_id, request_ids=ids, sizes=[1] * len(ids),
                             logits=out.add(logits.expand(len(ids), -1).contiguous())), out

    return answer


def test_dspark_names_its_decoder_connection_only_while_the_decoder_holds_it(running, placement):
    """A step names dspark's own connection to the decoder as its reply route only once the
    decoder holds it (an inproc connection counts as held from the start); until then the route
    is empty and the encoder passes the reply on. Either way the tokens come."""
    r = running("dspark", engram={"prefetch": False})
    r.stand_in("tokenizer", lambda message, frames: (
        m.Tokens(request_id=message.request_id, ids=m.pack_ids(list(message.text.encode()))), None))
    seen = []
    r.stand_in("encoder", _token_12_encoder(seen))  # answers every step itself, as a relaying encoder does
    peer = r.start()

    def generate(rid: int) -> list[bytes]:
        seen.clear()
        events = list(peer.stream(m.Generate(request_id=rid, prompt="hi", max_new_tokens=3)))
        assert [e.token for e in events[:-1]] == [12, 12, 12]
        return [message.reply_to for message in seen if isinstance(message, m.BatchStep)]

    if placement == "process":  # no decoder listens yet: nothing to route to
        assert generate(1) == [b"", b""]
    r.stand_in("decoder", lambda message, frames: None)
    deadline = time.monotonic() + 30
    while (named := generate(2)) != [named[0]] * 2 or not named[0]:
        assert time.monotonic() < deadline, f"the route never became dspark's own: {named}"
    assert named[0].startswith(b"dspark-") and len(named[0]) == len(b"dspark-") + 16


@pytest.mark.parametrize("placement", ["thread"], indirect=True)
def test_dspark_sends_the_next_step_before_a_landed_steps_tokens(running, monkeypatch):
    """When a reply lands, its requests' next step goes out before their tokens go to the clients
    (`_deliver`), so a step's round trip does not wait on them: the order on dspark's compute
    thread, recorded in process. The last token has no next step."""
    order = []
    send_step, deliver = DSparkComponent._send_step, DSparkComponent._deliver

    def recording_send_step(self):
        order.append("step")
        send_step(self)

    def recording_deliver(self):
        if self.outbox:
            order.append(("tokens", [token for _, token, _ in self.outbox]))
        deliver(self)

    monkeypatch.setattr(DSparkComponent, "_send_step", recording_send_step)
    monkeypatch.setattr(DSparkComponent, "_deliver", recording_deliver)
    r = running("dspark", engram={"prefetch": False})
    r.stand_in("tokenizer", lambda message, frames: (
        m.Tokens(request_id=message.request_id, ids=m.pack_ids(list(message.text.encode()))), None))
    r.stand_in("encoder", _token_12_encoder([]))
    peer = r.start()
    events = list(peer.stream(m.Generate(request_id=_rid(), prompt="hi", max_new_tokens=4, stop_at_eos=False)))
    assert [e.token for e in events[:-1]] == [12] * 4 and isinstance(events[-1], m.Finished)
    assert order == ["step", ("tokens", [12])] * 3 + [("tokens", [12])]


@pytest.mark.parametrize("prefetch_steps", [False, True])
def test_dspark_pushes_a_prompts_engram_rows_and_a_steps_only_when_asked(running, prefetch_steps):
    """dspark asks the engram component for a prompt's rows; a decode step's (one token's) only
    with `prefetch_steps`, and each step tells the encoder whether it did (otherwise the encoder
    looks the rows up itself, which costs less than the messages on a 2-core machine)."""
    r = running("dspark", engram={"prefetch_steps": prefetch_steps})
    r.stand_in("tokenizer", lambda message, frames: (
        m.Tokens(request_id=message.request_id, ids=m.pack_ids(list(message.text.encode()))), None))
    engram = r.stand_in("engram", lambda message, frames: None)
    seen = []
    r.stand_in("encoder", _token_12_encoder(seen))
    r.stand_in("decoder", lambda message, frames: None)
    peer = r.start()
    events = list(peer.stream(m.Generate(request_id=_rid(), prompt="hello", max_new_tokens=4)))
    assert [e.token for e in events[:-1]] == [12] * 4
    flags = [[message.engram_prefetch] if isinstance(message, m.Prefill) else
             [item.engram_prefetch for item in message.items] for message in seen]
    assert flags == [[True]] + [[prefetch_steps]] * 3
    _wait_for(lambda: len(engram.received) == 1 + 3 * prefetch_steps)
    asked = [message for message, _ in engram.received]
    assert all(isinstance(message, m.EngramPrefetch) for message in asked)
    assert [message.start for message in asked] == [0] + [5, 6, 7][: 3 * prefetch_steps]


def test_dspark_schedules_decoding_and_fails_requests_alone(running):
    r = running("dspark", engram={"prefetch": False})
    r.stand_in("tokenizer", lambda message, frames: (
        m.Tokens(request_id=message.request_id, ids=m.pack_ids(list(message.text.encode()))), None))
    steps, batches = [], []

    def one_hot() -> torch.Tensor:
        logits = torch.zeros(1, 320)
        logits[0, 10 + len(steps)] = 1.0  # the greedy choice: 11, 12, 13, ...
        return logits

    def encoder(message, frames):
        out = m.Frames()
        if isinstance(message, m.Release):
            return m.Ack(request_id=message.request_id), None
        if isinstance(message, m.Prefill):
            steps.append(message)
            return m.Logits(request_id=message.request_id, logits=out.add(one_hot()), cached_tokens=3), out
        batches.append(message)
        rows, stepped, errors = [], [], []
        for item in message.items:
            if m.unpack_ids(item.ids) == [42]:  # this request's step fails downstream, the others go on
                errors.append(m.ItemError(request_id=item.request_id, code=m.ErrorCode.UNAVAILABLE,
                                          component="decoder", text="gone"))
                continue
            steps.append(item)
            rows.append(one_hot())
            stepped.append(item.request_id)
        logits = torch.cat(rows) if rows else torch.empty(0, 320)
        return m.BatchLogits(request_id=message.request_id, request_ids=stepped, sizes=[1] * len(stepped),
                             logits=out.add(logits), errors=errors), out

    r.stand_in("encoder", encoder)
    peer = r.start()
    events = list(peer.stream(m.Generate(request_id=5, prompt="hello", max_new_tokens=3)))
    assert [e.token for e in events[:-1]] == [11, 12, 13]
    assert "".join(e.text for e in events[:-1]) == "\b\t\n"  # dspark's own detokenizer: ids 11..13 are bytes 8..10
    done = events[-1]
    assert (done.reason, done.prompt_tokens, done.generated_tokens, done.cached_tokens) == \
        (m.FinishReason.LENGTH, 5, 3, 3)
    assert isinstance(steps[0], m.Prefill) and m.unpack_ids(steps[0].ids) == list(b"hello")
    with pytest.raises(ComponentError) as e:
        list(peer.stream(m.Generate(request_id=6, ids=m.pack_ids([42]), max_new_tokens=4096)))
    assert e.value.code == m.ErrorCode.INVALID_REQUEST and "context limit" in e.value.text
    with pytest.raises(ComponentError) as e:
        list(peer.stream(m.Generate(request_id=9, ids=m.pack_ids([5, 1 << 20]))))
    assert (e.value.code, e.value.component) == (m.ErrorCode.INVALID_REQUEST, "dspark")
    assert "token id 1048576 is out of range: ids must be in [0, 320)" in e.value.text
    steps.clear()
    steps.extend([None] * 31)  # the prefill makes 42 the greedy token: its step fails downstream
    with pytest.raises(ComponentError) as e:
        list(peer.stream(m.Generate(request_id=7, prompt="hi", max_new_tokens=5)))
    assert (e.value.code, e.value.component) == (m.ErrorCode.UNAVAILABLE, "decoder")
    events = list(peer.stream(m.Generate(request_id=8, prompt="ok", max_new_tokens=1)))
    assert events[-1].reason == m.FinishReason.LENGTH  # the failed request failed alone
    batches.clear()
    four = [r.peer() for _ in range(4)]  # four requests in flight: two batches of two out at once
    for rid, client in enumerate(four, start=20):
        client.send(m.Generate(request_id=rid, prompt="ab", max_new_tokens=8))
    for rid, client in enumerate(four, start=20):
        while not isinstance(client.receive(rid)[0], m.Finished):
            pass
    assert max(len(b.items) for b in batches) == 2
    assert peer.ping().counters["steps_overlapped"] > 0


def test_encoder_steps_a_batch_and_reports_the_requests_it_cannot_step(running, model, rng):
    r = running("encoder")
    decoder = r.stand_in("decoder", _logits_answer(320))
    peer = r.start()
    seqs, core = [], None
    for rid, n in ((51, 9), (52, 30)):
        ids = torch.randint(3, 300, (n,), generator=rng).tolist()
        peer.call(m.Prefill(request_id=rid, ids=m.pack_ids(ids), capacity=64))
        core, seq, *_ = _encoded_prompt(model, ids)
        seqs.append(seq)
    items = [m.StepItem(request_id=51, ids=m.pack_ids([4])), m.StepItem(request_id=77, ids=m.pack_ids([4])),
             m.StepItem(request_id=52, ids=m.pack_ids([5, 6])), m.StepItem(request_id=51, ids=m.pack_ids([9]))]
    answer, _ = peer.call(m.BatchStep(request_id=60, items=items))
    assert (answer.request_ids, answer.sizes) == ([51, 52], [1, 2])
    assert [(e.request_id, e.code, e.component) for e in answer.errors] == [
        (77, m.ErrorCode.UNKNOWN_REQUEST, "encoder"), (51, m.ErrorCode.INVALID_REQUEST, "encoder")]
    sent, frames = decoder.received[-1]
    x, pre_mix = core.encode_tokens_batch(seqs, [[4], [5, 6]])
    frames = [memoryview(f) for f in frames]
    assert (sent.request_ids, sent.starts, sent.sizes) == ([51, 52], [9, 30], [1, 2])
    assert torch.equal(m.tensor(sent.streams, frames), x) and torch.equal(m.tensor(sent.pre_mix, frames), pre_mix)
    assert (sent.errors, sent.reply_to) == ([], b"")  # the encoder adds its errors to the reply it passes on
    # with a reply route the decoder answers the caller: the encoder sends its errors along, answers nothing
    items = [m.StepItem(request_id=51, ids=m.pack_ids([7])), m.StepItem(request_id=78, ids=m.pack_ids([4]))]
    peer.send(m.BatchStep(request_id=61, items=items, reply_to=b"dspark-1"))
    _wait_for(lambda: decoder.received[-1][0].request_id == 61)
    sent = decoder.received[-1][0]
    assert (sent.request_ids, sent.reply_to) == ([51], b"dspark-1")
    assert [(e.request_id, e.code, e.component) for e in sent.errors] == [(78, m.ErrorCode.UNKNOWN_REQUEST, "encoder")]
    assert not peer.sock.poll(200)
    assert peer.ping().counters["steps_answered_by_decoder"] == 1


def test_encoder_refuses_ids_steps_and_capacities_out_of_range_before_computing(running):
    r = running("encoder")
    decoder = r.stand_in("decoder", _logits_answer(320))
    peer = r.start()
    refused = [
        (m.Prefill(request_id=70, ids=m.pack_ids([5, 320])), "token id 320 is out of range: ids must be in [0, 320)"),
        (m.Prefill(request_id=71, ids=m.pack_ids([5]), capacity=4097), "capacity 4097 is over the context limit of "
                                                                        "4096 positions"),
        (m.Step(request_id=72, ids=(-3).to_bytes(4, "little", signed=True)), "token id -3 is out of range"),
        (m.Step(request_id=73, ids=m.pack_ids([4] * 6)), "a step of 6 tokens; a step carries 1..5"),  # block 4
    ]
    for message, text in refused:
        with pytest.raises(ComponentError) as e:
            peer.call(message)
        assert (e.value.code, e.value.component) == (m.ErrorCode.INVALID_REQUEST, "encoder")
        assert text in e.value.text
    answer, _ = peer.call(m.BatchStep(request_id=74, items=[m.StepItem(request_id=75, ids=m.pack_ids([999]))]))
    assert [(e.request_id, e.code) for e in answer.errors] == [(75, m.ErrorCode.INVALID_REQUEST)]
    counters = peer.ping().counters
    assert counters.get("internal_errors", 0) == 0 and decoder.received == []


def test_tokenizer_bounds_what_a_hostile_sender_costs(running, placement):
    """Micro's context is 4096 tokens: the tokenizer's socket takes 80 KiB (a 16 KiB text plus the
    msgpack allowance), a Ping 64 KiB; anything bigger costs the sender its connection (ipc) or gets
    an error reply, and the tokenizer's memory stays flat."""
    r = running("tokenizer")
    peer = r.start()
    with pytest.raises(ComponentError) as e:
        peer.call(m.Detokenize(request_id=_rid(), ids=m.pack_ids([65, 320])))
    assert (e.value.code, e.value.text) == (m.ErrorCode.INVALID_REQUEST, "token id 320 is out of range: ids must "
                                                                         "be in [0, 320) (the model's vocabulary)")
    with pytest.raises(ComponentError) as e:  # fits the socket, cannot fit the context: refused before encoding
        peer.call(m.Tokenize(request_id=_rid(), text="é" * 4097))
    assert e.value.code == m.ErrorCode.INVALID_REQUEST and "4097 characters cannot fit the context of 4096" in \
        e.value.text
    limits = pipeline_limits(load_config("micro"), r.pipeline)
    caller = Peer(r.endpoints["tokenizer"], "tokenizer", limits=limits)
    r.peers.append(caller)
    with pytest.raises(ComponentError) as e:  # refused by the caller before it is sent
        caller.call(m.Tokenize(request_id=_rid(), text="x" * (100 << 10)))
    assert e.value.code == m.ErrorCode.TOO_LARGE and "over the 81920 bytes" in e.value.text

    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    monitor = raw.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        raw.connect(r.endpoints["tokenizer"])
        raw.send_multipart([bytes([m.KIND.PING]), b"\x00" * (70 << 10)])  # under the socket's cap, over a Ping's
        assert raw.poll(10_000), "no reply to an oversized Ping"
        error, _ = m.decode(raw.recv_multipart())
        assert error.code == m.ErrorCode.TOO_LARGE
        assert error.text == f"a Ping of {1 + (70 << 10)} bytes is over the 65536 bytes any legitimate one takes"
        huge = [bytes([m.KIND.TOKENIZE]), b"\xa5" * (64 << 20)]  # 64 MiB: over the socket's cap
        if placement == "thread":  # inproc moves messages without a size check: the decode limit answers
            raw.send_multipart(huge)
            assert raw.poll(10_000), "no reply to an oversized Tokenize"
            assert m.decode(raw.recv_multipart())[0].code == m.ErrorCode.TOO_LARGE
        else:
            before = _peak_rss(r.child.pid)
            raw.send_multipart(huge)
            assert monitor.poll(10_000), "the oversized sender was not disconnected"
            assert parse_monitor_message(monitor.recv_multipart())["event"] == zmq.EVENT_DISCONNECTED
            assert _peak_rss(r.child.pid) - before < 16 << 20  # refused from its size header, never received
    finally:
        raw.disable_monitor()
        monitor.close(0)
        raw.close(0)
    reply, _ = peer.call(m.Tokenize(request_id=_rid(), text="still here"))
    assert m.unpack_ids(reply.ids) == encode(byte_tokenizer(320), "still here")


def _peak_rss(pid: int) -> int:
    """Peak resident memory of a process, in bytes (VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for process {pid}")


def test_dspark_streams_text_whole_characters(running):
    """Byte tokens of the stand-in tokenizer: a character split over tokens is shown once complete."""
    r = running("dspark", engram={"prefetch": False})
    r.stand_in("tokenizer", lambda message, frames: (
        m.Tokens(request_id=message.request_id, ids=m.pack_ids(encode(byte_tokenizer(320), message.text))), None))
    planned = [BYTE_OFFSET + b for b in "é✓ok".encode()]  # 2 + 3 + 1 + 1 bytes

    def encoder(message, frames):
        if isinstance(message, m.Release):
            return m.Ack(request_id=message.request_id), None
        out = m.Frames()
        logits = torch.zeros(1, 320)
        logits[0, planned.pop(0)] = 1.0
        if isinstance(message, m.Prefill):
            return m.Logits(request_id=message.request_id, logits=out.add(logits)), out
        item = message.items[0]
        return m.BatchLogits(request_id=message.request_id, request_ids=[item.request_id], sizes=[1],
                             logits=out.add(logits)), out

    r.stand_in("encoder", encoder)
    peer = r.start()
    events = list(peer.stream(m.Generate(request_id=3, prompt="x", max_new_tokens=7, stop_at_eos=False)))
    assert [e.text for e in events[:-1]] == ["", "é", "", "", "✓", "o", "k"]


def test_dspark_admits_a_request_that_comes_while_a_step_is_out(running):
    """A request that comes while dspark waits for a step's reply is admitted then: its prefill
    reaches the encoder before that step is answered (the stand-in answers the step only after
    it), and both requests finish. Waiting on the step alone, dspark would wait until the step's
    deadline."""
    r = running("dspark", engram={"prefetch": False})
    r.stand_in("tokenizer", lambda message, frames: (
        m.Tokens(request_id=message.request_id, ids=m.pack_ids(list(message.text.encode()))), None))
    order, held = [], []

    def rows(n: int) -> torch.Tensor:
        logits = torch.zeros(n, 320)
        logits[:, 11] = 1.0
        return logits

    def answer_step(step: m.BatchStep):
        out, ids = m.Frames(), [item.request_id for item in step.items]
        return m.BatchLogits(request_id=step.request_id, request_ids=ids, sizes=[1] * len(ids),
                             logits=out.add(rows(len(ids)))), out

    def encoder(message, frames):
        if isinstance(message, m.Release):
            return m.Ack(request_id=message.request_id), None
        if isinstance(message, m.Prefill):
            order.append("prefill")
            out = m.Frames()
            prefilled = m.Logits(request_id=message.request_id, logits=out.add(rows(1)), cached_tokens=0), out
            return [prefilled, answer_step(held.pop())] if held else prefilled
        order.append("step")
        if order == ["prefill", "step"]:  # the first step waits for the second request's prefill
            held.append(message)
            return None
        return answer_step(message)

    r.stand_in("encoder", encoder)
    r.start()
    first, second = r.peer(), r.peer()
    first.send(m.Generate(request_id=30, prompt="ab", max_new_tokens=3))
    deadline = time.monotonic() + 30
    while order != ["prefill", "step"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert order == ["prefill", "step"]
    second.send(m.Generate(request_id=31, prompt="cd", max_new_tokens=3))
    for rid, client in ((30, first), (31, second)):
        events = []
        while not events or not isinstance(events[-1], m.Finished):
            events.append(client.receive(rid)[0])
        assert [e.token for e in events[:-1]] == [11, 11, 11]
        assert events[-1].reason == m.FinishReason.LENGTH
    assert order[:3] == ["prefill", "step", "prefill"]
