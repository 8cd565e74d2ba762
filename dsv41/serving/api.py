"""OpenAI request bodies -> a `Generate` for dspark, checked field by field.

Every problem is an `APIError` carrying the HTTP status and the OpenAI error body: the parameter it
names, a message that says what is allowed, and for capacity a Retry-After. Parameters the runtime
does not implement (n > 1, logit_bias, logprobs, penalties, ...) are refused by name rather than
ignored, so a client never gets output that silently differs from what it asked for.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from dsv41 import messages as m
from dsv41.model.image_processor import ImageError, data_url_bytes
from dsv41.pipelines.schema import MAX_TEMPERATURE

MAX_STOP = 16
ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers or {}
        self.kind = kind or {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                             413: "invalid_request_error", 429: "rate_limit_error",
                             503: "service_unavailable_error"}.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def component_error(error: m.Error, retry_after_s: int) -> APIError:
    """The HTTP form of a pipeline's `Error` reply."""
    text = f"{error.component}: {error.text}"
    match error.code:
        case m.ErrorCode.INVALID_REQUEST | m.ErrorCode.UNKNOWN_REQUEST:
            return APIError(400, text, code="invalid_request")
        case m.ErrorCode.CAPACITY:
            return APIError(429, text, code="rate_limit_exceeded", headers={"Retry-After": str(retry_after_s)})
        case m.ErrorCode.UNAVAILABLE | m.ErrorCode.SHUTTING_DOWN:
            return APIError(503, text, code="service_unavailable")
        case m.ErrorCode.TOO_LARGE:
            return APIError(413, text, code="request_too_large")
    return APIError(500, text, code="internal_error")


@dataclass
class Limits:
    model: str
    context: int  # the model's context in tokens
    default_max_tokens: int
    vocab_size: int


@dataclass
class Sampling:
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int
    stop: list[str]
    stream: bool
    include_usage: bool


@dataclass
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None
    thinking: bool
    reasoning_effort: int | str | None
    sampling: Sampling
    raw: dict = field(repr=False, default_factory=dict)
    images: list[bytes] = field(repr=False, default_factory=list)  # encoded files of the image_url parts, in order


# Known OpenAI parameters that dsv41 does not implement, with the values that mean "off".
UNSUPPORTED = {
    "n": (None, 1), "logit_bias": (None,), "logprobs": (None, False), "top_logprobs": (None, 0),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "best_of": (None, 1),
    "echo": (None, False), "suffix": (None,), "functions": (None,), "function_call": (None,),
    "audio": (None,), "modalities": (None,), "prediction": (None,), "web_search_options": (None,),
}
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "user",
          "metadata", "store", "service_tier"}
CHAT = COMMON | {"messages", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls",
                 "response_format", "reasoning_effort", "thinking", "chat_template_kwargs"}
COMPLETION = COMMON | {"prompt"}


def check_keys(body: dict, known: set[str]) -> None:
    for key, value in body.items():
        if key in UNSUPPORTED:
            if value in UNSUPPORTED[key] or key == "logit_bias" and value == {}:
                continue
            raise APIError(400, f"{key}={value!r} is not supported by dsv41", param=key, code="unsupported_parameter")
        if key not in known:
            raise APIError(400, f"Unrecognized request argument supplied: {key}", param=key,
                           code="unknown_parameter")


def check_model(body: dict, limits: Limits) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise APIError(400, "you must give `model` (a string); GET /v1/models lists it", param="model")
    if model != limits.model:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{limits.model}`",
                       param="model", code="model_not_found")


def _number(body: dict, key: str, low: float, high: float, default: float, low_open: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value < low or value > high or low_open and value == low:
        bound = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise APIError(400, f"{key} must be a number in {bound}, got {value!r}", param=key)
    return float(value)


def _integer(body: dict, key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise APIError(400, f"{key} must be an integer in [{low}, {high}], got {value!r}", param=key)
    return value


def sampling(body: dict, limits: Limits, token_keys: tuple[str, ...], default_temperature: float,
             default_top_p: float) -> Sampling:
    max_tokens = None
    for key in token_keys:
        given = _integer(body, key, 1, limits.context)
        max_tokens = given if given is not None else max_tokens
    temperature = _number(body, "temperature", 0.0, MAX_TEMPERATURE, default_temperature)
    top_p = _number(body, "top_p", 0.0, 1.0, default_top_p, low_open=True)
    seed = body.get("seed")
    if seed is None:
        seed = secrets.randbits(63)
    elif isinstance(seed, bool) or not isinstance(seed, int) or not -(1 << 63) <= seed < 1 << 64:
        raise APIError(400, f"seed must be a 64-bit integer, got {seed!r}", param="seed")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOP or not all(isinstance(s, str) for s in stop):
        raise APIError(400, f"stop must be a string or a list of at most {MAX_STOP} strings", param="stop")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise APIError(400, f"stream must be true or false, got {stream!r}", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"} \
                or not isinstance(options.get("include_usage", False), bool):
            raise APIError(400, "stream_options takes {\"include_usage\": true|false}", param="stream_options")
        if options.get("continuous_usage_stats"):
            raise APIError(400, "continuous_usage_stats is not supported", param="stream_options")
        include_usage = options.get("include_usage", False)
    return Sampling(max_tokens, temperature, top_p, seed % (1 << 63), [s for s in stop if s], stream, include_usage)


def _content_blocks(content: Any, where: str, images: list[bytes]) -> Any:
    """A message's content as chat.render takes it; the bytes of its image_url parts (data: URLs
    only: a remote URL is refused, never fetched) are appended to `images`."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param=where)
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url":
            images.append(_image_part(part, f"{where}[{j}]"))
            continue
        if kind in ("image", "input_image"):
            raise APIError(400, f"content parts of type {kind!r} are not supported; send {{\"type\": \"image_url\", "
                           "\"image_url\": {\"url\": \"data:image/png;base64,...\"}}", param=f"{where}[{j}]",
                           code="unsupported_parameter")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, f"{where}[{j}] must be {{\"type\": \"text\", \"text\": \"...\"}}",
                           param=f"{where}[{j}]")
    return content


def _image_part(part: dict, where: str) -> bytes:
    """The encoded image of an image_url part: a base64 data: URL; http(s) and other URLs are refused."""
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, dict) else ref
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{where} needs image_url.url: a data: URL (data:image/png;base64,...)", param=where)
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0] if ":" in url else "a non-data"
        raise APIError(400, f"image URLs are not fetched ({scheme} URL in {where}): send the image inline as a data: "
                       "URL (data:image/png;base64,...)", param=where, code="invalid_image_url")
    try:
        return data_url_bytes(url)
    except ImageError as e:
        raise APIError(400, f"{where}: {e}", param=where, code="invalid_image") from None


def chat_request(body: dict, limits: Limits, default_temperature: float, default_top_p: float) -> ChatRequest:
    check_keys(body, CHAT)
    check_model(body, limits)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    out, images = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise APIError(400, f"messages[{i}] must be an object whose role is one of {', '.join(ROLES)}",
                           param=f"messages[{i}]")
        message = dict(message)
        if message["role"] == "developer":
            message["role"] = "system"
        message["content"] = _content_blocks(message.get("content"), f"messages[{i}].content", images)
        calls = message.get("tool_calls")
        if calls is not None and (message["role"] != "assistant" or not isinstance(calls, list)):
            raise APIError(400, f"messages[{i}].tool_calls must be a list, on an assistant message",
                           param=f"messages[{i}].tool_calls")
        out.append(message)
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, "tools must be a list of {\"type\": \"function\", \"function\": {...}}", param="tools")
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise APIError(400, f"tool_choice={choice!r} is not supported; use \"auto\" or \"none\"",
                       param="tool_choice", code="unsupported_parameter")
    if choice == "none":
        tools = None
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise APIError(400, "response_format other than {\"type\": \"text\"} is not supported",
                       param="response_format", code="unsupported_parameter")
    return ChatRequest(out, tools or None, _thinking(body), body.get("reasoning_effort"),
                       sampling(body, limits, ("max_tokens", "max_completion_tokens"), default_temperature,
                                default_top_p), body, images)


def _thinking(body: dict) -> bool:
    """Thinking mode: `thinking: {"type": "enabled"}` (DeepSeek's API) or
    `chat_template_kwargs: {"thinking": true}` (vLLM's); chat mode otherwise."""
    thinking = body.get("thinking")
    kwargs = body.get("chat_template_kwargs")
    if thinking is not None:
        if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled") \
                or set(thinking) - {"type"}:
            raise APIError(400, "thinking must be {\"type\": \"enabled\"} or {\"type\": \"disabled\"}",
                           param="thinking")
        return thinking["type"] == "enabled"
    if kwargs is not None:
        if not isinstance(kwargs, dict) or set(kwargs) - {"thinking", "enable_thinking"} \
                or not all(isinstance(v, bool) for v in kwargs.values()):
            raise APIError(400, "chat_template_kwargs takes {\"thinking\": true|false}", param="chat_template_kwargs")
        return bool(kwargs.get("thinking", kwargs.get("enable_thinking", False)))
    return False


def completion_prompt(body: dict, limits: Limits) -> str | list[int]:
    check_keys(body, COMPLETION)
    check_model(body, limits)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        if not all(0 <= i < limits.vocab_size for i in prompt):
            raise APIError(400, f"token ids must be in [0, {limits.vocab_size})", param="prompt")
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, str | list) for p in prompt):
        raise APIError(400, "one prompt per request: a list of several prompts is not supported", param="prompt",
                       code="unsupported_parameter")
    raise APIError(400, "prompt must be a non-empty string or a list of token ids", param="prompt")


def fit(prompt_tokens: int, sampling: Sampling, limits: Limits, param: str) -> int:
    """max_tokens for a prompt of this many tokens: the request's, else the pipeline default, capped
    by what the context leaves; a prompt that does not fit is a 400 naming the limit."""
    room = limits.context - prompt_tokens
    wanted = sampling.max_tokens if sampling.max_tokens is not None else min(limits.default_max_tokens, room)
    if room < 1 or wanted > room:
        raise APIError(400, f"This model's maximum context length is {limits.context} tokens. However, you "
                            f"requested {prompt_tokens + max(wanted, 1)} tokens ({prompt_tokens} in the prompt, "
                            f"{max(wanted, 1)} in the completion). Please reduce the length of the prompt or "
                            "the completion.", param=param, code="context_length_exceeded")
    return wanted
