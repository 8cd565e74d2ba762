"""dspark: owns each request's decode loop and streams tokens to the client.

Until the DSpark drafter lands this schedules plain decoding (greedy, temperature, top-p), one
token per request per round over every request in flight. A request that fails anywhere gets one
`Error` naming the component and the problem; its state elsewhere is released; other requests go on.

Continuous batching: a new request waits in a bounded first-come-first-served queue; each round the
scheduler sends the prefills of the requests at its head (at most `scheduling.max_running` requests
prefill or decode at once) and one batched step of every request already decoding. Prefills are
not waited for: the encoder runs one chunk of `generation.chunk_size` prompt tokens per turn of its
loop and serves the batched steps between chunks, and a prefill's reply is taken whenever it comes,
so the request joins the batch at the next step. A prefill that finds the KV page pools full
(CAPACITY) goes back to the head of the queue and no request is admitted until one ends; a full
queue refuses the request with CAPACITY. A `Release` for a client's request id cancels it wherever
it is (queued, prefilling or decoding) and frees its state.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import torch

from dsv41 import messages as m
from dsv41.components.context import ComponentContext
from dsv41.components.runtime import Component, ComponentError, Reply, new_request_id
from dsv41.model.reference import Sampling, sample_next
from dsv41.model.tokenizer import Detokenizer, token_bytes

PREFILLS_IN_FLIGHT = 2  # prefills sent ahead, so the encoder never waits for the next prompt


@dataclass
class Request:
    client_id: int
    internal_id: int
    reply: Reply
    ids: list[int]
    mode: str
    max_new_tokens: int
    sampling: Sampling
    stop_ids: tuple[int, ...]
    generator: torch.Generator
    started: float
    tail: list[int]  # the last Engram look-back ids before the next token
    detokenizer: Detokenizer
    prefill: m.Logits | None = None
    generated: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    engram_wait_s: float = 0.0
    sent_at: float = 0.0  # when its prefill was sent

    @property
    def prompt_tokens(self) -> int:
        return len(self.ids)


class DSparkComponent(Component):
    name = "dspark"
    accepts = frozenset({m.KIND.GENERATE, m.KIND.RELEASE})

    def __init__(self, context: ComponentContext):
        super().__init__()
        config = context.config
        self.limit, self.eos = config.text_config.max_position_embeddings, config.eos_token_id
        self.vocab_size = config.text_config.vocab_size
        self.lookback = config.text_config.engram_max_ngram_size - 1
        self.prefetch = bool(context.option("engram", "prefetch", True)) and bool(config.text_config.engram_layer_ids)
        self.tokenizer, self.encoder = context.peer("tokenizer"), context.peer("encoder")
        self.token_bytes = token_bytes(context.tokenizer)
        self.engram = context.peer("engram") if self.prefetch else None
        scheduling = context.pipeline.scheduling
        self.max_running, self.max_waiting = scheduling.max_running, scheduling.max_waiting
        self.timeout_s = context.pipeline.generation.request_timeout_s
        self.waiting: deque[Request] = deque()  # not yet sent, first come first served
        self.prefilling: dict[int, Request] = {}  # by internal id: prefill sent, reply not yet taken
        self.active: deque[Request] = deque()  # decoding
        self.clients: dict[int, Request] = {}  # every live request by client id
        self.blocked = False  # a prefill found no KV pages: admit nothing until a request ends
        self.stepping: list[Request] = []  # the batch being stepped (out of `active` meanwhile)

    def handle(self, message: m.Message, frames: list[memoryview], reply: Reply) -> None:
        if isinstance(message, m.Release):
            self._cancel(message.request_id)
            reply(m.Ack(request_id=message.request_id))
            return
        try:
            if message.request_id in self.clients:
                raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"request {message.request_id} is already running")
            ids = self._prompt_ids(message)
            request = self._new_request(message, ids, reply)
            if len(self.waiting) >= self.max_waiting and not self._can_admit():
                raise m.MessageError(m.ErrorCode.CAPACITY, f"the queue is full: {len(self.waiting)} requests wait "
                                     f"for KV pages or a running slot (scheduling.max_waiting); retry later")
        except (ComponentError, m.MessageError) as e:
            self._fail(None, e, message.request_id, reply)
            return
        self.waiting.append(request)
        self.clients[request.client_id] = request
        self.counters["received"] += 1

    def _prompt_ids(self, message: m.Generate) -> list[int]:
        if message.ids:
            return m.unpack_ids(message.ids, self.vocab_size)
        answer, _ = self.tokenizer.call(m.Tokenize(request_id=new_request_id(), text=message.prompt,
                                                   images=message.images))
        return m.unpack_ids(answer.ids)

    def _new_request(self, message: m.Generate, ids: list[int], reply: Reply) -> Request:
        if not ids or len(ids) + message.max_new_tokens > self.limit:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"prompt of {len(ids)} tokens + max_new_tokens "
                                 f"{message.max_new_tokens} exceeds the context limit of {self.limit} tokens")
        sampling = Sampling(message.temperature, message.top_p, message.seed)
        return Request(message.request_id, new_request_id(), reply, ids, message.prefill_mode, message.max_new_tokens,
                       sampling, (self.eos,) if message.stop_at_eos else (),
                       torch.Generator().manual_seed(message.seed), time.perf_counter(),
                       ids[max(0, len(ids) - self.lookback):], Detokenizer(self.token_bytes))

    # --- admission ---------------------------------------------------------------------------------
    def _can_admit(self) -> bool:
        return (not self.blocked and len(self.prefilling) < PREFILLS_IN_FLIGHT
                and len(self.active) + len(self.prefilling) < self.max_running)

    def _admit(self) -> None:
        """Send the prefills of the requests at the head of the queue while there is room."""
        while self.waiting and self._can_admit():
            request = self.waiting.popleft()
            rid, ids = request.internal_id, request.ids
            try:
                prefetched = self._prefetch(m.EngramPrefetch(request_id=rid, ids=m.pack_ids(ids), offset=0, start=0))
                self.encoder.send(m.Prefill(request_id=rid, ids=m.pack_ids(ids), mode=request.mode,
                                            capacity=len(ids) + request.max_new_tokens, engram_prefetch=prefetched))
            except ComponentError as e:
                self._fail(request, e)
                continue
            request.sent_at = time.monotonic()
            self.prefilling[rid] = request

    def _prefilled(self, request: Request, answer: m.Logits | m.Error, frames: list[memoryview]) -> None:
        """A prefill's reply: the request's first token, or back to the queue when no KV pages were free
        (unless nothing else holds pages: then it can never fit, and fails)."""
        if isinstance(answer, m.Error):
            error = ComponentError(answer.code, answer.component, answer.text)
            if answer.code == m.ErrorCode.CAPACITY and (self.active or self.prefilling or self.stepping):
                self.waiting.appendleft(request)
                self.blocked = True
                self.counters["capacity_waits"] += 1
                return
            self._fail(request, error, release=False)  # a failed prefill leaves no state in the encoder
            return
        request.prefill = answer
        request.ttft_s = time.perf_counter() - request.started
        request.engram_wait_s += answer.engram_wait_s
        self._emit(request, m.tensor(answer.logits, frames)[-1])

    def _on_reply(self, message: m.Message, frames: list[memoryview]) -> None:
        request = self.prefilling.pop(message.request_id, None)
        if request is not None:  # anything else: the Ack of a Release, a cancelled request's prefill
            self._prefilled(request, message, frames)

    def _collect(self, timeout_s: float, until: int | None = None):
        """Take the encoder's replies (prefills are answered as they come). Without `until`: wait up
        to timeout_s for one, then take whatever else is there. With `until`: return that request's
        reply as soon as it is there; raises ComponentError when it does not come within timeout_s."""
        deadline = time.monotonic() + timeout_s
        wait = timeout_s
        while True:
            try:
                got = self.encoder.receive_any(min(wait, 1.0))
            except ComponentError as e:  # the encoder is gone: every prefill in it is lost
                for request in list(self.prefilling.values()):
                    self._fail(request, e, release=False)
                self.prefilling.clear()
                raise
            left = deadline - time.monotonic()
            if got is None:
                if until is None or left <= 0:
                    break
                wait = left
                continue
            message, frames = got
            if until is not None and message.request_id in (until, 0):
                if isinstance(message, m.Error):
                    raise ComponentError(message.code, message.component, message.text)
                return message, frames
            self._on_reply(message, frames)
            wait = 0.0 if until is None else max(left, 0.0)
        if until is not None:
            raise ComponentError(m.ErrorCode.UNAVAILABLE, "encoder", f"no reply within {timeout_s:.1f} s")
        return None

    def _expire(self) -> None:
        """Prefills unanswered past the request timeout fail (the encoder died or hangs)."""
        now = time.monotonic()
        for rid, request in list(self.prefilling.items()):
            if now - request.sent_at > self.timeout_s:
                del self.prefilling[rid]
                self._fail(request, ComponentError(m.ErrorCode.UNAVAILABLE, "encoder", "the prefill had no reply "
                                                   f"within {self.timeout_s:.0f} s"))

    def _cancel(self, client_id: int) -> None:
        """Drop a client's request wherever it is; its state in the encoder and decoder is released."""
        request = self.clients.pop(client_id, None)
        if request is None:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        else:
            self.prefilling.pop(request.internal_id, None)
            if request in self.active:
                self.active.remove(request)
            self._release(request.internal_id)
        self.counters["cancelled"] += 1
        self._close(request, m.FinishReason.CANCELLED)

    def _prefetch(self, message: m.EngramPrefetch) -> bool:
        """Ask the engram component to push rows to the encoder; when it cannot be reached the
        encoder looks the rows up itself (it still holds the tables), so this is safe to skip."""
        if self.engram is None:
            return False
        try:
            self.engram.send(message)
        except ComponentError:
            self.counters["engram_unreachable"] += 1
            return False
        return True

    def tick(self) -> bool:
        """Admit what fits, take prefill replies, and one batched step of every request decoding."""
        self._admit()
        busy = bool(self.active or self.prefilling)
        try:
            if self.active:
                self._step()
            elif self.prefilling:
                self._collect(0.05)
        except ComponentError:
            pass  # the requests concerned have failed; the next round starts afresh
        self._expire()
        gauges = {"running": len(self.active) + len(self.prefilling), "waiting": len(self.waiting),
                  "prefilling": len(self.prefilling), "decoding": len(self.active)}
        for key, value in gauges.items():  # set, not added (Counter.update adds)
            self.counters[key] = value
        return busy

    def _step(self) -> None:
        """One batched step of the requests decoding (up to MAX_BATCH of them). A request whose step
        found no free KV page tries again next round while others progress (they free pages as they
        end); when none progressed, the newest of them fails with CAPACITY."""
        batch = [self.active.popleft() for _ in range(min(len(self.active), m.MAX_BATCH))]
        tails = {}
        self.stepping = batch
        try:
            items = []
            for request in batch:
                item, tails[request.internal_id] = self._step_item(request)
                items.append(item)
            batch_id = new_request_id()
            self.encoder.send(m.BatchStep(request_id=batch_id, items=items))
            answer, frames = self._collect(self.timeout_s, until=batch_id)
        except (ComponentError, m.MessageError) as e:
            for request in batch:
                self._fail(request, e)
            return
        finally:
            self.stepping = []
        logits = dict(zip(answer.request_ids, m.tensor(answer.logits, frames).split(answer.sizes), strict=True))
        errors = {e.request_id: ComponentError(e.code, e.component, e.text) for e in answer.errors}
        no_pages = [r for r in batch if r.internal_id not in logits and r.internal_id in errors
                    and errors[r.internal_id].code == m.ErrorCode.CAPACITY]
        if no_pages and len(no_pages) == len(batch) and not self.prefilling:
            newest = max(no_pages, key=lambda r: r.started)
            no_pages = [r for r in no_pages if r is not newest]
        for request in batch:
            try:
                if request in no_pages:  # stepped again next round, at the same position
                    self.counters["capacity_waits"] += 1
                    self.active.append(request)
                    continue
                if request.internal_id not in logits:
                    raise errors.get(request.internal_id) or ComponentError(
                        m.ErrorCode.INTERNAL, "encoder", "the batch reply left this request out")
                request.tail = tails[request.internal_id]
                self._emit(request, logits[request.internal_id][-1])
            except (ComponentError, m.MessageError) as e:
                self._fail(request, e)

    def _step_item(self, request: Request) -> tuple[m.StepItem, list[int]]:
        """The request's next step: its last token (with the Engram rows pushed ahead), and the
        look-back ids after it."""
        token, rid = request.generated[-1], request.internal_id
        position = request.prompt_tokens + len(request.generated) - 1
        window = [*request.tail, token]
        tail = window[max(0, len(window) - self.lookback):] if self.lookback else []
        prefetched = self._prefetch(m.EngramPrefetch(request_id=rid, ids=m.pack_ids(window),
                                                     offset=position + 1 - len(window), start=position))
        return m.StepItem(request_id=rid, ids=m.pack_ids([token]), engram_prefetch=prefetched), tail

    def _emit(self, request: Request, logits: torch.Tensor) -> None:
        token = int(sample_next(logits.unsqueeze(0), request.sampling, request.generator)[0])
        request.generated.append(token)
        request.reply(m.TokenEvent(request_id=request.client_id, token=token, text=request.detokenizer.push(token)))
        if token in request.stop_ids or len(request.generated) == request.max_new_tokens:
            self._finish(request, m.FinishReason.EOS if token in request.stop_ids else m.FinishReason.LENGTH)
        else:
            self.active.append(request)

    def _finish(self, request: Request, reason: m.FinishReason) -> None:
        self.clients.pop(request.client_id, None)
        self.counters[f"finished_{reason.name.lower()}"] += 1
        self._close(request, reason)
        self._release(request.internal_id)

    def _close(self, request: Request, reason: m.FinishReason) -> None:
        prefill, decode_s = request.prefill, 0.0
        if prefill is not None:
            decode_s = max(0.0, time.perf_counter() - request.started - request.ttft_s)
        request.reply(m.Finished(
            request_id=request.client_id, reason=reason, prompt_tokens=request.prompt_tokens,
            generated_tokens=len(request.generated), cached_tokens=getattr(prefill, "cached_tokens", 0),
            replayed_layer_tokens=getattr(prefill, "replayed_layer_tokens", 0),
            encoder_layer_tokens=getattr(prefill, "encoder_layer_tokens", 0), ttft_s=request.ttft_s,
            decode_s=decode_s, engram_wait_s=request.engram_wait_s))

    def _fail(self, request: Request | None, error: Exception, client_id: int = 0, reply: Reply | None = None,
              release: bool = True) -> None:
        """Answer a failed request with its error; a request that was sent on has its state released."""
        self.counters["failed_requests"] += 1
        if request is not None:
            client_id, reply = request.client_id, request.reply
            self.clients.pop(client_id, None)
        if isinstance(error, ComponentError):
            reply(m.error_reply(client_id, error.code, error.component, error.text))
        else:
            reply(m.error_reply(client_id, error.code, self.name, str(error)))
        if request is not None and release:
            self._release(request.internal_id)

    def _release(self, rid: int) -> None:
        """Tell the encoder (which tells the decoder) to drop the request's state; its Ack is not
        waited for (replies are taken in `_collect`). A freed sequence may let a queued request in."""
        self.blocked = False
        try:
            self.encoder.send(m.Release(request_id=rid))
        except ComponentError:
            self.counters["release_unconfirmed"] += 1

    def close(self) -> None:
        for peer in (self.tokenizer, self.encoder, self.engram):
            if peer is not None:
                peer.close()
