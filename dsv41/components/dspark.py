"""dspark: owns each request's decode loop and streams tokens to the client.

The requests decoding are stepped in batches, split over `scheduling.steps_in_flight` batches out at
once (default 2), so that the encoder computes one batch's half of a step while the decoder computes
the other's. Without a drafter (or with the `mode` option off) a step decodes one token per request
(greedy, temperature, top-p). With the model's DSpark drafter, this process holds the drafter (and
the backbone's embedding and head it shares): each round it drafts a block per request, the
scheduler picks how many drafts each request verifies, the encoder and decoder verify them in one
multi-token batched step (keeping a checkpoint), and the accepted prefix plus the target's next
token are emitted (temperature 0: drafts equal to the argmax; above: the speculative-sampling rule).
A request with rejected drafts starts its next step at the position after its accepted ones: the
encoder and decoder then cut the verification step in place to those positions (nothing runs again);
the drafter's rings take the backbone states of accepted positions only. A step's reply comes from
the decoder directly, on a connection of this component's own (`BatchStep.reply_to`), once the
decoder holds it; until then (and after the decoder restarts, until it reconnects) the encoder
passes it on. A request that fails
anywhere gets one `Error` naming the component and the problem; its state elsewhere is released;
other requests go on.

Continuous batching: a new request waits in a bounded first-come-first-served queue; each round the
scheduler sends the prefills of the requests at its head (at most `scheduling.max_running` requests
prefill or decode at once) and a batched step of the requests already decoding. Prefills are
not waited for: the encoder runs one chunk of `generation.chunk_size` prompt tokens per turn of its
loop and serves the batched steps between chunks, and a prefill's reply is taken whenever it comes,
so the request joins the batch at the next step. A prefill that finds the KV page pools full
(CAPACITY) goes back to the head of the queue and no request is admitted until one ends; a full
queue refuses the request with CAPACITY. A `Release` for a client's request id cancels it wherever
it is (queued, prefilling or decoding) and frees its state.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field

import torch
import zmq

from dsv41 import messages as m
from dsv41.components.context import ComponentContext
from dsv41.components.runtime import Component, ComponentError, Reply, new_request_id
from dsv41.engine.dspark_scheduler import Calibration, RoundChooser, choose_lengths
from dsv41.engine.speculative import StepCost, Stopwatch, accept_greedy, accept_sampled, target_probs
from dsv41.model.dspark import Drafter, DraftState, has_drafter, load_dspark, new_state
from dsv41.model.reference import Sampling, sample_next
from dsv41.model.tokenizer import Detokenizer, token_bytes

PREFILLS_IN_FLIGHT = 4  # prefills sent ahead: the encoder never waits for a prompt, and batches their chunks
PROFILE_REPEATS = 3  # timed steps per size when the step cost is measured at start-up (the fastest counts)
PROFILE_PROMPT = 64  # tokens of the throwaway sequence those steps extend


@dataclass
class SpecStats:
    """One request's speculative decoding, reported in its `Finished`."""

    verifications: int = 0  # steps that verified at least one draft
    draft_tokens: int = 0
    accepted_tokens: int = 0
    by_position: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)  # steps that chose each number of drafts
    drafter_s: float = 0.0


@dataclass
class Plan:
    """A request's drafts for this round and what they were drawn from (temperature > 0)."""

    drafts: list[int]
    probs: torch.Tensor | None = None  # [k, vocab]
    confidence: list[float] = field(default_factory=list)  # the head's raw logits of the drafts


@dataclass
class Flight:
    """A batched step sent to the encoder whose reply is still to come."""

    batch: list[Request]
    emitted_before: int  # tokens its requests had generated when it was planned
    batch_id: int = field(default_factory=new_request_id)
    plans: dict[int, Plan] = field(default_factory=dict)
    speculate: bool = False
    tokens: int = 0  # tokens stepped (the last one plus the drafts of each request)
    started: float = field(default_factory=time.perf_counter)  # before drafting
    sent: float = 0.0


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
    detokenizer: Detokenizer
    prefill: m.Logits | None = None
    generated: list[int] = field(default_factory=list)
    ttft_s: float = 0.0
    engram_wait_s: float = 0.0
    sent_at: float = 0.0  # when its prefill was sent
    spans: list[torch.Tensor] | None = None  # image span rows [n, hidden] bf16, until the prefill is answered
    span_starts: list[int] = field(default_factory=list)
    text_from: int = 0  # the first position after the last image span (Engram rows are pushed from there)
    draft: DraftState | None = None  # the drafter's rings (speculative decoding)
    unseen: list[torch.Tensor] = field(default_factory=list)  # main_hidden rows the rings have not taken in
    resume: int = -1  # where the next step starts when drafts of the last one were rejected (-1: its end)
    spec: SpecStats = field(default_factory=SpecStats)

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
        self.prefetch_steps = self.prefetch and bool(context.option("engram", "prefetch_steps", False))
        self.tokenizer, self.encoder = context.peer("tokenizer"), context.peer("encoder")
        # the decoder answers batched steps on this connection, past the encoder, once it holds it
        self.decoder = context.peer("decoder", routing_id=f"dspark-{os.urandom(8).hex()}".encode())
        self.token_bytes = token_bytes(context.tokenizer)
        self.engram = context.peer("engram") if self.prefetch else None
        scheduling = context.pipeline.scheduling
        self.max_running, self.max_waiting = scheduling.max_running, scheduling.max_waiting
        self.steps_in_flight = scheduling.steps_in_flight
        self.timeout_s = context.pipeline.generation.request_timeout_s
        self.waiting: deque[Request] = deque()  # not yet sent, first come first served
        self.prefilling: dict[int, Request] = {}  # by internal id: prefill sent, reply not yet taken
        self.active: deque[Request] = deque()  # decoding
        self.clients: dict[int, Request] = {}  # every live request by client id
        self.blocked = False  # a prefill found no KV pages: admit nothing until a request ends
        self.flights: deque[Flight] = deque()  # batched steps sent, oldest first (their requests are out of `active`)
        self.arrived: dict[int, tuple[m.Message, list[memoryview]]] = {}  # replies of later flights, come early
        # tokens chosen but not yet sent to their clients (`_deliver`), with the reason each ends its request
        self.outbox: deque[tuple[Request, int, m.FinishReason | None]] = deque()
        self.config = config
        self.drafter, self.mode, self.length = _speculation(context)
        self.cost = StepCost()  # seconds of a step by tokens verified, for the `auto` scheduler
        self.calibration = Calibration()  # the confidence head against the acceptances observed
        self.rounds = RoundChooser()  # `auto`: speculate this round or step plainly
        self.profiled = self.mode != "auto"
        self.counters["spec_enabled"] = int(self.drafter is not None)

    def handle(self, message: m.Message, frames: list[memoryview], reply: Reply) -> None:
        if isinstance(message, m.Release):
            self._cancel(message.request_id)
            reply(m.Ack(request_id=message.request_id))
            return
        try:
            if message.request_id in self.clients:
                raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"request {message.request_id} is already running")
            ids, (rows, starts) = self._prompt_ids(message, frames)
            request = self._new_request(message, ids, reply)
            request.spans, request.span_starts = rows, starts
            request.text_from = max((s + r.size(0) for s, r in zip(starts, rows, strict=True)), default=0)
            if len(self.waiting) >= self.max_waiting and not self._can_admit():
                raise m.MessageError(m.ErrorCode.CAPACITY, f"the queue is full: {len(self.waiting)} requests wait "
                                     f"for KV pages or a running slot (scheduling.max_waiting); retry later")
        except (ComponentError, m.MessageError) as e:
            self._fail(None, e, message.request_id, reply)
            return
        self.waiting.append(request)
        self.clients[request.client_id] = request
        self.counters["received"] += 1

    def _prompt_ids(self, message: m.Generate, frames: list[memoryview]) -> tuple[list[int], tuple[list, list]]:
        """The prompt's ids, and its image spans' rows and starts (the tokenizer runs the ViT)."""
        if message.ids and not message.image_data and not message.images:
            return m.unpack_ids(message.ids, self.vocab_size), ([], [])
        out = m.Frames()
        images = [out.add(m.tensor(d, frames)) for d in message.image_data]
        answer, got = self.tokenizer.call(m.Tokenize(request_id=new_request_id(), text=message.prompt, ids=message.ids,
                                                     images=message.images, image_data=images), out)
        return m.unpack_ids(answer.ids), ([m.tensor(d, got) for d in answer.spans], list(answer.span_starts))

    def _new_request(self, message: m.Generate, ids: list[int], reply: Reply) -> Request:
        if not ids or len(ids) + message.max_new_tokens > self.limit:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"prompt of {len(ids)} tokens + max_new_tokens "
                                 f"{message.max_new_tokens} exceeds the context limit of {self.limit} tokens")
        sampling = Sampling(message.temperature, message.top_p, message.seed)
        return Request(message.request_id, new_request_id(), reply, ids, message.prefill_mode, message.max_new_tokens,
                       sampling, (self.eos,) if message.stop_at_eos else (),
                       torch.Generator().manual_seed(message.seed), time.perf_counter(), Detokenizer(self.token_bytes))

    # --- admission ---------------------------------------------------------------------------------
    def _can_admit(self) -> bool:
        return (not self.blocked and len(self.prefilling) < PREFILLS_IN_FLIGHT
                and self._decoding() + len(self.prefilling) < self.max_running)

    def _decoding(self) -> int:
        """Requests decoding: waiting for their next step or in a step still out."""
        return len(self.active) + sum(len(f.batch) for f in self.flights)

    def _admit(self) -> None:
        """Send the prefills of the requests at the head of the queue while there is room."""
        while self.waiting and self._can_admit():
            request = self.waiting.popleft()
            rid, ids = request.internal_id, request.ids
            try:
                # the engram component does not know image positions: the encoder looks those rows up
                prefetched = not request.span_starts and self._prefetch(
                    m.EngramPrefetch(request_id=rid, ids=m.pack_ids(ids), offset=0, start=0))
                out = m.Frames()
                self.encoder.send(m.Prefill(request_id=rid, ids=m.pack_ids(ids), mode=request.mode,
                                            capacity=len(ids) + request.max_new_tokens, engram_prefetch=prefetched,
                                            spans=[out.add(r) for r in request.spans or ()],
                                            span_starts=request.span_starts), out)
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
            if answer.code == m.ErrorCode.CAPACITY and (self.active or self.prefilling or self.flights):
                self.waiting.appendleft(request)
                self.blocked = True
                self.counters["capacity_waits"] += 1
                return
            self._fail(request, error, release=False)  # a failed prefill leaves no state in the encoder
            return
        request.prefill = answer
        request.spans = None  # the encoder has them; a retried prefill (CAPACITY) came back before this
        request.ttft_s = time.perf_counter() - request.started
        request.engram_wait_s += answer.engram_wait_s
        if self.drafter is not None:
            self._seed(request, None if answer.main_hidden is None else m.tensor(answer.main_hidden, frames))
        self._emit(request, m.tensor(answer.logits, frames)[-1])

    def _seed(self, request: Request, hidden: torch.Tensor | None) -> None:
        """The drafter's state; its rings take in the prompt's last positions the decoder returned
        when the request first drafts."""
        request.draft = new_state(self.config)
        request.draft.length = request.prompt_tokens - (0 if hidden is None else hidden.size(0))
        self._observe(request, hidden)

    def _on_reply(self, message: m.Message, frames: list[memoryview]) -> None:
        if any(f.batch_id == message.request_id for f in self.flights):
            self.arrived[message.request_id] = (message, frames)
            return
        request = self.prefilling.pop(message.request_id, None)
        if request is not None:  # anything else: the Ack of a Release, a cancelled request's prefill
            self._prefilled(request, message, frames)

    def _collect(self, timeout_s: float, until: int | None = None, wake: zmq.Socket | None = None):
        """Take the encoder's replies (prefills are answered as they come). Without `until`: wait up
        to timeout_s for one, then take whatever else is there. With `until`: return that request's
        reply as soon as it is there; raises ComponentError when it does not come within timeout_s.
        With `wake` (the inbox bell): a wait also ends when a message comes in; with `until`, None
        is returned then (at most a second after the call), and the caller comes back for it."""
        deadline = time.monotonic() + timeout_s
        wait = timeout_s
        while True:
            try:
                got = self.encoder.receive_any(min(wait, 1.0), wake, also=(self.decoder,))
            except ComponentError as e:
                self._lose_all(e)
                raise
            left = deadline - time.monotonic()
            if got is None:
                if until is None or left <= 0:
                    break
                if wake is not None:
                    return None
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

    def _lose_all(self, error: ComponentError) -> None:
        """The encoder or decoder is gone: every prefill and step in it is lost."""
        for request in list(self.prefilling.values()):
            self._fail(request, error, release=False)
        self.prefilling.clear()
        while self.flights:
            self._fail_flight(self.flights.popleft(), error)

    def _reply_route(self) -> bytes:
        """Where the decoder is to send the next step's reply: to this component directly when it
        holds the connection (b"": through the encoder, until then)."""
        try:
            direct = self.decoder.check_connection()
        except ComponentError as e:  # the decoder died or restarted: what it was answering is lost
            self._lose_all(e)
            direct = False
        return self.decoder.routing_id if direct else b""

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
        """Admit what fits, take prefill replies, send batched steps of the requests decoding (up to
        `scheduling.steps_in_flight` batches at once) and act on the oldest one's reply."""
        if not self.profiled:
            self._profile()
        self._admit()
        busy = bool(self.active or self.prefilling or self.flights)
        try:
            self._send_steps()
            if self.flights:
                self._land()
            elif self.prefilling:
                self._collect(0.05, wake=self.inbox_bell)
            self._send_steps()  # the next step of the requests just answered goes out before their tokens
        except ComponentError:
            pass  # the requests concerned have failed; the next round starts afresh
        finally:
            self._deliver()
        self._expire()
        decoding = self._decoding()
        gauges = {"running": decoding + len(self.prefilling), "waiting": len(self.waiting),
                  "prefilling": len(self.prefilling), "decoding": decoding}
        for key, value in gauges.items():  # set, not added (Counter.update adds)
            self.counters[key] = value
        return busy

    def _send_steps(self) -> None:
        while self.active and len(self.flights) < self.steps_in_flight:
            self._send_step()

    def _next_batch(self) -> list[Request]:
        """The requests of the next step: up to MAX_BATCH, and no more than their share when the
        requests decoding are split over `steps_in_flight` batches (those in flight count)."""
        flying = sum(len(f.batch) for f in self.flights)
        share = -(-(len(self.active) + flying) // self.steps_in_flight)
        return [self.active.popleft() for _ in range(min(len(self.active), m.MAX_BATCH, share))]

    def _send_step(self) -> None:
        """Send one batched step: one token per request, or with the drafter each request's drafts
        to verify (`auto` may step plainly for a round when that has emitted more tokens per second).
        Its reply is acted on in `_land`."""
        batch = self._next_batch()
        flight = Flight(batch, emitted_before=sum(len(r.generated) for r in batch))
        flight.speculate = self.drafter is not None and (self.mode != "auto" or self.rounds.speculate(len(batch)))
        try:
            if flight.speculate:
                flight.plans = self._plan(batch)
            items = [self._step_item(request, flight.plans.get(request.internal_id)) for request in batch]
            flight.tokens = sum(len(m.unpack_ids(item.ids)) for item in items)
            flight.sent = time.perf_counter()
            self.encoder.send(m.BatchStep(request_id=flight.batch_id, items=items, reply_to=self._reply_route()))
        except (ComponentError, m.MessageError) as e:
            for request in batch:
                self._fail(request, e)
            return
        self.flights.append(flight)

    def _reply_to(self, flight: Flight) -> tuple[m.BatchLogits, list[memoryview]] | None:
        """The flight's reply (taken early while waiting for another's, or waited for now); None
        when a message came into the inbox first (a new request is admitted, then the wait goes on)."""
        got = self.arrived.pop(flight.batch_id, None)
        if got is None:
            left = flight.sent + self.timeout_s - time.perf_counter()
            got = self._collect(max(left, 0.0), until=flight.batch_id, wake=self.inbox_bell)
            if got is None:
                return None
        if isinstance(got[0], m.Error):
            raise ComponentError(got[0].code, got[0].component, got[0].text)
        return got

    def _land(self) -> None:
        """Act on the oldest step's reply: emit each request's tokens. A request whose step found no
        free KV page tries again next round while others progress (they free pages as they end);
        when none progressed, the newest of them fails with CAPACITY. A request cancelled or failed
        while its step was in flight is left out."""
        flight = self.flights[0]
        try:
            got = self._reply_to(flight)
        except (ComponentError, m.MessageError) as e:
            if self.flights and self.flights[0] is flight:  # (a lost encoder has failed every flight)
                self._fail_flight(self.flights.popleft(), e)
            return
        finally:
            self.arrived.pop(flight.batch_id, None)
        if got is None:  # the tick takes the new message and comes back for this reply
            return
        answer, frames = got
        self.flights.popleft()
        batch, plans = [r for r in flight.batch if self._live(r)], flight.plans
        self._step_time(flight.tokens, time.perf_counter() - flight.sent)
        logits = dict(zip(answer.request_ids, m.tensor(answer.logits, frames).split(answer.sizes), strict=True))
        hidden = {}
        if self.drafter is not None and answer.main_hidden is not None:
            hidden = dict(zip(answer.request_ids, m.tensor(answer.main_hidden, frames).split(answer.sizes),
                              strict=True))
        errors = {e.request_id: ComponentError(e.code, e.component, e.text) for e in answer.errors}
        no_pages = [r for r in batch if r.internal_id not in logits and r.internal_id in errors
                    and errors[r.internal_id].code == m.ErrorCode.CAPACITY]
        if no_pages and len(no_pages) == len(batch) and not self.prefilling and not self.flights:
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
                rid = request.internal_id
                if rid in plans:
                    self._accept(request, plans[rid], logits[rid], hidden.get(rid))
                else:
                    self._observe(request, hidden.get(rid))
                    self._emit(request, logits[rid][-1])
            except (ComponentError, m.MessageError) as e:
                self._fail(request, e)
        if self.drafter is not None and len(batch) == len(flight.batch):  # (a cancelled request's tokens are gone)
            emitted = sum(len(r.generated) for r in batch) - flight.emitted_before
            self.rounds.observe(len(flight.batch), flight.speculate, emitted, time.perf_counter() - flight.started)
            self.counters["spec_plain_rounds"] += not flight.speculate
        self.counters["steps_overlapped"] += bool(self.flights)

    def _fail_flight(self, flight: Flight, error: Exception) -> None:
        for request in flight.batch:
            if self._live(request):
                self._fail(request, error)

    def _live(self, request: Request) -> bool:
        """Not cancelled or failed (both forget the client)."""
        return self.clients.get(request.client_id) is request

    def _batch(self, items: list[m.StepItem]) -> tuple[m.BatchLogits, list[memoryview]]:
        batch_id = new_request_id()
        self.encoder.send(m.BatchStep(request_id=batch_id, items=items))
        return self._collect(self.timeout_s, until=batch_id)

    def _step_item(self, request: Request, plan: Plan | None = None) -> m.StepItem:
        """The request's next step from where its last one left it (after a partly rejected block:
        after the accepted tokens). Plain: its last token, its Engram rows pushed ahead with the
        engram option `prefetch_steps`, else looked up by the encoder. With a plan: the last token
        and the drafts to verify (the encoder looks their Engram rows up itself: a cut position's
        pushed rows would be stale)."""
        token, rid = request.generated[-1], request.internal_id
        start, request.resume = request.resume, -1
        if plan is not None:
            return m.StepItem(request_id=rid, ids=m.pack_ids([token, *plan.drafts]), start=start,
                              verify=bool(plan.drafts))
        prefetched = self.prefetch_steps and self._prefetch_step(request)
        return m.StepItem(request_id=rid, ids=m.pack_ids([token]), engram_prefetch=prefetched, start=start)

    def _prefetch_step(self, request: Request) -> bool:
        """Ask for the Engram rows of the request's next step (its last token, with the look-back
        before it); False where the encoder must look them up itself."""
        position = request.prompt_tokens + len(request.generated) - 1
        window = request.generated[max(0, len(request.generated) - self.lookback - 1):]
        if len(window) <= self.lookback:
            window = request.ids[max(0, request.prompt_tokens - (self.lookback + 1 - len(window))):] + window
        offset = position + 1 - len(window)
        return offset >= request.text_from and self._prefetch(
            m.EngramPrefetch(request_id=request.internal_id, ids=m.pack_ids(window), offset=offset, start=position))

    def _emit(self, request: Request, logits: torch.Tensor) -> None:
        """Choose the request's next token from its logits; it decodes on unless that ends it."""
        if not self._push(request, int(sample_next(logits.unsqueeze(0), request.sampling, request.generator)[0])):
            self.active.append(request)

    def _push(self, request: Request, token: int) -> bool:
        """Take one token (its client gets it in `_deliver`); True when it ends the request (a stop
        token or the length limit)."""
        request.generated.append(token)
        ends = token in request.stop_ids or len(request.generated) == request.max_new_tokens
        reason = (m.FinishReason.EOS if token in request.stop_ids else m.FinishReason.LENGTH) if ends else None
        self.outbox.append((request, token, reason))
        return ends

    def _deliver(self) -> None:
        """Send the tokens taken to their clients (their text detokenized here), and finish the
        requests they end. It runs after the next step has gone out, so that a step's round trip
        does not wait on them; a request cancelled or failed meanwhile gets nothing more."""
        while self.outbox:
            request, token, reason = self.outbox.popleft()
            if not self._live(request):
                continue
            request.reply(m.TokenEvent(request_id=request.client_id, token=token,
                                       text=request.detokenizer.push(token)))
            if reason is not None:
                self._finish(request, reason)

    def _finish(self, request: Request, reason: m.FinishReason) -> None:
        self.clients.pop(request.client_id, None)
        self.counters[f"finished_{reason.name.lower()}"] += 1
        self._close(request, reason)
        self._release(request.internal_id)

    def _close(self, request: Request, reason: m.FinishReason) -> None:
        prefill, decode_s = request.prefill, 0.0
        if prefill is not None:
            decode_s = max(0.0, time.perf_counter() - request.started - request.ttft_s)
        spec = request.spec
        request.reply(m.Finished(
            request_id=request.client_id, reason=reason, prompt_tokens=request.prompt_tokens,
            generated_tokens=len(request.generated), cached_tokens=getattr(prefill, "cached_tokens", 0),
            replayed_layer_tokens=getattr(prefill, "replayed_layer_tokens", 0),
            encoder_layer_tokens=getattr(prefill, "encoder_layer_tokens", 0), ttft_s=request.ttft_s,
            decode_s=decode_s, engram_wait_s=request.engram_wait_s, verifications=spec.verifications,
            draft_tokens=spec.draft_tokens, accepted_tokens=spec.accepted_tokens,
            accepted_by_position=spec.by_position, lengths=spec.lengths, drafter_s=spec.drafter_s))

    def _fail(self, request: Request | None, error: Exception, client_id: int = 0, reply: Reply | None = None,
              release: bool = True) -> None:
        """Answer a failed request with its error (after the tokens it was given); a request that was
        sent on has its state released."""
        self._deliver()
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
        for peer in (self.tokenizer, self.encoder, self.decoder, self.engram):
            if peer is not None:
                peer.close()

    # --- speculative decoding ------------------------------------------------------------------------
    def _plan(self, batch: list[Request]) -> dict[int, Plan]:
        """Draft a block for every request (one drafter pass per temperature), then choose how many
        drafts each verifies: never past its max_new_tokens, at most `length`."""
        for request in batch:
            self._catch_up(request)
        with Stopwatch() as watch:
            drafted = {}
            for temperature in sorted({r.sampling.temperature for r in batch}):
                group = [r for r in batch if r.sampling.temperature == temperature]
                draft = self.drafter.draft([r.draft for r in group], [r.generated[-1] for r in group], temperature,
                                           [r.generator for r in group])
                drafted.update((r.internal_id, (draft, i)) for i, r in enumerate(group))
            rooms = [min(self.length, r.max_new_tokens - len(r.generated)) for r in batch]
            confidence = [drafted[r.internal_id][0].confidence[drafted[r.internal_id][1], :room].tolist()
                          for r, room in zip(batch, rooms, strict=True)]
            lengths = choose_lengths([self.calibration.adjust(c) for c in confidence], self.cost.steps_per_s,
                                     self.mode, fixed=self.length)
            plans = {}
            for request, k, raw in zip(batch, lengths, confidence, strict=True):
                draft, i = drafted[request.internal_id]
                probs = None
                if request.sampling.temperature > 0 and k:
                    probs = torch.softmax(draft.logits[i, :k] / max(request.sampling.temperature, 1e-5), dim=-1)
                plans[request.internal_id] = Plan(draft.tokens[i, :k].tolist(), probs, raw[:k])
        for request in batch:
            self._drafter_time(request, watch.total / len(batch))
        return plans

    def _accept(self, request: Request, plan: Plan, rows: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """Emit the verified block's tokens. When drafts were rejected the next step starts after
        the accepted ones, which cuts the verification step there in the encoder and decoder."""
        drafts, position = plan.drafts, request.prompt_tokens + len(request.generated) - 1
        if request.sampling.temperature == 0:
            emitted = accept_greedy(rows.argmax(-1).tolist(), drafts, request.stop_ids)
        else:
            emitted = accept_sampled(target_probs(rows, request.sampling), plan.probs, drafts, request.generator)
        accepted = len(emitted) - 1
        self._count(request.spec, len(drafts), accepted)
        self.calibration.observe(plan.confidence, len(drafts), accepted)
        for i, ratio in enumerate(self.calibration.ratios()):
            self.counters[f"spec_calibration_pos_{i}_permille"] = round(1000 * ratio)
        for token in emitted:
            if self._push(request, token):
                return
        self._observe(request, None if hidden is None else hidden[: accepted + 1])
        if accepted < len(drafts):
            request.resume = position + accepted + 1
            self.counters["spec_rolled_back_tokens"] += len(drafts) - accepted
        self.active.append(request)

    def _observe(self, request: Request, hidden: torch.Tensor | None) -> None:
        """Keep the backbone states of the positions a step kept for the drafter's rings. They are
        taken in when the request next drafts (`_catch_up`), so plain rounds do not pay for the
        drafter; only the last `window` rows can reach a ring, so no more than twice that are held."""
        if hidden is None or request.draft is None:
            return
        request.unseen.append(hidden)
        if sum(rows.size(0) for rows in request.unseen) > 2 * self.drafter.window:
            rows = torch.cat(request.unseen)
            request.draft.length += rows.size(0) - self.drafter.window
            request.unseen = [rows[-self.drafter.window :]]

    def _catch_up(self, request: Request) -> None:
        """The drafter's rings take in the rows kept since the request last drafted."""
        if not request.unseen:
            return
        rows, request.unseen = torch.cat(request.unseen), []
        with Stopwatch() as watch:
            self.drafter.observe(request.draft, rows)
        self._drafter_time(request, watch.total)

    def _count(self, spec: SpecStats, drafted: int, accepted: int) -> None:
        spec.lengths += [0] * (drafted + 1 - len(spec.lengths))
        spec.lengths[drafted] += 1
        self.counters[f"spec_length_{drafted}"] += 1
        if not drafted:
            return
        spec.verifications += 1
        spec.draft_tokens += drafted
        spec.accepted_tokens += accepted
        spec.by_position += [0] * (drafted - len(spec.by_position))
        for i in range(accepted):
            spec.by_position[i] += 1
            self.counters[f"spec_accepted_pos_{i}"] += 1
        self.counters.update(spec_drafts=1, spec_draft_tokens=drafted, spec_accepted_tokens=accepted)

    def _drafter_time(self, request: Request, seconds: float) -> None:
        request.spec.drafter_s += seconds
        self.counters["spec_drafter_us"] += int(seconds * 1e6)

    def _step_time(self, tokens: int, seconds: float) -> None:
        """A batched step's round trip: the scheduler's cost curve and the step-time counter."""
        self.counters["step_us"] += int(seconds * 1e6)
        if self.drafter is not None:
            self.cost.observe(tokens, seconds)
            self._publish_cost()

    def _publish_cost(self) -> None:
        a, b = self.cost.fit()
        self.counters["spec_cost_base_us"], self.counters["spec_cost_per_token_us"] = int(a * 1e6), int(b * 1e6)

    def _profile(self) -> None:
        """Time steps of 1..block+1 tokens of a throwaway sequence (the `auto` scheduler's first
        cost curve; the real steps keep it current): one untimed step first (first-call costs),
        then the fastest of PROFILE_REPEATS steps of each size, so a slow start-up does not bend
        the curve. If that fails the curve starts empty and fills from the real steps."""
        self.profiled = True
        rid, sizes = new_request_id(), range(1, self.drafter.block + 2)
        prompt = [1] * PROFILE_PROMPT
        try:
            self.encoder.send(m.Prefill(request_id=rid, ids=m.pack_ids(prompt), mode="ced",
                                        capacity=len(prompt) + 1 + PROFILE_REPEATS * sum(sizes)))
            self._collect(self.timeout_s, until=rid)
            self._timed_step(rid, 1)
            for size in sizes:
                self.cost.observe(size, min(self._timed_step(rid, size) for _ in range(PROFILE_REPEATS)))
            self._publish_cost()
        except ComponentError:
            self.counters["spec_profile_failed"] += 1
        finally:
            self._release(rid)

    def _timed_step(self, rid: int, size: int) -> float:
        started = time.perf_counter()
        answer, _ = self._batch([m.StepItem(request_id=rid, ids=m.pack_ids([1] * size))])
        if answer.errors:
            raise ComponentError(answer.errors[0].code, answer.errors[0].component, answer.errors[0].text)
        return time.perf_counter() - started


def _speculation(context: ComponentContext) -> tuple[Drafter | None, str, int]:
    """The drafter, the scheduling mode and the most drafts per step, from the dspark options and
    the model directory: `mode` unset is auto when the directory holds a drafter, else off."""
    from dsv41.checkpoint import weight_files

    mode, length = context.option("dspark", "mode", None), context.option("dspark", "length", None)
    files = weight_files(context.checkpoint_dir) if context.checkpoint_dir is not None else []
    found = bool(files) and has_drafter(files)
    mode = mode or ("auto" if found else "off")
    if mode == "off":
        return None, "off", 0
    if not found:
        where = context.checkpoint_dir or f"the random {context.pipeline.model.config} model"
        raise ValueError(f"components.dspark.options.mode is {mode!r}, but {where} has no DSpark drafter "
                         "(no mtp.* tensors); use mode off")
    model = context.build_model()
    model.layers = torch.nn.ModuleList()  # the drafter shares only the embedding and the head
    drafter = Drafter(model, load_dspark(context.config, files))
    drafter.warm_up()  # before the component reports ready, as the encoder and decoder warm up
    return drafter, mode, min(length or drafter.block, drafter.block)
