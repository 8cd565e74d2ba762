"""dspark: owns each request's decode loop and streams tokens to the client.

Until the DSpark drafter lands this schedules plain decoding (greedy, temperature, top-p), one
token per request per round over every request in flight. A request that fails anywhere gets one
`Error` naming the component and the problem; its state elsewhere is released; other requests go on.
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


@dataclass
class Request:
    client_id: int
    internal_id: int
    reply: Reply
    prompt_tokens: int
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


class DSparkComponent(Component):
    name = "dspark"
    accepts = frozenset({m.KIND.GENERATE})

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
        self.active: deque[Request] = deque()

    def handle(self, message: m.Message, frames: list[memoryview], reply: Reply) -> None:
        request = None
        try:
            ids = self._prompt_ids(message)
            request = self._admit(message, ids, reply)
            self._start(request, ids, message.prefill_mode)
        except (ComponentError, m.MessageError) as e:
            self._fail(request, message.request_id, reply, e)

    def _prompt_ids(self, message: m.Generate) -> list[int]:
        if message.ids:
            return m.unpack_ids(message.ids, self.vocab_size)
        answer, _ = self.tokenizer.call(m.Tokenize(request_id=new_request_id(), text=message.prompt,
                                                   images=message.images))
        return m.unpack_ids(answer.ids)

    def _admit(self, message: m.Generate, ids: list[int], reply: Reply) -> Request:
        if not ids or len(ids) + message.max_new_tokens > self.limit:
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"prompt of {len(ids)} tokens + max_new_tokens "
                                 f"{message.max_new_tokens} exceeds the context limit of {self.limit} tokens")
        sampling = Sampling(message.temperature, message.top_p, message.seed)
        return Request(message.request_id, new_request_id(), reply, len(ids), message.max_new_tokens, sampling,
                       (self.eos,) if message.stop_at_eos else (), torch.Generator().manual_seed(message.seed),
                       time.perf_counter(), ids[max(0, len(ids) - self.lookback):], Detokenizer(self.token_bytes))

    def _start(self, request: Request, ids: list[int], mode: str) -> None:
        rid = request.internal_id
        prefetched = self._prefetch(m.EngramPrefetch(request_id=rid, ids=m.pack_ids(ids), offset=0, start=0))
        answer, frames = self.encoder.call(m.Prefill(request_id=rid, ids=m.pack_ids(ids), mode=mode,
                                                     capacity=len(ids) + request.max_new_tokens,
                                                     engram_prefetch=prefetched))
        request.prefill = answer
        request.ttft_s = time.perf_counter() - request.started
        request.engram_wait_s += answer.engram_wait_s
        self._emit(request, m.tensor(answer.logits, frames)[-1])

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
        """One batched step of every request in flight (up to MAX_BATCH of them)."""
        if not self.active:
            return False
        batch = [self.active.popleft() for _ in range(min(len(self.active), m.MAX_BATCH))]
        try:
            items = [self._step_item(request) for request in batch]
            answer, frames = self.encoder.call(m.BatchStep(request_id=new_request_id(), items=items))
        except (ComponentError, m.MessageError) as e:
            for request in batch:
                self._fail(request, request.client_id, request.reply, e)
            return True
        logits = dict(zip(answer.request_ids, m.tensor(answer.logits, frames).split(answer.sizes), strict=True))
        errors = {e.request_id: ComponentError(e.code, e.component, e.text) for e in answer.errors}
        for request in batch:
            try:
                if request.internal_id not in logits:
                    raise errors.get(request.internal_id) or ComponentError(
                        m.ErrorCode.INTERNAL, "encoder", "the batch reply left this request out")
                self._emit(request, logits[request.internal_id][-1])
            except (ComponentError, m.MessageError) as e:
                self._fail(request, request.client_id, request.reply, e)
        return True

    def _step_item(self, request: Request) -> m.StepItem:
        """The request's next step: its last token (with the Engram rows pushed ahead)."""
        token, rid = request.generated[-1], request.internal_id
        position = request.prompt_tokens + len(request.generated) - 1
        window = [*request.tail, token]
        request.tail = window[max(0, len(window) - self.lookback):] if self.lookback else []
        prefetched = self._prefetch(m.EngramPrefetch(request_id=rid, ids=m.pack_ids(window),
                                                     offset=position + 1 - len(window), start=position))
        return m.StepItem(request_id=rid, ids=m.pack_ids([token]), engram_prefetch=prefetched)

    def _emit(self, request: Request, logits: torch.Tensor) -> None:
        token = int(sample_next(logits.unsqueeze(0), request.sampling, request.generator)[0])
        request.generated.append(token)
        request.reply(m.TokenEvent(request_id=request.client_id, token=token, text=request.detokenizer.push(token)))
        if token in request.stop_ids or len(request.generated) == request.max_new_tokens:
            self._finish(request, m.FinishReason.EOS if token in request.stop_ids else m.FinishReason.LENGTH)
        else:
            self.active.append(request)

    def _finish(self, request: Request, reason: m.FinishReason) -> None:
        prefill = request.prefill
        request.reply(m.Finished(
            request_id=request.client_id, reason=reason, prompt_tokens=request.prompt_tokens,
            generated_tokens=len(request.generated), cached_tokens=prefill.cached_tokens,
            replayed_layer_tokens=prefill.replayed_layer_tokens, encoder_layer_tokens=prefill.encoder_layer_tokens,
            ttft_s=request.ttft_s, decode_s=time.perf_counter() - request.started - request.ttft_s,
            engram_wait_s=request.engram_wait_s))
        self._release(request.internal_id)

    def _fail(self, request: Request | None, client_id: int, reply: Reply, error: Exception) -> None:
        self.counters["failed_requests"] += 1
        if isinstance(error, ComponentError):
            reply(m.error_reply(client_id, error.code, error.component, error.text))
        else:
            reply(m.error_reply(client_id, error.code, self.name, str(error)))
        if request is not None:
            self._release(request.internal_id)

    def _release(self, rid: int) -> None:
        try:
            self.encoder.call(m.Release(request_id=rid), timeout_s=5.0)
        except ComponentError:
            self.counters["release_unconfirmed"] += 1

    def close(self) -> None:
        for peer in (self.tokenizer, self.encoder, self.engram):
            if peer is not None:
                peer.close()
