"""Every message the components exchange, and the one way to put them on and take them off the wire.

A message is `[kind, body, *tensor frames]`: `kind` is one byte naming the struct, `body` its
msgpack encoding, and each tensor travels as its own frame described in the body by a `Tensor`
(dtype from a whitelist, shape, frame index, byte length), so large activations are never copied
into msgpack and never pickled. `decode` is the only way in: it turns every malformed, oversized,
mistyped or inconsistent message into a `MessageError` whose text names the problem, so a receiver
answers with an `Error` and keeps serving. Sizes have two bounds: the static `Meta` caps below (the
architecture's limits) and a `Limits` table of the largest legitimate message of each kind for one
model (`dsv41.components.limits`), which `decode` checks and the sockets' MAXMSGSIZE enforces.

Wire evolution: new fields go last with defaults; `PROTOCOL_VERSION` changes when that is not enough.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from enum import IntEnum
from typing import Annotated, Any

import msgspec
import numpy as np
import torch

from dsv41.pipelines.schema import MAX_TEMPERATURE

PROTOCOL_VERSION = 1
MAX_FRAMES = 64
MAX_DIMS = 8
MAX_TENSOR_BYTES = 1 << 31
MAX_TOKENS = 1 << 20  # the longest context of the architecture
TEXT_BYTES_PER_TOKEN = 4  # UTF-8 bytes of text per token a prompt may bring (the byte tokenizer needs 1)
MAX_TEXT = TEXT_BYTES_PER_TOKEN * MAX_TOKENS
# MAXMSGSIZE and per-kind limit of sockets made without a model's limits (tools, tests): every message
# of the `micro`/`mini` test models at their test sizes fits.
DEFAULT_MAX_BYTES = 64 << 20

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
    "uint8": torch.uint8, "int8": torch.int8, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e8m0fnu": torch.float8_e8m0fnu,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

RequestId = Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
ShortText = Annotated[str, msgspec.Meta(max_length=4096)]
TokenBytes = Annotated[bytes, msgspec.Meta(max_length=4 * MAX_TOKENS)]  # int32 little-endian ids
Count = Annotated[int, msgspec.Meta(ge=0, lt=1 << 62)]
Positions = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]  # sequence lengths and capacities
Counters = Annotated[dict[Annotated[str, msgspec.Meta(max_length=64)], Count], msgspec.Meta(max_length=256)]
MAX_SPANS = 16  # images per prompt (dsv41.model.image_processor.MAX_IMAGES)


class MessageError(ValueError):
    """A message that cannot be accepted; `code` says which rule it broke."""

    def __init__(self, code: ErrorCode, text: str):
        super().__init__(text)
        self.code = code


class ErrorCode(IntEnum):
    MALFORMED = 1  # not a message: bad frames, bad msgpack, wrong fields
    UNEXPECTED = 2  # a valid message this receiver does not take
    BAD_TENSOR = 3  # tensor descriptor and frames disagree, or a dtype off the whitelist
    VERSION = 4  # another protocol version
    INVALID_REQUEST = 5  # well-formed, but not servable (prompt over the context limit, ...)
    UNKNOWN_REQUEST = 6  # a request id this component holds no state for (e.g. after a restart)
    UNAVAILABLE = 7  # a component this request needs died or did not answer in time
    INTERNAL = 8  # the component failed on this request
    SHUTTING_DOWN = 9
    CAPACITY = 10  # the component's global KV page pool cannot hold this request now
    TOO_LARGE = 11  # bigger than any legitimate message of its kind for this model


class FinishReason(IntEnum):
    LENGTH = 0
    EOS = 1
    ERROR = 2
    CANCELLED = 3  # the client released the request (e.g. its connection closed)


class Tensor(msgspec.Struct, frozen=True, array_like=True, gc=False, forbid_unknown_fields=True):
    """Where a tensor is: frame `frame` holds `nbytes` bytes of `dtype` in C order, `shape`."""

    dtype: Annotated[str, msgspec.Meta(max_length=32)]
    shape: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 40)]], msgspec.Meta(max_length=MAX_DIMS)]
    frame: Annotated[int, msgspec.Meta(ge=0, lt=MAX_FRAMES)]
    nbytes: Annotated[int, msgspec.Meta(ge=0, le=MAX_TENSOR_BYTES)]


# images and spans of one prompt: the wire takes up to MAX_FRAMES, so the tokenizer can name the real limit
ImageFrames = Annotated[list[Tensor], msgspec.Meta(max_length=MAX_FRAMES)]
SpanCounts = Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKENS)]], msgspec.Meta(max_length=MAX_FRAMES)]


class Message(msgspec.Struct, frozen=True, array_like=True, gc=False, forbid_unknown_fields=True, kw_only=True):
    version: int = PROTOCOL_VERSION


# --- control ------------------------------------------------------------------------------------

class Error(Message):
    request_id: RequestId
    code: ErrorCode
    component: ShortText
    text: ShortText


class Ping(Message):
    request_id: RequestId


class Pong(Message):
    request_id: RequestId
    component: ShortText
    pid: int
    uptime_s: float
    counters: Counters = {}


class Release(Message):
    """Free every piece of state held for a request (finished, failed or abandoned)."""

    request_id: RequestId


class Ack(Message):
    request_id: RequestId


# --- client <-> dspark, dspark <-> tokenizer --------------------------------------------------------

class Generate(Message):
    request_id: RequestId
    prompt: Text = ""
    ids: TokenBytes = b""  # used instead of the prompt when not empty
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)] = 64
    temperature: Annotated[float, msgspec.Meta(ge=0, le=MAX_TEMPERATURE)] = 0.0
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    seed: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] = 0
    prefill_mode: Annotated[str, msgspec.Meta(pattern="^(ced|exact|full)$")] = "ced"
    stop_at_eos: bool = True
    images: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    image_data: ImageFrames = []  # encoded image files (uint8), one per image placeholder of the prompt


class TokenEvent(Message):
    request_id: RequestId
    token: int
    text: Text


class Finished(Message):
    request_id: RequestId
    reason: FinishReason
    prompt_tokens: Count
    generated_tokens: Count
    cached_tokens: Count  # prompt tokens whose global KV came from the store
    replayed_layer_tokens: Count
    encoder_layer_tokens: Count
    ttft_s: float
    decode_s: float
    engram_wait_s: float = 0.0
    # DSpark: verification steps that carried drafts, the drafts they verified and accepted, the
    # accepted drafts by position in the block, how many steps chose each length (index = drafts,
    # 0 included) and the seconds spent drafting
    verifications: Count = 0
    draft_tokens: Count = 0
    accepted_tokens: Count = 0
    accepted_by_position: Annotated[list[Count], msgspec.Meta(max_length=64)] = []
    lengths: Annotated[list[Count], msgspec.Meta(max_length=65)] = []
    drafter_s: float = 0.0


class Tokenize(Message):
    request_id: RequestId
    text: Text
    images: Annotated[int, msgspec.Meta(ge=0, le=1024)] = 0
    image_data: ImageFrames = []  # encoded image files (uint8): expand, run the ViT, answer with spans
    ids: TokenBytes = b""  # the prompt as token ids instead of the text (images placed by their placeholders)


class Tokens(Message):
    request_id: RequestId
    ids: TokenBytes
    spans: ImageFrames = []  # each image's span rows [n, hidden] bf16 (ViT + aligner + delimiters)
    span_starts: SpanCounts = []  # the first position of each span in ids


class Detokenize(Message):
    request_id: RequestId
    ids: TokenBytes


class Detokenized(Message):
    request_id: RequestId
    text: Text


# --- dspark -> encoder -> decoder -------------------------------------------------------------------

class Prefill(Message):
    request_id: RequestId
    ids: TokenBytes
    mode: Annotated[str, msgspec.Meta(pattern="^(ced|exact|full)$")] = "ced"
    capacity: Positions = 0  # cache positions to reserve; 0: prompt + a default margin
    engram_prefetch: bool = False  # rows arrive from the engram component
    spans: ImageFrames = []  # image span rows [n, hidden] bf16 (Tokens.spans)
    span_starts: SpanCounts = []


class Step(Message):
    """1..k new tokens (k > 1: verification of drafted tokens)."""

    request_id: RequestId
    ids: TokenBytes
    engram_prefetch: bool = False


class StepItem(msgspec.Struct, frozen=True, array_like=True, gc=False, forbid_unknown_fields=True):
    request_id: RequestId
    ids: TokenBytes
    engram_prefetch: bool = False
    # position of the first token: -1 (or the sequence's length) steps on; an earlier position must be
    # where the request's last verification step took its checkpoint, and rolls the drafts back
    start: Annotated[int, msgspec.Meta(ge=-1, le=MAX_TOKENS)] = -1
    verify: bool = False  # the tokens after the first are drafts: keep a checkpoint to roll back to


MAX_BATCH = 256
BatchIds = Annotated[list[RequestId], msgspec.Meta(max_length=MAX_BATCH)]
BatchCounts = Annotated[list[Count], msgspec.Meta(max_length=MAX_BATCH)]


# The routing id a caller gives its own connection to the decoder, so that the decoder answers a
# batched step to it directly (empty: the encoder passes the decoder's reply on).
ReplyTo = Annotated[bytes, msgspec.Meta(max_length=64)]


class BatchStep(Message):
    """One step of several requests (1..k tokens each), computed as one batch."""

    request_id: RequestId  # of the batch
    items: Annotated[list[StepItem], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]
    reply_to: ReplyTo = b""


class ItemError(msgspec.Struct, frozen=True, array_like=True, gc=False, forbid_unknown_fields=True):
    """A request of a batch that could not be stepped (the others were)."""

    request_id: RequestId
    code: ErrorCode
    component: ShortText
    text: ShortText


class DecoderBatchStep(Message):
    request_id: RequestId  # of the batch
    request_ids: BatchIds
    starts: BatchCounts
    sizes: BatchCounts  # tokens of each request; the streams are concatenated in this order
    streams: Tensor  # [1, sum(sizes), hc, dim]
    pre_mix: Tensor
    verify: Annotated[list[bool], msgspec.Meta(max_length=MAX_BATCH)] = []  # per request (StepItem.verify)
    errors: Annotated[list[ItemError], msgspec.Meta(max_length=MAX_BATCH)] = []  # the encoder's, passed on
    reply_to: ReplyTo = b""  # BatchStep.reply_to: the decoder's reply goes there (the Server routes it)


class BatchLogits(Message):
    request_id: RequestId  # of the batch
    request_ids: BatchIds  # the requests stepped, in order
    sizes: BatchCounts
    logits: Tensor  # [sum(sizes), vocab] fp32
    main_hidden: Tensor | None = None  # [sum(sizes), 3 * dim]
    errors: Annotated[list[ItemError], msgspec.Meta(max_length=MAX_BATCH)] = []


class DecoderPrefill(Message):
    """Encoder -> decoder: the decoder group's global KV for positions [0, length) (packed
    entries), and the encoder output streams the decoder replay starts from."""

    request_id: RequestId
    length: Positions
    capacity: Positions
    starts: Annotated[list[Count], msgspec.Meta(max_length=64)]  # first position per decoder layer
    kv_from: Count  # first entry in main_kv/index_k (entries before it are already there)
    main_kv: Tensor
    index_k: Tensor
    streams: Tensor  # [1, s, hc, dim] encoder output at positions length - s .. length - 1
    pre_mix: Tensor
    span_starts: SpanCounts = []  # image spans of the prompt (positions only: bias_vl in the MoE gates)
    span_lengths: SpanCounts = []
    # the encoder sends a batched step right after this (the prompt's last chunk ran in its encoder
    # pass): the replay waits for it and runs in its decoder pass
    step_follows: bool = False


class DecoderStep(Message):
    request_id: RequestId
    start: Count
    streams: Tensor
    pre_mix: Tensor
    capacity: Positions = 0  # > 0: first chunk of a `full` prefill; allocate the sequence with this capacity
    span_starts: SpanCounts = []  # image spans of the prompt (a `full` prefill's chunks)
    span_lengths: SpanCounts = []


class Logits(Message):
    """Logits of the last prompt token (prefill) or of each step token, plus DSpark's input."""

    request_id: RequestId
    logits: Tensor  # [k, vocab] fp32
    main_hidden: Tensor | None = None  # [k, 3 * dim]: mean over hc of the streams entering 37-39
    cached_tokens: Count = 0
    replayed_layer_tokens: Count = 0
    encoder_layer_tokens: Count = 0
    decoder_layer_tokens: Count = 0
    engram_wait_s: float = 0.0


# --- engram ------------------------------------------------------------------------------------------

class EngramPrefetch(Message):
    """Compute the Engram rows of ids at positions start.. and push them to the encoder."""

    request_id: RequestId
    ids: TokenBytes  # tokens from position `offset` on (the n-grams look back a few positions)
    offset: Count
    start: Count


class EngramRows(Message):
    request_id: RequestId
    start: Count
    rows: Tensor  # [n_engram_layers, s, n_cols, head_dim] bf16, looked-up table rows
    sent_at: float  # time.time() when pushed, to measure the lead over the encoder's need


# --- kvstore -----------------------------------------------------------------------------------------

Key = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
Keys = Annotated[list[Key], msgspec.Meta(max_length=MAX_TOKENS // 16)]


class ImageKey(msgspec.Struct, frozen=True, array_like=True, gc=False, forbid_unknown_fields=True):
    """Mixed into the chain key of block `block` (an image span starts there): position and content digest."""

    block: Count
    key: Annotated[bytes, msgspec.Meta(max_length=64)]


class Lookup(Message):
    request_id: RequestId
    ids: TokenBytes
    image_keys: Annotated[list[ImageKey], msgspec.Meta(max_length=MAX_FRAMES)] = []


class LookupResult(Message):
    request_id: RequestId
    keys: Keys
    cached_blocks: Count
    block_tokens: Count
    snapshot: Tensor | None = None  # pooled encoder SWA rings at the end of the cached blocks


class GetBlocks(Message):
    request_id: RequestId
    keys: Keys


class Blocks(Message):
    """Payloads of the first len(payloads) keys asked for (stops at the first miss)."""

    request_id: RequestId
    payloads: Annotated[list[Tensor], msgspec.Meta(max_length=MAX_FRAMES - 2)]


class PutBlocks(Message):
    request_id: RequestId
    keys: Keys
    payloads: Annotated[list[Tensor], msgspec.Meta(max_length=MAX_FRAMES - 3)]
    snapshot_key: Annotated[bytes, msgspec.Meta(max_length=32)] = b""  # chain key of the snapshot's position
    snapshot: Tensor | None = None  # encoder SWA rings there, for the host pool


class Stored(Message):
    request_id: RequestId
    stored: Count
    full: bool = False


class KIND(IntEnum):
    ERROR = 1
    PING = 2
    PONG = 3
    RELEASE = 4
    ACK = 5
    GENERATE = 10
    TOKEN = 11
    FINISHED = 12
    TOKENIZE = 13
    TOKENS = 14
    DETOKENIZE = 15
    DETOKENIZED = 16
    PREFILL = 20
    STEP = 21
    DECODER_PREFILL = 22
    DECODER_STEP = 23
    LOGITS = 24
    BATCH_STEP = 25
    DECODER_BATCH_STEP = 26
    BATCH_LOGITS = 27
    ENGRAM_PREFETCH = 30
    ENGRAM_ROWS = 31
    LOOKUP = 40
    LOOKUP_RESULT = 41
    GET_BLOCKS = 42
    BLOCKS = 43
    PUT_BLOCKS = 44
    STORED = 45


TYPES: dict[KIND, type[Message]] = {
    KIND.ERROR: Error, KIND.PING: Ping, KIND.PONG: Pong, KIND.RELEASE: Release, KIND.ACK: Ack,
    KIND.GENERATE: Generate, KIND.TOKEN: TokenEvent, KIND.FINISHED: Finished, KIND.TOKENIZE: Tokenize,
    KIND.TOKENS: Tokens, KIND.DETOKENIZE: Detokenize, KIND.DETOKENIZED: Detokenized,
    KIND.PREFILL: Prefill, KIND.STEP: Step, KIND.DECODER_PREFILL: DecoderPrefill, KIND.DECODER_STEP: DecoderStep,
    KIND.LOGITS: Logits, KIND.BATCH_STEP: BatchStep, KIND.DECODER_BATCH_STEP: DecoderBatchStep,
    KIND.BATCH_LOGITS: BatchLogits, KIND.ENGRAM_PREFETCH: EngramPrefetch, KIND.ENGRAM_ROWS: EngramRows,
    KIND.LOOKUP: Lookup, KIND.LOOKUP_RESULT: LookupResult, KIND.GET_BLOCKS: GetBlocks, KIND.BLOCKS: Blocks,
    KIND.PUT_BLOCKS: PutBlocks, KIND.STORED: Stored,
}
KIND_OF = {t: k for k, t in TYPES.items()}
# What each component answers with (besides Error and Pong): its callers' sockets are sized for these.
REPLIES: dict[str, frozenset[KIND]] = {
    "tokenizer": frozenset({KIND.TOKENS, KIND.DETOKENIZED}),
    "engram": frozenset(),
    "encoder": frozenset({KIND.LOGITS, KIND.BATCH_LOGITS, KIND.ACK}),
    "decoder": frozenset({KIND.LOGITS, KIND.BATCH_LOGITS, KIND.ACK}),
    "dspark": frozenset({KIND.TOKEN, KIND.FINISHED}),
    "kvstore": frozenset({KIND.LOOKUP_RESULT, KIND.BLOCKS, KIND.STORED}),
}


class Limits:
    """The largest legitimate size in bytes (body and frames) of each kind of message. A socket's
    MAXMSGSIZE is the largest over the kinds it receives; `decode` holds each message to its kind's."""

    def __init__(self, by_kind: Mapping[KIND, int]):
        if set(by_kind) != set(KIND):
            raise ValueError(f"limits for {sorted(set(KIND) - set(by_kind))} are missing")
        self.by_kind = dict(by_kind)

    @classmethod
    def flat(cls, nbytes: int) -> Limits:
        return cls(dict.fromkeys(KIND, nbytes))

    def largest(self, kinds: Iterable[KIND]) -> int:
        return max((self.by_kind[k] for k in kinds), default=0)

    def replies_of(self, component: str) -> int:
        """MAXMSGSIZE for a socket that calls `component` (a name outside REPLIES: any kind)."""
        return self.largest(REPLIES.get(component, frozenset(KIND)) | {KIND.ERROR, KIND.PONG})

    def check(self, kind: KIND, nbytes: int) -> None:
        if nbytes > self.by_kind[kind]:
            raise MessageError(ErrorCode.TOO_LARGE, f"a {TYPES[kind].__name__} of {nbytes} bytes is over the "
                                                    f"{self.by_kind[kind]} bytes any legitimate one takes")


DEFAULT_LIMITS = Limits.flat(DEFAULT_MAX_BYTES)
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {k: msgspec.msgpack.Decoder(t) for k, t in TYPES.items()}
_TENSOR_FIELDS = {
    t: [f.name for f in msgspec.structs.fields(t) if "Tensor" in str(f.type)] for t in TYPES.values()
}


class Frames:
    """Collects the tensor frames of one outgoing message; `add` returns the descriptor to put in it."""

    def __init__(self):
        self.buffers: list[memoryview] = []
        self._keep: list[torch.Tensor] = []  # the memory the buffers view, alive until sent

    def add(self, tensor: torch.Tensor) -> Tensor:
        if tensor.dtype not in DTYPE_NAMES:
            raise MessageError(ErrorCode.BAD_TENSOR, f"dtype {tensor.dtype} cannot be sent")
        flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        self._keep.append(flat)
        self.buffers.append(memoryview(flat.numpy()))
        return Tensor(DTYPE_NAMES[tensor.dtype], list(tensor.shape), len(self.buffers) - 1, flat.numel())


def encode(message: Message, frames: Frames | None = None) -> list:
    """Wire frames of a message: [kind byte, msgpack body, *tensor buffers] (buffers not copied). Text
    that is not valid Unicode (lone surrogates, e.g. undecodable bytes of a command line) is refused."""
    try:
        body = _ENCODER.encode(message)
    except UnicodeEncodeError as e:
        raise MessageError(ErrorCode.INVALID_REQUEST, f"{type(message).__name__} holds text that is not valid "
                                                      f"Unicode: {e.reason} at character {e.start}") from None
    return [bytes([KIND_OF[type(message)]]), body, *(frames.buffers if frames else [])]


def encoded_size(parts: list) -> int:
    """Bytes of a message's frames, as `encode` returns them or as received."""
    return sum(memoryview(p.buffer if hasattr(p, "buffer") else p).nbytes for p in parts)


def decode(parts: list, accept: frozenset[KIND] | None = None,
           limits: Limits = DEFAULT_LIMITS) -> tuple[Message, list[memoryview]]:
    """Check and decode wire frames; returns the message and its tensor frames.
    Raises MessageError, and nothing else, for anything that does not fit (its kind's size in `limits`
    is checked before the body is decoded)."""
    if len(parts) < 2 or len(parts) > MAX_FRAMES + 2:
        raise MessageError(ErrorCode.MALFORMED, f"a message has 2..{MAX_FRAMES + 2} frames, got {len(parts)}")
    head, body, *tensors = (memoryview(p.buffer if hasattr(p, "buffer") else p) for p in parts)
    if len(head) != 1 or head[0] not in _DECODERS:
        raise MessageError(ErrorCode.MALFORMED, f"unknown message kind frame {bytes(head[:8])!r}")
    kind = KIND(head[0])
    if accept is not None and kind not in accept:
        raise MessageError(ErrorCode.UNEXPECTED, f"this component does not take {TYPES[kind].__name__} messages")
    limits.check(kind, encoded_size(parts))
    try:
        message = _DECODERS[kind].decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError, ValueError) as e:
        raise MessageError(ErrorCode.MALFORMED, f"malformed {TYPES[kind].__name__}: {e}") from None
    if message.version != PROTOCOL_VERSION:
        raise MessageError(ErrorCode.VERSION, f"protocol version {message.version}, this side speaks "
                                              f"{PROTOCOL_VERSION}")
    _check_tensors(message, tensors)
    return message, tensors


def _descriptors(message: Message) -> list[Tensor]:
    out = []
    for name in _TENSOR_FIELDS[type(message)]:
        value = getattr(message, name)
        out += value if isinstance(value, list) else [value] if value is not None else []
    return out


def _check_tensors(message: Message, frames: list[memoryview]) -> None:
    """Every descriptor names its own frame, the frame holds exactly shape x itemsize bytes of a
    whitelisted dtype, and no frame is left over; nothing is allocated from claimed sizes."""
    descriptors = _descriptors(message)
    used = sorted(d.frame for d in descriptors)
    if used != list(range(len(frames))):
        raise MessageError(ErrorCode.BAD_TENSOR, f"{type(message).__name__} describes frames {used} "
                                                 f"but carries {len(frames)} tensor frames")
    for d in descriptors:
        dtype = DTYPES.get(d.dtype)
        if dtype is None:
            raise MessageError(ErrorCode.BAD_TENSOR, f"dtype {d.dtype!r} is not one of {sorted(DTYPES)}")
        expected = math.prod(d.shape) * dtype.itemsize  # Python ints: a claimed shape cannot overflow
        if expected != d.nbytes or d.nbytes != frames[d.frame].nbytes:
            raise MessageError(ErrorCode.BAD_TENSOR, f"tensor of {d.dtype} {d.shape} needs {expected} bytes; "
                                                     f"described {d.nbytes}, frame holds {frames[d.frame].nbytes}")


def tensor(descriptor: Tensor, frames: list[memoryview]) -> torch.Tensor:
    """The tensor a checked descriptor names (a copy: the receive buffers are not kept alive)."""
    data = frames[descriptor.frame]
    flat = torch.tensor(np.frombuffer(data, dtype=np.uint8)) if data.nbytes else torch.empty(0, dtype=torch.uint8)
    return flat.view(DTYPES[descriptor.dtype]).reshape(descriptor.shape)


def pack_ids(ids: list[int] | torch.Tensor) -> bytes:
    try:
        array = np.asarray(ids.tolist() if isinstance(ids, torch.Tensor) else ids, dtype=np.int64)
    except OverflowError:  # an id past int64
        array = None
    if array is None or array.size and (array.min() < 0 or array.max() >= 1 << 31):
        raise MessageError(ErrorCode.INVALID_REQUEST, "token ids must be in [0, 2^31)")
    return array.astype("<i4").tobytes()


def unpack_ids(data: bytes, vocab_size: int | None = None) -> list[int]:
    """Token ids from their wire bytes; with `vocab_size`, ids outside [0, vocab_size) are an invalid
    request here rather than an index error deep inside the model."""
    if len(data) % 4:
        raise MessageError(ErrorCode.MALFORMED, f"token id bytes must be a multiple of 4, got {len(data)}")
    array = np.frombuffer(data, dtype="<i4")
    if vocab_size is not None and array.size and (array.min() < 0 or array.max() >= vocab_size):
        bad = int(array[(array < 0) | (array >= vocab_size)][0])
        raise MessageError(ErrorCode.INVALID_REQUEST, f"token id {bad} is out of range: ids must be in "
                                                      f"[0, {vocab_size}) (the model's vocabulary)")
    return array.tolist()


def error_reply(request_id: int, code: ErrorCode, component: str, text: str) -> Error:
    return Error(request_id=request_id, code=code, component=component, text=text[:4000])


def request_id_of(message: Any) -> int:
    return getattr(message, "request_id", 0)
