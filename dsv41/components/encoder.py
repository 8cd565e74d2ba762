"""encoder: layers 0..19 and the CED projection of the decoder's global KV.

Prefill: look up the longest stored prefix (kvstore), load its global KV, replay its last W tokens
through the encoder (SWA state), run the new tokens, store the new complete blocks, and hand the
decoder its global KV group plus the encoder output of the positions its replay starts from.
Decode: run the new tokens through layers 0..19 and pass the streams on. Any kvstore failure is a
cache miss (recompute), never a failed request.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import msgspec
import torch

from dsv41 import messages as m
from dsv41.components.context import ComponentContext
from dsv41.components.inflight import InFlight, Outcome, raise_error
from dsv41.components.limits import step_tokens
from dsv41.components.runtime import Component, ComponentError, Reply, new_request_id
from dsv41.components.sequences import Sequences, model_core, page_capacity
from dsv41.config import Part
from dsv41.engine.core import PromptChunk, Sequence
from dsv41.engine.prefix_cache import snapshot_position, span_extra
from dsv41.engine.speculative import hold_checkpoint, rewind
from dsv41.model.cache import export_blocks
from dsv41.model.vision import ImageSpan
from dsv41.storage.blockfmt import BlockLayout

LOOKUP_TIMEOUT_S = 5.0  # a lookup hashes the prompt and probes keys: slower means the store is in trouble
STORE_TIMEOUT_S = 30.0  # block reads and writes move up to hundreds of MB
DECODER_WAIT_S = 0.05  # an idle loop's wait for the decoder's replies; a message in the inbox ends it at once
PREFILL_BATCH = 4  # prompt chunks of different prefills run as one batch (each at most generation.chunk_size)
# ... while no request decodes: beside decoding requests a pass takes one chunk, so that their next step
# waits on at most one chunk's work (generation.chunk_size is the prefill's share of a step)


class EngramMailbox:
    """Prefetched Engram rows by request, filled by the I/O thread, taken by the compute loop."""

    def __init__(self, timeout_s: float, clock=time.monotonic):
        self.timeout_s, self.clock = timeout_s, clock
        self._rows: dict[int, list[tuple[int, torch.Tensor, float]]] = {}
        self._changed = threading.Condition()
        self._next_sweep = 0.0
        self.waited_s = 0.0
        self.last_lead_s = 0.0  # need time - arrival time of the latest take (negative: late)

    def __len__(self) -> int:
        """Requests whose rows are held."""
        return len(self._rows)

    def put(self, message: m.EngramRows, frames: list[memoryview]) -> None:
        rows = m.tensor(message.rows, frames)
        with self._changed:
            self._rows.setdefault(message.request_id, []).append((message.start, rows, self.clock()))
            self._changed.notify_all()

    def take(self, request_id: int, start: int, end: int) -> dict[int, torch.Tensor]:
        """Rows of positions start..end-1 by table index [1, s, n_cols, head_dim]; waits for them."""
        need, deadline = self.clock(), time.monotonic() + self.timeout_s
        with self._changed:
            while (found := self._find(request_id, start, end)) is None:
                if not self._changed.wait(deadline - time.monotonic()):
                    raise ComponentError(m.ErrorCode.UNAVAILABLE, "engram", f"rows for positions {start}..{end - 1} "
                                         f"did not arrive within {self.timeout_s:.0f} s")
        first, rows, arrived = found
        with self._changed:  # positions only move forward: rows that end before `start` are spent
            self._rows[request_id] = [r for r in self._rows.get(request_id, []) if r[0] + r[1].size(1) > start]
        self.waited_s += max(0.0, self.clock() - need)
        self.last_lead_s = need - arrived
        part = rows[:, start - first : end - first]
        return {i: part[i].unsqueeze(0) for i in range(part.size(0))}

    def _find(self, request_id: int, start: int, end: int):
        for first, rows, arrived in self._rows.get(request_id, []):
            if first <= start and end <= first + rows.size(1):
                return first, rows, arrived
        return None

    def drop(self, request_id: int) -> None:
        with self._changed:
            self._rows.pop(request_id, None)

    def sweep(self, live, max_age_s: float) -> int:
        """Drop the rows of requests that `live(request_id)` denies and whose rows all arrived over
        max_age_s ago (at most once a second): rows pushed after their request failed or was
        released, or for a prefill that never came, which nobody would ever take. Returns how many
        requests' rows were dropped."""
        now = self.clock()
        if now < self._next_sweep:
            return 0
        self._next_sweep = now + 1.0
        with self._changed:
            stale = [rid for rid, rows in self._rows.items()
                     if not live(rid) and now - max(r[2] for r in rows) > max_age_s]
            for rid in stale:
                del self._rows[rid]
        return len(stale)


@dataclass
class Job:
    """A prefill in progress: its steps (a generator), where its answer goes, and the work it waits on
    (a prompt chunk, or a `full` prefill's next chunk: None)."""

    steps: Iterator
    reply: Reply
    started: bool = False
    pending: PromptChunk | None = None


def _relay(answer: m.Logits | m.BatchLogits, frames: list[memoryview]):
    """The decoder's reply, its tensors in new frames to pass on (the received buffers are not kept)."""
    out = m.Frames()
    logits = out.add(m.tensor(answer.logits, frames))
    hidden = None if answer.main_hidden is None else out.add(m.tensor(answer.main_hidden, frames))
    return msgspec.structs.replace(answer, logits=logits, main_hidden=hidden), out


def _span_positions(spans: list[ImageSpan] | None) -> dict[str, list[int]]:
    """Where the image spans are, for the decoder's MoE gates (it needs no rows)."""
    return {"span_starts": [s.start for s in spans or ()], "span_lengths": [s.rows.size(0) for s in spans or ()]}


class EncoderComponent(Component):
    name = "encoder"
    accepts = frozenset({m.KIND.PREFILL, m.KIND.STEP, m.KIND.BATCH_STEP, m.KIND.RELEASE})
    early = frozenset({m.KIND.ENGRAM_ROWS})

    def __init__(self, context: ComponentContext):
        super().__init__()
        self.core = model_core(context, self.name)
        model = self.core.model
        plan = model.config.plan
        self.layers = {s.layer_id for s in plan.backbone if s.part is Part.ENCODER} | {plan.decoder_start}
        self.decoder_group = plan.decoder_start
        self.layout = BlockLayout.of(model.config, context.pipeline.store.block_tokens)
        self.limit = model.config.text_config.max_position_embeddings
        self.vocab_size, self.step_tokens = model.config.text_config.vocab_size, step_tokens(model.config)
        self.mailbox = EngramMailbox(float(context.option("engram", "rows_timeout_s", 5.0)))
        self.sequences = Sequences(context.pipeline.generation.request_timeout_s)
        # steps and prefills go on to the decoder without waiting: the encoder computes the next
        # chunk or step while the decoder computes, and passes each reply on when it comes
        self.decoder = InFlight(context.peer("decoder"), context.pipeline.generation.request_timeout_s)
        self.kvstore = context.peer("kvstore", timeout_s=STORE_TIMEOUT_S)
        # prefills in progress, oldest first: one batch of their chunks runs per turn of the loop, so
        # the steps of requests already decoding are served between the chunks of a long prompt
        self.jobs: dict[int, Job] = {}
        self.beside_step = False  # prefills resumed after a step's encoder pass, before its decoder half is sent
        self._full_jobs: set[int] = set()  # jobs whose chunks the decoder has seen

    def deliver(self, message: m.Message, frames: list[memoryview]) -> None:
        self.mailbox.put(message, frames)

    def handle(self, message: m.Message, frames: list[memoryview], reply: Reply) -> None:
        with page_capacity():
            match message:
                case m.Prefill():
                    if message.request_id in self.jobs or self._holds(message.request_id):
                        raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"request {message.request_id} already "
                                             "has a sequence")
                    spans = self._spans(message, frames)
                    self.jobs[message.request_id] = Job(self._prefill(message, reply, spans), reply)
                case m.Step():
                    self._step(message, reply)
                case m.BatchStep():
                    self._batch_step(message, reply)
                case m.Release():
                    self._release(message.request_id)
                    reply(m.Ack(request_id=message.request_id))

    # --- prefill ---------------------------------------------------------------------------------
    def _advance(self) -> bool:
        """Run the next work of the oldest prefill. Every new prefill is started first (its checks,
        prefix lookup and pages), so that its first chunk can join: the oldest prefill's prompt chunk
        runs as one batch with the chunks other prefills wait on (up to PREFILL_BATCH; a prefix
        replay alone), and a `full` prefill's next chunk alone. A prefill that fails is answered
        with its error and leaves no state behind. True if there was one."""
        if not self.jobs:
            return False
        for rid in [rid for rid, job in self.jobs.items() if not job.started]:
            self._resume(rid, None)
        if not self.jobs:
            return True
        rid, job = next(iter(self.jobs.items()))
        if job.pending is None:
            self._resume(rid, None)
            return True
        if self.inbox_size() and not job.pending.replay:
            return False  # a message waits (a batched step, mostly): the chunks join the step (`_batch_step`)
        batch = [rid]
        if not job.pending.replay and not self._decoding():
            batch += self._joining(PREFILL_BATCH - 1, but=rid)
        try:
            with torch.inference_mode(), page_capacity():
                results = self.core.encode_chunks([self.jobs[r].pending for r in batch])
        except Exception as e:  # noqa: BLE001 - the batch's prefills fail, the component goes on
            error = self.error_fields(e)
            for r in batch:
                self._fail_job(r, self.jobs[r].reply, *error)
            return True
        self.counters["prefill_batches"] += 1
        self.counters["prefill_batched_chunks"] += len(batch)
        for r, result in zip(batch, results, strict=True):
            self._resume(r, result)
        return True

    def _decoding(self) -> bool:
        """Whether some request decodes: a sequence held past its prefill (every prefill waiting
        here is started, and holds one, by the time a pass is put together)."""
        return len(self.sequences) > len(self.jobs)

    def _joining(self, count: int, but: int = 0) -> list[int]:
        """Up to `count` prefills (oldest first, other than `but`) whose next work is a prompt chunk
        that can run in a batch."""
        return [rid for rid, job in self.jobs.items() if rid != but and job.pending is not None
                and not job.pending.replay][:count]

    def _resume(self, rid: int, result) -> None:
        """Take a prefill on to the next work it waits on, giving it the result of the last."""
        job = self.jobs[rid]
        try:
            with torch.inference_mode(), page_capacity():
                job.started = True
                job.pending = job.steps.send(result)
        except StopIteration:
            self.jobs.pop(rid, None)
        except Exception as e:  # noqa: BLE001 - a failing prefill fails alone
            self._fail_job(rid, job.reply, *self.error_fields(e))

    def _holds(self, rid: int) -> bool:
        try:
            self.sequences.get(rid)
        except m.MessageError:
            return False
        return True

    def _fail_job(self, rid: int, reply: Reply, code: m.ErrorCode, component: str, text: str) -> None:
        """A failed prefill leaves no state: here, and in the decoder once a `full` prefill has sent it
        chunks (a `ced` prefill's decoder sequence is dropped there when its DecoderPrefill fails)."""
        if self._drop(rid) and rid in self._full_jobs:
            self._release(rid)
        self._full_jobs.discard(rid)
        reply(m.error_reply(rid, code, component, text))

    def _prefill(self, message: m.Prefill, reply: Reply,
                 spans: list[ImageSpan] | None = None) -> Iterator[PromptChunk | None]:
        """A prefill as a generator (the checks, the prefix lookup and the page reservation come
        first): it yields each prompt chunk for `_advance` to run, or None after each chunk of a
        `full` prefill (which runs its own), and replies when the decoder has answered.
        `spans`: the prompt's image spans (Engram rows are then looked up here: the engram component
        does not know which positions are dead)."""
        rid, ids = message.request_id, m.unpack_ids(message.ids, self.vocab_size)
        self._check_prompt(rid, ids, message.capacity)
        keys, blocks, snapshot = self._load_prefix(ids, spans) if message.mode == "ced" else ([], [], None)
        seq, cached = self.core.new_sequence(ids, message.capacity or None, True, blocks, self.layout, self.layers,
                                             spans)
        self.sequences.add(rid, seq)
        waited = self.mailbox.waited_s
        prefetched = message.engram_prefetch and not spans
        rows_for = (lambda start, end: self._rows(rid, start, end)) if prefetched else None

        def finish(answer: m.Logits) -> m.Logits:
            c = seq.counters
            self.counters.update(prefills=1, prompt_tokens=len(ids), cached_tokens=cached,
                                 encoder_layer_tokens=c.encoder_layer_tokens,
                                 replayed_layer_tokens=c.replayed_layer_tokens)
            return msgspec.structs.replace(
                answer, cached_tokens=cached, encoder_layer_tokens=c.encoder_layer_tokens,
                replayed_layer_tokens=c.replayed_layer_tokens + answer.replayed_layer_tokens, engram_wait_s=engram_wait)

        answered = functools.partial(self._pass_on, reply, rid, finish, functools.partial(self._fail_job, rid, reply))
        if message.mode == "full":
            outcome = yield from self._prefill_full(rid, seq, ids, rows_for, spans)
            engram_wait = self.mailbox.waited_s - waited
            self.jobs.pop(rid, None)
            self._full_jobs.discard(rid)
            answered(outcome)
            return
        snapshot_at = snapshot_position(len(ids), self.layout.block_tokens, cached) if keys else None
        request, out = yield from self._prefill_ced(rid, seq, ids, message.mode == "exact", cached, rows_for,
                                                    snapshot, snapshot_at, spans)
        engram_wait = self.mailbox.waited_s - waited
        self.decoder.send(msgspec.structs.replace(request, step_follows=self.beside_step), out, answered)
        self._store_blocks(seq, keys, len(blocks))  # while the decoder replays: off the first token's path
        self.jobs.pop(rid, None)

    def _check_prompt(self, rid: int, ids: list[int], capacity: int) -> None:
        if capacity > self.limit:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"capacity {capacity} is over the context limit of "
                                 f"{self.limit} positions")
        limit = capacity or self.limit
        if not ids or len(ids) > limit:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"a prompt of {len(ids)} tokens does not fit: it needs "
                                 f"1..{limit} tokens (the context limit)")

    def _prefill_ced(self, rid, seq: Sequence, ids: list[int], exact: bool, cached: int, rows_for, snapshot,
                     snapshot_at, spans: list[ImageSpan] | None = None):
        """The encoder's part of a `ced`/`exact` prefill; returns the decoder's part as a message."""
        x, pre_mix, starts = yield from self.core.encode_prompt_steps(seq, torch.tensor([ids]), exact, cached, rows_for,
                                                                      snapshot, snapshot_at, spans)
        group, n = seq.cache.groups[self.decoder_group], len(ids)
        out = m.Frames()
        request = m.DecoderPrefill(
            request_id=rid, length=n, capacity=seq.cache.capacity, starts=starts, kv_from=0,
            main_kv=out.add(group.main_kv.raw(slice(0, n))), index_k=out.add(group.index_k.raw(slice(0, n))),
            streams=out.add(x), pre_mix=out.add(pre_mix), **_span_positions(spans))
        return request, out

    def _prefill_full(self, rid, seq: Sequence, ids: list[int], rows_for, spans: list[ImageSpan] | None = None):
        """Every chunk through the encoder, then through the decoder (which computes its own KV);
        returns the decoder's reply to the last chunk."""
        for start in range(0, len(ids), self.core.chunk_size):
            if start:
                self._full_jobs.add(rid)
                yield None
            chunk = ids[start : start + self.core.chunk_size]
            fetch = functools.partial(rows_for, start, start + len(chunk)) if rows_for else None
            answer = self.decoder.call(*self._decoder_step(rid, seq, chunk, fetch, first=start == 0, spans=spans))
        return answer

    def _decoder_step(self, rid: int, seq: Sequence, tokens: list[int], fetch_rows, first: bool = False,
                      spans: list[ImageSpan] | None = None) -> tuple[m.DecoderStep, m.Frames]:
        """The encoder half of a step; returns the decoder's half as a message."""
        start = seq.cache.length
        x, pre_mix = self.core.encode_tokens(seq, tokens, fetch_rows, spans)
        out = m.Frames()
        request = m.DecoderStep(request_id=rid, start=start, streams=out.add(x), pre_mix=out.add(pre_mix),
                                capacity=seq.cache.capacity if first else 0, **_span_positions(spans))
        return request, out

    def _pass_on(self, reply: Reply, rid: int, finish, fail, outcome: Outcome) -> None:
        """Relay the decoder's reply to request `rid` (tensors in new frames, `finish`ed), or call
        `fail(code, component, text)` with the error that stands for it."""
        try:
            answer, out = _relay(*raise_error(outcome))
            answer = finish(answer)
        except Exception as e:  # noqa: BLE001 - a reply that cannot be passed on fails its request alone
            fail(*self.error_fields(e))
            return
        reply(answer, out)

    def _send_on(self, reply: Reply, request: m.Message, out: m.Frames, finish=lambda answer: answer) -> None:
        """Send the decoder's half of a step; its reply is passed on when it comes."""
        rid = m.request_id_of(request)
        self.decoder.send(request, out, functools.partial(
            self._pass_on, reply, rid, finish, lambda *error: reply(m.error_reply(rid, *error))))

    def _spans(self, message: m.Prefill, frames: list[memoryview]) -> list[ImageSpan] | None:
        """The prompt's image spans from the message (None: text only). Each must lie on image
        placeholder tokens of the prompt, in order, without overlapping."""
        if not message.spans and not message.span_starts:
            return None
        model = self.core.model
        if model.vision is None:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, "this model has no vision tower "
                                 "(vision_config.num_hidden_layers is 0); send text only")
        if len(message.spans) != len(message.span_starts):
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"{len(message.spans)} spans for "
                                 f"{len(message.span_starts)} span starts")
        ids, dim = m.unpack_ids(message.ids, self.vocab_size), model.config.text_config.hidden_size
        spans, end = [], 0
        for descriptor, start in zip(message.spans, message.span_starts, strict=True):
            rows = m.tensor(descriptor, frames)
            if rows.dtype != torch.bfloat16 or rows.dim() != 2 or rows.size(1) != dim or not rows.size(0):
                raise m.MessageError(m.ErrorCode.BAD_TENSOR, f"span rows of {descriptor.dtype} {descriptor.shape}; "
                                     f"expected bfloat16 [n, {dim}]")
            if start < end or start + rows.size(0) > len(ids) or \
                    any(t != model.config.image_token_id for t in ids[start : start + rows.size(0)]):
                raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"an image span at positions {start}.."
                                     f"{start + rows.size(0) - 1} does not lie on the prompt's image placeholders")
            spans.append(ImageSpan(start, rows))
            end = start + rows.size(0)
        return spans

    # --- the persistent prefix cache ---------------------------------------------------------------
    def _load_prefix(self, ids: list[int], spans: list[ImageSpan] | None = None) -> tuple[list[bytes], list[bytes],
                                                                                         bytes | None]:
        """The prompt's block keys, the payloads of its longest stored chain (leaving at least one
        token to run) and the pooled encoder rings at its end; a kvstore that fails or is gone
        gives nothing (and nothing is stored either). The keys cover the content of `spans`."""
        extra = span_extra(spans, self.layout.block_tokens) or {}
        image_keys = [m.ImageKey(block=block, key=key) for block, keys in extra.items() for key in keys]
        try:
            hit, frames = self.kvstore.call(m.Lookup(request_id=new_request_id(), ids=m.pack_ids(ids),
                                                     image_keys=image_keys), timeout_s=LOOKUP_TIMEOUT_S)
            usable = min(hit.cached_blocks, (len(ids) - 1) // self.layout.block_tokens)
            snapshot = bytes(frames[hit.snapshot.frame]) if hit.snapshot is not None and usable == hit.cached_blocks \
                else None
            if not usable:
                return hit.keys, [], None
            answer, frames = self.kvstore.call(m.GetBlocks(request_id=new_request_id(), keys=hit.keys[:usable]))
        except ComponentError:
            self.counters["store_unavailable"] += 1
            return [], [], None
        blocks = [bytes(frames[p.frame]) for p in answer.payloads]
        self.counters.update(hit_blocks=len(blocks), snapshot_hits=snapshot is not None)
        return hit.keys, blocks, snapshot if len(blocks) == usable else None

    def _store_blocks(self, seq: Sequence, keys: list[bytes], loaded: int) -> None:
        """Write the prompt's new complete blocks and the encoder rings at its last block boundary;
        a full or absent store only costs reuse."""
        if len(keys) <= loaded:
            return
        payloads = export_blocks(seq.cache, self.layout, loaded, len(keys) - loaded)
        out = m.Frames()
        descriptors = [out.add(torch.frombuffer(bytearray(p), dtype=torch.uint8)) for p in payloads]
        snapshot_key, snapshot = b"", None
        for position, rings in seq.snapshots.items():
            snapshot_key = keys[position // self.layout.block_tokens - 1]
            snapshot = out.add(torch.frombuffer(bytearray(rings), dtype=torch.uint8))
        try:
            stored, _ = self.kvstore.call(m.PutBlocks(request_id=new_request_id(), keys=keys[loaded:],
                                                      payloads=descriptors, snapshot_key=snapshot_key,
                                                      snapshot=snapshot), out)
        except ComponentError:
            self.counters["store_unavailable"] += 1
            return
        self.counters["stored_blocks"] += stored.stored
        self.counters["store_full"] += int(stored.full)

    # --- decode ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _step(self, message: m.Step, reply: Reply) -> None:
        seq, tokens, fetch = self._step_input(message)
        self._send_on(reply, *self._decoder_step(message.request_id, seq, tokens, fetch))
        self.counters.update(step_tokens=len(tokens), encoder_layer_tokens=len(tokens) * len(self.core.encoder))

    def _step_input(self, item: m.Step | m.StepItem) -> tuple[Sequence, list[int], functools.partial | None]:
        """The sequence, the new tokens and the prefetched-rows source of one request's step."""
        tokens = m.unpack_ids(item.ids, self.vocab_size)
        if len(tokens) > self.step_tokens:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"a step of {len(tokens)} tokens; a step carries "
                                 f"1..{self.step_tokens} (the last token and a drafted block)")
        seq = self.sequences.get(item.request_id)
        start = seq.cache.length if getattr(item, "start", -1) == -1 else item.start
        if not tokens or start + len(tokens) > seq.cache.capacity:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"{len(tokens)} tokens do not fit: "
                                 f"{start} of {seq.cache.capacity} positions used")
        try:
            rewind(seq, start)
        except ValueError as e:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, str(e)) from None
        hold_checkpoint(seq, getattr(item, "verify", False))
        with page_capacity():  # pages first: a full pool fails this request alone
            seq.cache.reserve(start + len(tokens), self.core.encoder_ids)
        fetch = functools.partial(self._rows, item.request_id, start, start + len(tokens)) if item.engram_prefetch \
            else None
        return seq, tokens, fetch

    @torch.inference_mode()
    def _batch_step(self, message: m.BatchStep, reply: Reply) -> None:
        """Step the batch's requests as one batch; a request that cannot be stepped is reported
        alone in `errors`, and the decoder's per-request errors are passed on."""
        rids, inputs, errors = [], [], []
        for item in message.items:
            try:
                if item.request_id in rids:
                    raise m.MessageError(m.ErrorCode.INVALID_REQUEST, "the same request twice in one batch")
                inputs.append(self._step_input(item))
                rids.append(item.request_id)
            except m.MessageError as e:
                errors.append(m.ItemError(request_id=item.request_id, code=e.code, component=self.name, text=str(e)))
        if not inputs:
            out = m.Frames()
            reply(m.BatchLogits(request_id=message.request_id, request_ids=[], sizes=[],
                                logits=out.add(torch.empty(0, dtype=torch.float32)), errors=errors), out)
            return
        seqs, tokens, fetches = (list(column) for column in zip(*inputs, strict=True))
        starts, sizes = [seq.cache.length for seq in seqs], [len(t) for t in tokens]
        verify = [seq.saved is not None for seq in seqs]
        x, pre_mix = self._encode_with_chunks(seqs, tokens, fetches)
        self.counters.update(batches=1, step_tokens=sum(sizes),
                             encoder_layer_tokens=sum(sizes) * len(self.core.encoder))
        out = m.Frames()
        request = m.DecoderBatchStep(request_id=message.request_id, request_ids=rids, starts=starts, sizes=sizes,
                                     streams=out.add(x), pre_mix=out.add(pre_mix), verify=verify if any(verify) else [])
        if message.reply_to:  # the decoder answers the caller itself, with these errors first
            self.decoder.peer.send(msgspec.structs.replace(request, errors=errors, reply_to=message.reply_to), out)
            self.counters["steps_answered_by_decoder"] += 1
            return
        self._send_on(reply, request, out, lambda answer: msgspec.structs.replace(
            answer, errors=errors + list(answer.errors)))

    def _encode_with_chunks(self, seqs: list[Sequence], tokens: list[list[int]], fetches: list):
        """A batched step's encoder half, with the oldest waiting prompt chunk in the same pass (one:
        a step's delay is bounded by one chunk's work); the prefills go on with their results (a
        finished one sends its decoder half). If the pass fails, those prefills fail with it."""
        joining = self._joining(1)  # a step always steps decoding requests
        try:
            results, stepped = self.core.encode_batch([self.jobs[r].pending for r in joining], seqs, tokens, fetches)
        except Exception as e:
            error = self.error_fields(e)
            for r in joining:
                self._fail_job(r, self.jobs[r].reply, *error)
            raise
        if joining:
            self.counters.update(prefill_batches=1, prefill_batched_chunks=len(joining),
                                 chunks_beside_steps=len(joining))
        self.beside_step = True
        try:
            for r, result in zip(joining, results, strict=True):
                self._resume(r, result)
        finally:
            self.beside_step = False
        return stepped

    def _rows(self, request_id: int, start: int, end: int) -> dict[int, torch.Tensor] | None:
        """Prefetched Engram rows, or None (look them up here) when they do not come in time:
        this process still holds the tables, so a slow or dead engram component costs time only."""
        try:
            rows = self.mailbox.take(request_id, start, end)
            lead_us = int(self.mailbox.last_lead_s * 1e6)  # > 0: the rows were there before they were needed
            self.counters.update(engram_rows_early=lead_us >= 0, engram_rows_late=lead_us < 0,
                                 engram_lead_us=max(lead_us, 0), engram_late_us=max(-lead_us, 0))
            return rows
        except ComponentError:
            self.counters["engram_fallbacks"] += 1
            return None

    def tick(self) -> bool:
        busy = self._advance()
        # relay what the decoder has answered; with nothing else to do, wait for it here until a
        # reply or a new message comes (the loop would otherwise sleep on its inbox alone)
        self.decoder.poll(0.0 if busy or self.inbox_size() else DECODER_WAIT_S, self.inbox_bell)
        busy = busy or len(self.decoder) > 0
        self.counters["prefills_in_progress"] = len(self.jobs)
        self.counters["idle_sequences_dropped"] += self.sequences.sweep()
        self.counters["engram_rows_dropped"] += self.mailbox.sweep(self.sequences.__contains__, self.sequences.idle_s)
        self.counters["sequences"], self.counters["pages_in_use"] = len(self.sequences), self.sequences.pages_in_use()
        self.counters["engram_rows_held"] = len(self.mailbox)
        return busy

    def _drop(self, request_id: int) -> bool:
        """Forget a request here (its prefill, sequence and Engram rows); True if it had a sequence."""
        job = self.jobs.pop(request_id, None)
        if job is not None:
            job.steps.close()
        held = self._holds(request_id)
        self.sequences.pop(request_id)
        self.mailbox.drop(request_id)
        return held

    def _release(self, request_id: int) -> None:
        self._drop(request_id)
        self._full_jobs.discard(request_id)
        self.mailbox.drop(request_id)
        try:
            self.decoder.send(m.Release(request_id=request_id), None, self._release_confirmed, timeout_s=5.0)
        except ComponentError:
            self.counters["release_unconfirmed"] += 1

    def _release_confirmed(self, outcome: Outcome) -> None:
        try:
            raise_error(outcome)
        except ComponentError:
            self.counters["release_unconfirmed"] += 1

    def close(self) -> None:
        self.decoder.peer.close()
        self.kvstore.close()
