"""The OpenAI-compatible HTTP front end (FastAPI): /v1/models, /v1/completions, /v1/chat/completions,
/health and /metrics over a running pipeline.

The front end renders chat messages with the release's chat format (`dsv41.chat`), tokenizes with the
model's tokenizer, checks the request against the context, and sends dspark one `Generate` of token
ids; the token events that come back are parsed into reasoning, content and tool calls and
returned as one JSON body or as server-sent events. A client that goes away has its request
cancelled (a `Release` to dspark frees its pages and sequence state).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from tokenizers import Tokenizer

from dsv41 import messages as m
from dsv41.chat import render
from dsv41.components.runtime import new_request_id
from dsv41.config import VisionConfig
from dsv41.model.image_processor import MAX_IMAGES, ImageError, preprocess
from dsv41.model.tokenizer import IMAGE, encode
from dsv41.serving.api import APIError, ChatRequest, Limits, chat_request, completion_prompt, component_error, fit
from dsv41.serving.api import sampling as parse_sampling
from dsv41.serving.backend import Backend
from dsv41.serving.metrics import ComponentCollector, RequestMetrics
from dsv41.serving.output import Delta, OutputParser

DISCONNECT_POLL_S = 0.5  # how often a request waiting for tokens checks that its client is still there
CANCEL_WAIT_S = 5.0  # how long a request stopped by a stop string waits for dspark's closing counts


@dataclass
class Settings:
    model: str  # the served model name (GET /v1/models)
    context: int
    vocab_size: int
    eos_id: int
    default_max_tokens: int
    temperature: float
    top_p: float
    prefill_mode: str
    retry_after_s: int
    max_body_bytes: int
    api_key: str | None = None
    image_token_id: int = -1
    vision: VisionConfig | None = None  # None: the model has no vision tower (image parts are refused)


class Disconnected(Exception):
    pass


class Generation:
    """One request in flight: its events from dspark, parsed, with the front end's timings."""

    def __init__(self, app: ServingApp, http: Request, request: m.Generate, parser: OutputParser,
                 frames: m.Frames | None = None):
        self.app, self.http, self.parser = app, http, parser
        self.rid, self.prompt_tokens = request.request_id, len(request.ids) // 4
        self.started = time.perf_counter()
        self.last_token: float | None = None
        self.tokens = 0
        self.finished: m.Finished | None = None
        self.reason: str | None = None
        self.events = app.backend.submit(request, frames)

    async def _next(self) -> m.Message:
        while True:
            try:
                return await asyncio.wait_for(self.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await self.http.is_disconnected():
                    raise Disconnected from None

    async def deltas(self) -> AsyncIterator[Delta]:
        """Parsed pieces of the output until the request ends; raises APIError for a failed one."""
        try:
            while self.reason is None:
                event = await self._next()
                if isinstance(event, m.TokenEvent):
                    self._timing()
                    self.tokens += 1
                    delta = self.parser.push("" if event.token == self.app.settings.eos_id else event.text)
                    if self.parser.stopped:
                        await self._stop()
                    yield delta
                elif isinstance(event, m.Finished):
                    self.finished = event
                    self.reason = {m.FinishReason.LENGTH: "length", m.FinishReason.CANCELLED: "abort"}.get(
                        event.reason, "stop")
                    delta = self.parser.finish()
                    if self.parser.tool_calls and self.reason == "stop":
                        self.reason = "tool_calls"
                    yield delta
                elif isinstance(event, m.Error):
                    self.reason = "error"
                    raise component_error(event, self.app.settings.retry_after_s)
        finally:
            self._close()

    def _timing(self) -> None:
        now = time.perf_counter()
        if self.last_token is None:
            self.app.metrics.first_token(now - self.started)
        else:
            self.app.metrics.next_token(now - self.last_token)
        self.last_token = now

    async def _stop(self) -> None:
        """A stop string was generated: cancel the rest and take dspark's closing counts."""
        self.app.backend.cancel(self.rid, keep=True)
        self.reason = "stop"
        deadline = time.monotonic() + CANCEL_WAIT_S
        while time.monotonic() < deadline:
            try:
                event = await asyncio.wait_for(self.events.get(), max(0.01, deadline - time.monotonic()))
            except TimeoutError:
                return
            if isinstance(event, m.Finished | m.Error):
                self.finished = event if isinstance(event, m.Finished) else None
                return

    def _close(self) -> None:
        """Cancel a request left unfinished (its client went away) and record the request."""
        if self.reason is None:
            self.reason = "abort"
            self.app.backend.cancel(self.rid)
        done = self.finished
        self.app.metrics.finished(self.reason, self.prompt_tokens, self.tokens,
                                  done.cached_tokens if done else 0, done.replayed_layer_tokens if done else 0,
                                  done.engram_wait_s if done else 0.0, time.perf_counter() - self.started)

    def usage(self) -> dict:
        cached = self.finished.cached_tokens if self.finished else 0
        prompt = self.finished.prompt_tokens if self.finished else self.prompt_tokens  # image spans expanded
        return {"prompt_tokens": prompt, "completion_tokens": self.tokens,
                "total_tokens": prompt + self.tokens, "prompt_tokens_details": {"cached_tokens": cached}}


class ServingApp:
    def __init__(self, backend: Backend, tokenizer: Tokenizer, settings: Settings,
                 ping: Callable[[str], dict[str, int] | None], components: tuple[str, ...]):
        self.backend, self.tokenizer, self.settings, self.ping = backend, tokenizer, settings, ping
        self.components = components
        self.limits = Limits(settings.model, settings.context, settings.default_max_tokens, settings.vocab_size)
        self.registry = CollectorRegistry()
        self.metrics = RequestMetrics(self.registry, settings.model)
        self.registry.register(ComponentCollector(components, ping, settings.model))
        self.created = int(time.time())

    async def body(self, request: Request) -> dict:
        """The JSON object of a request body of at most max_body_bytes (413 past it, 400 if not JSON)."""
        limit = self.settings.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(413, f"the request body of {int(length)} bytes is over the limit of {limit} bytes",
                           code="request_too_large")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise APIError(413, f"the request body is over the limit of {limit} bytes", code="request_too_large")
        try:
            body = json.loads(data)
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    def generate(self, ids: list[int], max_tokens: int, sampling, image_data: list[m.Tensor] = ()) -> m.Generate:
        return m.Generate(request_id=new_request_id(), ids=m.pack_ids(ids), max_new_tokens=max_tokens,
                          temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed,
                          prefill_mode=self.settings.prefill_mode, image_data=list(image_data))


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


class APIKey:
    """ASGI middleware: with a key set, every request but /health must carry `Authorization: Bearer
    KEY` (compared in constant time). /metrics is guarded too (a Prometheus scrape job sends the key
    as its bearer credentials): a front end that protects only its /v1/ routes leaves the rest open
    to whoever reaches the port. /health stays open for liveness probes; it reveals only which
    components are up."""

    def __init__(self, app, key: str | None):
        self.app, self.key = app, key.encode() if key else None

    async def __call__(self, scope, receive, send):
        if self.key is None or scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        token = given[7:] if given[:7].lower() == b"bearer " else b""
        if hmac.compare_digest(token, self.key):
            return await self.app(scope, receive, send)
        error = APIError(401, "Incorrect API key provided: send it as `Authorization: Bearer KEY`",
                         code="invalid_api_key")
        await JSONResponse(error.body(), status_code=401)(scope, receive, send)


def create_app(serving: ServingApp) -> FastAPI:
    settings = serving.settings
    app = FastAPI(title="dsv41", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(APIKey, key=settings.api_key)
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": settings.model, "object": "model", "created": serving.created,
                                            "owned_by": "dsv41", "max_model_len": settings.context}]}

    @app.get("/health")
    async def health() -> JSONResponse:
        answers = await run_in_threadpool(lambda: {name: serving.ping(name) for name in serving.components})
        down = [name for name, counters in answers.items() if counters is None]
        if down:
            error = APIError(503, f"components down: {', '.join(down)}", code="service_unavailable")
            return JSONResponse(error.body(), status_code=503)
        return JSONResponse({"status": "ok", "components": {name: "up" for name in answers}})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await run_in_threadpool(generate_latest, serving.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await serving.body(request)
        chat = chat_request(body, serving.limits, settings.temperature, settings.top_p)
        span_tokens = await run_in_threadpool(_image_tokens, serving, chat.images) if chat.images else 0
        ids = await run_in_threadpool(_chat_ids, serving, chat)
        max_tokens = fit(len(ids) + span_tokens, chat.sampling, serving.limits, "messages")
        parser = OutputParser(thinking=chat.thinking, tools=bool(chat.tools), stop=chat.sampling.stop)
        frames = m.Frames()
        images = [frames.add(torch.frombuffer(bytearray(image), dtype=torch.uint8)) for image in chat.images]
        run = Generation(serving, request, serving.generate(ids, max_tokens, chat.sampling, images), parser, frames)
        head = {"id": f"chatcmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": settings.model}
        if chat.sampling.stream:
            return await _stream(run, lambda d, reason: _chat_chunk(head, d, reason, chat.thinking),
                                 chat.sampling.include_usage, {**head, "object": "chat.completion.chunk"},
                                 first={**head, "object": "chat.completion.chunk", "choices": [
                                     {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                      "finish_reason": None}]})
        await _drain(run)
        reasoning, content = "".join(parser.reasoning), "".join(parser.content)
        message = {"role": "assistant", "content": content or (None if parser.tool_calls else "")}
        if chat.thinking:
            message["reasoning_content"] = reasoning
        if parser.tool_calls:
            message["tool_calls"] = parser.tool_calls
        return {**head, "object": "chat.completion", "choices": [
            {"index": 0, "message": message, "logprobs": None, "finish_reason": run.reason}], "usage": run.usage()}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await serving.body(request)
        prompt = completion_prompt(body, serving.limits)
        sampling = parse_sampling(body, serving.limits, ("max_tokens",), settings.temperature, settings.top_p)
        ids = prompt if isinstance(prompt, list) else await run_in_threadpool(encode, serving.tokenizer, prompt)
        max_tokens = fit(len(ids), sampling, serving.limits, "prompt")
        parser = OutputParser(stop=sampling.stop)
        run = Generation(serving, request, serving.generate(ids, max_tokens, sampling), parser)
        head = {"id": f"cmpl-{secrets.token_hex(12)}", "created": int(time.time()), "model": settings.model}
        if sampling.stream:
            return await _stream(run, lambda d, reason: _completion_chunk(head, d, reason), sampling.include_usage,
                                 {**head, "object": "text_completion"})
        await _drain(run)
        return {**head, "object": "text_completion", "choices": [
            {"index": 0, "text": "".join(run.parser.content), "logprobs": None, "finish_reason": run.reason}],
            "usage": run.usage()}

    return app


def _chat_ids(serving: ServingApp, chat: ChatRequest) -> list[int]:
    effort = chat.reasoning_effort
    if chat.thinking and effort is None:
        effort = "high"  # the release's default effort in thinking mode
    try:
        prompt = render(chat.messages, thinking=chat.thinking, reasoning_effort=effort, tools=chat.tools)
    except (ValueError, KeyError, TypeError) as e:
        param = "reasoning_effort" if "reasoning_effort" in str(e) else "tools" if "tool must" in str(e) \
            else "messages"
        raise APIError(400, str(e), param=param) from None
    if not chat.images:
        return encode(serving.tokenizer, prompt, bos=False)
    ids = []  # one image placeholder id per image part, whatever the tokenizer makes of its text
    for i, piece in enumerate(prompt.split(IMAGE)):
        ids += ([serving.settings.image_token_id] if i else []) + (encode(serving.tokenizer, piece, bos=False)
                                                                    if piece else [])
    return ids


def _image_tokens(serving: ServingApp, images: list[bytes]) -> int:
    """Checks the request's images as the tokenizer will (a bad one is a 400 here) and returns the
    prompt tokens their spans add beyond their placeholders."""
    vision = serving.settings.vision
    if vision is None:
        raise APIError(400, "this model has no vision tower: send text parts only", param="messages",
                       code="images_not_supported")
    if len(images) > MAX_IMAGES:
        raise APIError(400, f"{len(images)} images in one request; the limit is {MAX_IMAGES}", param="messages",
                       code="invalid_image")
    try:
        return sum(preprocess(image, vision).plan.n_tokens - 1 for image in images)
    except ImageError as e:
        raise APIError(400, f"an image_url part: {e}", param="messages", code="invalid_image") from None


async def _drain(run: Generation) -> None:
    try:
        async for _ in run.deltas():
            pass
    except Disconnected:
        raise APIError(499, "the client closed the request") from None


def _chat_chunk(head: dict, delta: Delta, reason: str | None, thinking: bool) -> dict | None:
    part = {}
    if delta.reasoning and thinking:
        part["reasoning_content"] = delta.reasoning
    if delta.content:
        part["content"] = delta.content
    if delta.tool_calls:
        part["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta.tool_calls)]
    if not part and reason is None:
        return None
    return {**head, "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": part, "logprobs": None, "finish_reason": reason}]}


def _completion_chunk(head: dict, delta: Delta, reason: str | None) -> dict | None:
    if not delta.content and reason is None:
        return None
    return {**head, "object": "text_completion",
            "choices": [{"index": 0, "text": delta.content, "logprobs": None, "finish_reason": reason}]}


async def _stream(run: Generation, chunk, include_usage: bool, usage_head: dict,
                  first: dict | None = None) -> StreamingResponse:
    """Server-sent events. The first output (or the failure) is awaited before the response starts, so
    a request refused by the pipeline (full queue, a component down) gets its HTTP status."""
    deltas = run.deltas()
    try:
        pending = await deltas.__anext__()
    except StopAsyncIteration:
        pending = None
    except Disconnected:
        await deltas.aclose()
        raise APIError(499, "the client closed the request") from None

    async def events() -> AsyncIterator[str]:
        usage = {"usage": None} if include_usage else {}
        try:
            if first is not None:
                yield _sse({**first, **usage})
            piece = pending
            while piece is not None:
                try:
                    after = await deltas.__anext__()
                except StopAsyncIteration:
                    after = None
                out = chunk(piece, run.reason if after is None else None)
                if out is not None:
                    yield _sse({**out, **usage})
                piece = after
            if include_usage:
                yield _sse({**usage_head, "choices": [], "usage": run.usage()})
        except APIError as e:
            yield _sse(e.body())
        except Disconnected:
            return
        finally:
            await deltas.aclose()
        yield _sse("[DONE]")

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
