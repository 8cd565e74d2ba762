"""decoder: layers 20..39 and the head.

A `ced`/`exact` prefill arrives as the decoder group's global KV (packed entries projected by the
encoder) plus the encoder output from where the decoder replay starts; decode steps and
verification arrive as the encoder output of the new tokens. Returns logits and, for steps,
DSpark's input (mean over hc copies of the streams entering the target layers). The replays of
`ced` prefills that arrive together run as one batch, and in the pass of a batched step when one
comes while they wait (each gets the bits it gets alone).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from dsv41 import messages as m
from dsv41.components.context import ComponentContext
from dsv41.components.runtime import Component, Reply
from dsv41.components.sequences import Sequences, model_core, page_capacity
from dsv41.config import Part
from dsv41.engine.core import Replay, Sequence
from dsv41.engine.speculative import hold_checkpoint, rewind
from dsv41.model.cache import DecodeCache
from dsv41.model.vision import ImageSpan

REPLAY_BATCH = 4  # `ced` decoder replays run as one batch (the encoder batches as many prompts' chunks)
# while no request decodes; a batched step takes one, so that its delay is one replay's work
STEP_WAIT_S = 0.5  # the longest a replay waits for the batched step the encoder said follows it


@dataclass
class WaitingReplay:
    replay: Replay
    reply: Reply
    step_due: float = 0.0  # until then it waits for the step that follows it (monotonic time; 0: none)


def _spans(message: m.DecoderPrefill | m.DecoderStep) -> list[ImageSpan] | None:
    """The prompt's image spans as positions only (rows of width 0): the decoder needs them for
    bias_vl in its MoE gates, never their embeddings."""
    if len(message.span_starts) != len(message.span_lengths):
        raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"{len(message.span_starts)} span starts for "
                             f"{len(message.span_lengths)} span lengths")
    return [ImageSpan(start, torch.empty(n, 0)) for start, n in zip(message.span_starts, message.span_lengths,
                                                                    strict=True)] or None


class DecoderComponent(Component):
    name = "decoder"
    accepts = frozenset({m.KIND.DECODER_PREFILL, m.KIND.DECODER_STEP, m.KIND.DECODER_BATCH_STEP, m.KIND.RELEASE})
    routed = frozenset({m.KIND.DECODER_BATCH_STEP})  # answered to the scheduler that asked, past the encoder

    def __init__(self, context: ComponentContext):
        super().__init__()
        self.core = model_core(context, self.name)
        plan = self.core.model.config.plan
        self.layers = {s.layer_id for s in plan.backbone if s.part is Part.DECODER}
        self.group = plan.decoder_start
        self.limit = self.core.model.config.text_config.max_position_embeddings
        self.sequences = Sequences(context.pipeline.generation.request_timeout_s)
        # `ced` prefills whose replay has not run: they wait while more messages are in the inbox
        # (the encoder sends the prefills of one batch of prompt chunks together), then run as one
        # batch, or in the next batched step's pass
        self.replays: dict[int, WaitingReplay] = {}

    @torch.inference_mode()
    def handle(self, message: m.Message, frames: list[memoryview], reply: Reply) -> None:
        with page_capacity():
            match message:
                case m.DecoderPrefill():
                    self._prefill(message, frames, reply)
                case m.DecoderStep():
                    reply(*self._step(message, frames))
                case m.DecoderBatchStep():
                    reply(*self._batch_step(message, frames))
                case m.Release():
                    waiting = self.replays.pop(message.request_id, None)
                    if waiting is not None:
                        waiting.reply(m.error_reply(message.request_id, m.ErrorCode.UNKNOWN_REQUEST, self.name,
                                                 "released before its prefill's replay ran"))
                    self.sequences.pop(message.request_id)
                    reply(m.Ack(request_id=message.request_id))

    @contextmanager
    def _new_sequence(self, rid: int, capacity: int) -> Iterator[Sequence]:
        """A sequence for a request's first message; if that message fails, the sequence and its
        pages are dropped, so the request can be sent again."""
        if capacity > self.limit:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"capacity {capacity} is over the context limit of "
                                 f"{self.limit} positions")
        seq = Sequence(DecodeCache.allocate(self.core.model.config, 1, capacity, packed=True, layers=self.layers,
                                            pools=self.core.pools))
        self.sequences.add(rid, seq)
        try:
            yield seq
        except BaseException:
            self.sequences.pop(rid)
            raise

    def tick(self) -> bool:
        now = time.monotonic()
        held = any(waiting.step_due > now for waiting in self.replays.values())  # its step comes next
        ran = bool(self.replays) and not held and (len(self.replays) >= REPLAY_BATCH or not self.inbox_size())
        if ran:
            self._replay()
        self.counters["idle_sequences_dropped"] += self.sequences.sweep()
        self.counters["sequences"], self.counters["pages_in_use"] = len(self.sequences), self.sequences.pages_in_use()
        return ran or (bool(self.replays) and not held)

    def _prefill(self, message: m.DecoderPrefill, frames: list[memoryview], reply: Reply) -> None:
        """A prefill's sequence and global KV now; its replay runs now when its layers start at
        different positions (`exact`), else with the other replays waiting (`tick`)."""
        n = message.length
        if len(message.starts) != len(self.core.decoder) or not 0 < n <= message.capacity:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"{len(message.starts)} layer starts for "
                                 f"{len(self.core.decoder)} layers, length {n}, capacity {message.capacity}")
        with self._new_sequence(message.request_id, message.capacity) as seq:
            group = seq.cache.groups[self.group]
            for store, descriptor in ((group.main_kv, message.main_kv), (group.index_k, message.index_k)):
                rows = m.tensor(descriptor, frames)
                if rows.dtype != store.pool.dtype or rows.shape != (n, store.pool.width):
                    raise m.MessageError(m.ErrorCode.BAD_TENSOR, f"global KV of {descriptor.dtype} "
                                         f"{descriptor.shape}; expected uint8 [{n}, {store.pool.width}]")
                store.put_raw(0, rows)
            x, pre_mix = m.tensor(message.streams, frames), m.tensor(message.pre_mix, frames)
            replay = Replay(seq, x, pre_mix, list(message.starts), n, _spans(message))
            if len(set(message.starts)) == 1:
                due = time.monotonic() + STEP_WAIT_S if message.step_follows else 0.0
                self.replays[message.request_id] = WaitingReplay(replay, reply, due)
                return
            targets: list[torch.Tensor] = []
            logits = self.core.decoder_replay(seq, x, pre_mix, replay.starts, n, targets, spans=replay.spans)
        reply(*self._replayed(message.request_id, seq, logits, targets))

    def _replay(self) -> None:
        """Run up to REPLAY_BATCH waiting replays as one batch (one while a request decodes) and
        answer each; if the batch fails, each of its prefills fails (its sequence dropped) and the
        component goes on."""
        most = 1 if self._decoding() else REPLAY_BATCH
        with contextlib.suppress(Exception):  # the batch's prefills have failed; the component goes on
            self._with_replays(lambda replays: (self.core.decoder_replays(replays), None), most)

    def _decoding(self) -> bool:
        """Whether some request decodes: a sequence held past its replay."""
        return len(self.sequences) > len(self.replays)

    def _with_replays(self, run, most: int = REPLAY_BATCH):
        """Take up to `most` waiting replays, `run(replays)` -> (their results, other), answer each,
        return other. If `run` fails, each of them fails (its sequence dropped) and the error is
        raised on."""
        batch = list(self.replays.items())[:most]
        for rid, _ in batch:
            del self.replays[rid]
        try:
            with torch.inference_mode(), page_capacity():
                results, other = run([waiting.replay for _, waiting in batch])
        except Exception as e:
            error = self.error_fields(e)
            for rid, waiting in batch:
                self.sequences.pop(rid)
                waiting.reply(m.error_reply(rid, *error))
            raise
        if batch:
            self.counters.update(replay_batches=1, batched_replays=len(batch))
        for (rid, waiting), (logits, targets) in zip(batch, results, strict=True):
            waiting.reply(*self._replayed(rid, waiting.replay.seq, logits, targets))
        return other

    def _replayed(self, rid: int, seq: Sequence, logits: torch.Tensor, targets: list[torch.Tensor]):
        self.counters.update(prefills=1, replayed_layer_tokens=seq.counters.replayed_layer_tokens,
                             decoder_layer_tokens=seq.counters.decoder_layer_tokens)
        hidden = self.core.replay_hidden(targets) if targets else None  # seeds the drafter's rings
        return self._answer(rid, seq, logits.unsqueeze(0), hidden)

    def _step(self, message: m.DecoderStep, frames: list[memoryview]):
        rid = message.request_id
        with self._new_sequence(rid, message.capacity) if message.capacity else nullcontext(
                self.sequences.get(rid)) as seq:  # a new sequence when a `full` prefill's first chunk comes
            if message.start != seq.cache.length:
                raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"step at position {message.start}, but the "
                                     f"sequence holds {seq.cache.length} positions")
            x, pre_mix = m.tensor(message.streams, frames), m.tensor(message.pre_mix, frames)
            logits, hidden = self.core.decode_streams(seq, x, pre_mix, message.start, _spans(message))
        self.counters.update(step_tokens=x.size(1), decoder_layer_tokens=x.size(1) * len(self.core.decoder))
        return self._answer(rid, seq, logits, hidden)

    def _batch_step(self, message: m.DecoderBatchStep, frames: list[memoryview]):
        """Step every request of the batch that can be stepped, as one batch; the others are
        reported one by one in `errors` (after those the encoder passed on)."""
        if not len(message.request_ids) == len(message.starts) == len(message.sizes):
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, "request_ids, starts and sizes differ in length")
        x, pre_mix = m.tensor(message.streams, frames), m.tensor(message.pre_mix, frames)
        if x.size(1) != sum(message.sizes) or pre_mix.size(1) != x.size(1):
            raise m.MessageError(m.ErrorCode.BAD_TENSOR, f"streams of {x.size(1)} tokens for sizes {message.sizes}")
        if message.verify and len(message.verify) != len(message.request_ids):
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, "verify flags and request_ids differ in length")
        keep, seqs, errors = [], [], list(message.errors)
        for i, (rid, start) in enumerate(zip(message.request_ids, message.starts, strict=True)):
            try:
                seq = self.sequences.get(rid)
                try:
                    rewind(seq, start)
                except ValueError as e:
                    raise m.MessageError(m.ErrorCode.INVALID_REQUEST, str(e)) from None
                hold_checkpoint(seq, bool(message.verify) and message.verify[i])
                if start + message.sizes[i] > seq.cache.capacity:
                    raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"{message.sizes[i]} tokens at position "
                                         f"{start} exceed the sequence's {seq.cache.capacity} positions")
                with page_capacity():  # pages first: a full pool fails this request alone
                    seq.cache.reserve(start + message.sizes[i], self.core.decoder_ids)
            except m.MessageError as e:
                errors.append(m.ItemError(request_id=rid, code=e.code, component=self.name, text=str(e)))
                continue
            keep.append(i)
            seqs.append(seq)
        sizes = [message.sizes[i] for i in keep]
        out = m.Frames()
        logits, hidden = torch.empty(0, dtype=torch.float32), torch.empty(0, dtype=torch.bfloat16)
        for waiting in self.replays.values():  # the step they waited for is here; past REPLAY_BATCH or
            waiting.step_due = 0.0  # with no request of it left to step, they run at the next idle turn
        if keep:
            if len(keep) < len(message.request_ids):
                x, pre_mix = (torch.cat([t.split(message.sizes, dim=1)[i] for i in keep], dim=1) for t in (x, pre_mix))
            starts = [message.starts[i] for i in keep]
            replays = len(self.replays)
            logits, hidden = self._with_replays(lambda waiting: self.core.decode_batch(waiting, seqs, x, pre_mix,
                                                                                       starts, sizes), most=1)
            self.counters["replays_beside_steps"] += min(replays, 1)
            logits, hidden = torch.cat(logits), torch.cat(hidden)
            self.counters.update(batches=1, step_tokens=sum(sizes),
                                 decoder_layer_tokens=sum(sizes) * len(self.core.decoder))
        return m.BatchLogits(request_id=message.request_id, request_ids=[message.request_ids[i] for i in keep],
                             sizes=sizes, logits=out.add(logits), main_hidden=out.add(hidden), errors=errors), out

    def _answer(self, rid: int, seq: Sequence, logits: torch.Tensor, hidden: torch.Tensor | None):
        out = m.Frames()
        c = seq.counters
        answer = m.Logits(request_id=rid, logits=out.add(logits), main_hidden=out.add(hidden) if hidden is not None
                          else None, replayed_layer_tokens=c.replayed_layer_tokens,
                          decoder_layer_tokens=c.decoder_layer_tokens)
        return answer, out
