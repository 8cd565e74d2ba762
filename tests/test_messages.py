"""The wire format: exact tensor round trips, property tests over every struct, and hostile input
(lying descriptors, mutations, random bytes, deep nesting) that must end in a `MessageError`."""

from __future__ import annotations

import re
import tracemalloc
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsv41 import messages as m

PACKAGE = Path(m.__file__).resolve().parent
PROPERTY = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = list(m.TYPES)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, so fp8 and NaN patterns compare exactly."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def _wire(parts: list) -> list[bytes]:
    """What a receiver gets: each frame as its own bytes object."""
    return [bytes(p) for p in parts]


def _raises(parts: list, code: m.ErrorCode, *substrings: str, accept=None) -> m.MessageError:
    with pytest.raises(m.MessageError) as info:
        m.decode(parts, accept)
    assert info.value.code == code, str(info.value)
    for text in substrings:
        assert text.lower() in str(info.value).lower()  # library wording differs in case between versions
    return info.value


# --- tensor round trips ---------------------------------------------------------------------------

def _sample_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    grid = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    return {
        "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
        "fp32": torch.randn(4, 7, generator=g),
        "empty": torch.empty(0, 5),
        "scalar": torch.tensor(3.5),
        "strided": grid[::2, 1::3],
        "transposed": grid.t(),
        "fp8_e4m3": torch.randn(4, 8, generator=g).to(torch.float8_e4m3fn),
        "fp8_e8m0": torch.randint(0, 256, (2, 16), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu),
        "uint8_packed": torch.randint(0, 256, (3, 16), generator=g, dtype=torch.uint8),
        "bool": torch.randint(0, 2, (5, 3), generator=g).bool(),
        "int64": torch.tensor([-(2**63), -1, 0, 2**63 - 1]),
    }


SAMPLES = _sample_tensors()


def _assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(_bits(got), _bits(want))
    if want.dtype not in (torch.float8_e4m3fn, torch.float8_e8m0fnu):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", list(SAMPLES))
def test_tensor_round_trip_is_exact(name):
    original = SAMPLES[name]
    frames = m.Frames()
    sent = m.Logits(request_id=7, logits=frames.add(original))
    parts = m.encode(sent, frames)
    assert len(parts) == 3
    message, tensors = m.decode(_wire(parts))
    assert message == sent
    assert message.main_hidden is None
    assert message.logits.dtype == m.DTYPE_NAMES[original.dtype]
    assert message.logits.shape == list(original.shape)
    assert message.logits.nbytes == original.numel() * original.element_size()
    _assert_same(m.tensor(message.logits, tensors), original)


def test_every_sample_in_one_message_keeps_order_and_frame_count():
    frames = m.Frames()
    sent = m.Blocks(request_id=3, payloads=[frames.add(t) for t in SAMPLES.values()])
    parts = m.encode(sent, frames)
    assert len(parts) == 2 + len(SAMPLES)
    message, tensors = m.decode(_wire(parts))
    assert [d.frame for d in message.payloads] == list(range(len(SAMPLES)))
    for descriptor, want in zip(message.payloads, SAMPLES.values(), strict=True):
        _assert_same(m.tensor(descriptor, tensors), want)


def test_message_with_four_tensors_and_an_optional_one():
    frames = m.Frames()
    streams, pre_mix = torch.randn(1, 3, 4, 8).to(torch.bfloat16), torch.randn(1, 3, 4)
    sent = m.DecoderPrefill(request_id=1, length=3, capacity=16, starts=[0, 1], kv_from=0,
                            main_kv=frames.add(torch.zeros(3, 2)), index_k=frames.add(torch.ones(3, dtype=torch.int8)),
                            streams=frames.add(streams), pre_mix=frames.add(pre_mix))
    parts = m.encode(sent, frames)
    assert len(parts) == 6
    message, tensors = m.decode(_wire(parts))
    assert message == sent
    _assert_same(m.tensor(message.streams, tensors), streams)
    _assert_same(m.tensor(message.pre_mix, tensors), pre_mix)

    frames = m.Frames()
    with_hidden = m.Logits(request_id=2, logits=frames.add(torch.ones(2, 9)), main_hidden=frames.add(torch.zeros(2, 6)))
    message, tensors = m.decode(_wire(m.encode(with_hidden, frames)))
    assert message.main_hidden == m.Tensor("float32", [2, 6], 1, 48)
    assert torch.equal(m.tensor(message.main_hidden, tensors), torch.zeros(2, 6))


def test_decoded_tensor_is_a_copy_of_the_receive_buffer():
    original = torch.arange(6, dtype=torch.int32)
    frames = m.Frames()
    parts = [bytearray(p) for p in m.encode(m.Logits(request_id=1, logits=frames.add(original)), frames)]
    message, tensors = m.decode(parts)
    got = m.tensor(message.logits, tensors)
    parts[2][:] = b"\xff" * len(parts[2])
    assert torch.equal(got, original)


def test_sender_keeps_the_memory_it_frames():
    frames = m.Frames()
    descriptor = frames.add(torch.arange(5, dtype=torch.int64) * 3)  # a temporary, referenced only by frames
    parts = _wire(m.encode(m.Logits(request_id=1, logits=descriptor), frames))
    assert np.frombuffer(parts[2], dtype="<i8").tolist() == [0, 3, 6, 9, 12]


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64, torch.int16])
def test_off_whitelist_dtype_cannot_be_sent(dtype):
    with pytest.raises(m.MessageError) as info:
        m.Frames().add(torch.zeros(2, dtype=dtype))
    assert info.value.code == m.ErrorCode.BAD_TENSOR
    assert f"dtype {dtype} cannot be sent" in str(info.value)


# --- properties over every struct -----------------------------------------------------------------

def _int(t: msgspec.inspect.IntType) -> st.SearchStrategy[int]:
    low = t.ge if t.ge is not None else t.gt + 1 if t.gt is not None else -(2**63)
    high = t.le if t.le is not None else t.lt - 1 if t.lt is not None else 2**63 - 1
    return st.integers(low, high)


def _float(t: msgspec.inspect.FloatType) -> st.SearchStrategy[float]:
    low = t.ge if t.ge is not None else t.gt
    high = t.le if t.le is not None else t.lt
    return st.floats(low, high, exclude_min=t.gt is not None, exclude_max=t.lt is not None, allow_nan=False)


def _tensor(draw, frames: list[bytes]) -> m.Tensor:
    name = draw(st.sampled_from(sorted(m.DTYPES)))
    shape = draw(st.lists(st.integers(0, 3), max_size=3))
    nbytes = int(np.prod(shape, dtype=np.int64)) * m.DTYPES[name].itemsize
    frames.append(draw(st.binary(min_size=nbytes, max_size=nbytes)))
    return m.Tensor(name, shape, len(frames) - 1, nbytes)


def _value(draw, t: msgspec.inspect.Type, frames: list[bytes]):
    """A valid value of a msgspec type, read from its constraints; tensors get matching frames."""
    mi = msgspec.inspect
    if isinstance(t, mi.StructType):
        if t.cls is m.Tensor:
            return _tensor(draw, frames)
        return t.cls(**{f.name: _value(draw, f.type, frames) for f in t.fields if f.name != "version"})
    if isinstance(t, mi.UnionType):
        return _value(draw, draw(st.sampled_from(t.types)), frames)
    if isinstance(t, mi.NoneType):
        return None
    if isinstance(t, mi.EnumType):
        return draw(st.sampled_from(list(t.cls)))
    if isinstance(t, mi.BoolType):
        return draw(st.booleans())
    if isinstance(t, mi.IntType):
        return draw(_int(t))
    if isinstance(t, mi.FloatType):
        return draw(_float(t))
    if isinstance(t, mi.StrType):
        if t.pattern is not None:
            return draw(st.from_regex(t.pattern, fullmatch=True))
        return draw(st.text(max_size=min(t.max_length or 12, 12)))
    if isinstance(t, mi.BytesType):
        low = t.min_length or 0
        return draw(st.binary(min_size=low, max_size=max(low, 24)))
    if isinstance(t, mi.ListType):
        count = draw(st.integers(t.min_length or 0, max(t.min_length or 0, min(3, t.max_length or 3))))
        return [_value(draw, t.item_type, frames) for _ in range(count)]
    if isinstance(t, mi.DictType):
        keys = draw(st.lists(st.text(max_size=8), max_size=3, unique=True))
        return {k: _value(draw, t.value_type, frames) for k in keys}
    raise AssertionError(f"no strategy for {t}")


@st.composite
def _messages(draw, kind: m.KIND) -> tuple[m.Message, list[bytes]]:
    frames: list[bytes] = []
    message = _value(draw, msgspec.inspect.type_info(m.TYPES[kind]), frames)
    return message, frames


def _wire_of(message: m.Message, frames: list[bytes]) -> list[bytes]:
    return _wire(m.encode(message)) + frames


def test_every_kind_names_its_own_struct():
    assert set(KINDS) == set(m.KIND)
    assert len(set(m.TYPES.values())) == len(m.TYPES)


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.name)
@PROPERTY
@given(data=st.data())
def test_every_struct_round_trips(kind, data):
    message, frames = data.draw(_messages(kind))
    parts = _wire_of(message, frames)
    assert parts[0] == bytes([kind])
    decoded, tensors = m.decode(parts, frozenset({kind}))
    assert type(decoded) is type(message)
    assert decoded == message
    assert [bytes(t) for t in tensors] == frames
    assert _wire(m.encode(decoded))[1] == parts[1]
    for descriptor in m._descriptors(decoded):
        assert _bits(m.tensor(descriptor, tensors)).numpy().tobytes() == frames[descriptor.frame]


def _decodes_or_refuses(parts: list, accept: frozenset[m.KIND] | None = None) -> m.Message | None:
    """The decode contract: a valid accepted message, or a MessageError; never another exception."""
    try:
        message, tensors = m.decode(parts, accept)
    except m.MessageError as e:
        assert isinstance(e.code, m.ErrorCode) and str(e)
        return None
    kind = m.KIND_OF[type(message)]
    assert accept is None or kind in accept
    assert message.version == m.PROTOCOL_VERSION
    again, _ = m.decode(_wire(m.encode(message)) + [bytes(t) for t in tensors])
    assert _wire(m.encode(again)) == _wire(m.encode(message))  # bytes: a mutated float may decode to NaN
    return message


@PROPERTY
@given(data=st.data())
def test_one_byte_mutations_decode_or_fail_cleanly(data):
    kind = data.draw(st.sampled_from(KINDS))
    message, frames = data.draw(_messages(kind))
    parts = _wire_of(message, frames)
    which = data.draw(st.integers(0, 1))
    target = bytearray(parts[which])
    at = data.draw(st.integers(0, len(target) - 1))
    target[at] = data.draw(st.integers(0, 255).filter(lambda b: b != target[at]))
    parts[which] = bytes(target)
    accept = data.draw(st.none() | st.frozensets(st.sampled_from(KINDS), min_size=1))
    _decodes_or_refuses(parts, accept)


_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**64), 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)


def _encodable(value) -> bytes:
    try:
        return msgspec.msgpack.encode(value)
    except OverflowError:  # integers past msgpack's range
        return b"\xc0"


@PROPERTY
@given(kind=st.sampled_from(KINDS), body=_msgpack_values, tensors=st.lists(st.binary(max_size=16), max_size=4))
def test_random_msgpack_bodies_decode_or_fail_cleanly(kind, body, tensors):
    _decodes_or_refuses([bytes([kind]), _encodable(body), *tensors])


@PROPERTY
@given(head=st.binary(max_size=3), body=st.binary(max_size=64), tensors=st.lists(st.binary(max_size=8), max_size=3))
def test_random_bytes_decode_or_fail_cleanly(head, body, tensors):
    _decodes_or_refuses([head, body, *tensors])


@PROPERTY
@given(parts=st.lists(st.binary(max_size=6), max_size=70))
def test_random_frame_lists_decode_or_fail_cleanly(parts):
    message = _decodes_or_refuses(parts)
    if not 2 <= len(parts) <= m.MAX_FRAMES + 2:
        assert message is None
        _raises(parts, m.ErrorCode.MALFORMED, f"a message has 2..{m.MAX_FRAMES + 2} frames, got {len(parts)}")


# --- lying tensor descriptors (T3) ----------------------------------------------------------------

def _logits(descriptor: m.Tensor, *frames: bytes) -> list[bytes]:
    return _wire(m.encode(m.Logits(request_id=1, logits=descriptor))) + list(frames)


@pytest.mark.parametrize(("descriptor", "frames", "code", "text"), [
    (m.Tensor("float64", [3], 0, 24), [bytes(24)], m.ErrorCode.BAD_TENSOR, "dtype 'float64' is not one of"),
    (m.Tensor("object", [1], 0, 8), [bytes(8)], m.ErrorCode.BAD_TENSOR, "dtype 'object' is not one of"),
    (m.Tensor("x" * 33, [1], 0, 1), [bytes(1)], m.ErrorCode.MALFORMED, "length <= 32"),
    (m.Tensor("float32", [3], 0, 16), [bytes(16)], m.ErrorCode.BAD_TENSOR, "needs 12 bytes; described 16"),
    (m.Tensor("float32", [3], 0, 12), [bytes(8)], m.ErrorCode.BAD_TENSOR, "described 12, frame holds 8"),
    (m.Tensor("bfloat16", [2, 3], 0, 12), [bytes(13)], m.ErrorCode.BAD_TENSOR, "frame holds 13"),
    (m.Tensor("float32", [-1], 0, 4), [bytes(4)], m.ErrorCode.MALFORMED, ">= 0"),
    (m.Tensor("uint8", [2**40], 0, 0), [b""], m.ErrorCode.MALFORMED, "<= 1099511627775 - at `$[1][1][0]`"),
    (m.Tensor("uint8", [1] * 9, 0, 1), [bytes(1)], m.ErrorCode.MALFORMED, "length <= 8"),
    (m.Tensor("uint8", [4], 0, -4), [bytes(4)], m.ErrorCode.MALFORMED, ">= 0"),
    (m.Tensor("uint8", [4], 0, m.MAX_TENSOR_BYTES + 1), [bytes(4)], m.ErrorCode.MALFORMED, "<= 2147483648"),
    (m.Tensor("uint8", [4], -1, 4), [bytes(4)], m.ErrorCode.MALFORMED, ">= 0"),
    (m.Tensor("uint8", [4], m.MAX_FRAMES, 4), [bytes(4)], m.ErrorCode.MALFORMED, "<= 63 - at `$[1][2]`"),
    (m.Tensor("uint8", [4], 1, 4), [bytes(4)], m.ErrorCode.BAD_TENSOR, "describes frames [1] but carries 1"),
    (m.Tensor("uint8", [4], 0, 4), [], m.ErrorCode.BAD_TENSOR, "describes frames [0] but carries 0"),
    (m.Tensor("uint8", [4], 0, 4), [bytes(4), bytes(4)], m.ErrorCode.BAD_TENSOR, "describes frames [0] but carries 2"),
], ids=["dtype-float64", "dtype-object", "dtype-long", "nbytes-vs-shape", "frame-short", "frame-long", "negative-dim",
        "dim-2^40", "nine-dims", "negative-nbytes", "nbytes-over-limit", "negative-frame", "frame-64", "frame-missing",
        "no-frames", "extra-frame"])
def test_lying_descriptor_is_refused(descriptor, frames, code, text):
    _raises(_logits(descriptor, *frames), code, text)


def test_duplicate_frame_index_is_refused():
    lying = m.DecoderStep(request_id=1, start=0, streams=m.Tensor("uint8", [4], 0, 4),
                          pre_mix=m.Tensor("uint8", [4], 0, 4))
    body = _wire(m.encode(lying))
    _raises(body + [bytes(4)], m.ErrorCode.BAD_TENSOR, "describes frames [0, 0] but carries 1")
    _raises(body + [bytes(4), bytes(4)], m.ErrorCode.BAD_TENSOR, "describes frames [0, 0] but carries 2")


def test_tensor_frames_on_a_message_without_tensors_are_refused():
    _raises(_wire(m.encode(m.Tokenize(request_id=1, text="hi"))) + [b"x"], m.ErrorCode.BAD_TENSOR,
            "Tokenize describes frames [] but carries 1 tensor frames")


def test_huge_claimed_sizes_fail_without_allocating():
    claims = [m.Tensor("int64", [2**40 - 1] * m.MAX_DIMS, 0, m.MAX_TENSOR_BYTES),
              m.Tensor("float32", [2**39, 2**39], 0, 0), m.Tensor("uint8", [2**31], 0, m.MAX_TENSOR_BYTES)]
    tracemalloc.start()
    try:
        for claim in claims:
            error = _raises(_logits(claim, b""), m.ErrorCode.BAD_TENSOR, "bytes; described", "frame holds 0")
            assert str(claim.shape) in str(error)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"decode allocated {peak} bytes for claimed sizes"


# --- malformed bodies, kinds, versions ------------------------------------------------------------

TOKENIZE = bytes([m.KIND.TOKENIZE])


@pytest.mark.parametrize("depth", [5_000, 100_000])
def test_deep_nesting_is_malformed(depth):
    _raises([TOKENIZE, b"\x91" * depth + b"\xc0"], m.ErrorCode.MALFORMED, "malformed Tokenize")
    _raises([TOKENIZE, b"\x81\xa1k" * depth + b"\xc0"], m.ErrorCode.MALFORMED, "malformed Tokenize")
    assert _wire(m.encode(m.Blocks(request_id=1, payloads=[]))) == [bytes([m.KIND.BLOCKS]), b"\x93\x01\x90\x01"]
    nested = b"\x93\x01\x91" + b"\x91" * depth + b"\xc0\x01"  # one payload, nested `depth` deep
    _raises([bytes([m.KIND.BLOCKS]), nested], m.ErrorCode.MALFORMED, "malformed Blocks")


def test_invalid_utf8_in_a_string_field_is_malformed():
    body = _wire(m.encode(m.Tokenize(request_id=1, text="abc")))[1]
    assert body.count(b"abc") == 1
    _raises([TOKENIZE, body.replace(b"abc", b"\xff\xfe\xfd")], m.ErrorCode.MALFORMED, "malformed Tokenize", "utf-8")


@pytest.mark.parametrize("cut", [1, 2, 4])
def test_truncated_body_is_malformed(cut):
    body = _wire(m.encode(m.Tokenize(request_id=1, text="hello")))[1]
    _raises([TOKENIZE, body[:-cut]], m.ErrorCode.MALFORMED, "malformed Tokenize")


@pytest.mark.parametrize("head", [b"", b"\x00", b"\x09", b"\xff", TOKENIZE * 2])
def test_unknown_kind_is_malformed(head):
    body = _wire(m.encode(m.Tokenize(request_id=1, text="x")))[1]
    _raises([head, body], m.ErrorCode.MALFORMED, "unknown message kind frame")


def test_wrong_fields_are_malformed():
    encode = msgspec.msgpack.encode
    _raises([TOKENIZE, encode([-1, "x", 0, 1])], m.ErrorCode.MALFORMED, ">= 0")
    _raises([TOKENIZE, encode([1, "x", 0, [], b"", 1, "extra"])], m.ErrorCode.MALFORMED,
            "Expected `array` of at most length")
    _raises([TOKENIZE, encode({"request_id": 1, "text": "x"})], m.ErrorCode.MALFORMED, "Expected `array`, got `object`")
    _raises([bytes([m.KIND.GENERATE]), _wire(m.encode(m.Generate(request_id=1, prefill_mode="fast")))[1]],
            m.ErrorCode.MALFORMED, "malformed Generate")
    _raises([bytes([m.KIND.ERROR]), encode([1, 99, "c", "t", 1])], m.ErrorCode.MALFORMED, "Invalid enum value 99")


def test_other_protocol_version_is_refused():
    body = _wire(m.encode(m.Tokenize(version=2, request_id=1, text="x")))[1]
    _raises([TOKENIZE, body], m.ErrorCode.VERSION, "protocol version 2, this side speaks 1")


def test_kind_outside_accept_is_unexpected():
    parts = _wire(m.encode(m.Tokenize(request_id=1, text="x")))
    _raises(parts, m.ErrorCode.UNEXPECTED, "does not take Tokenize messages", accept=frozenset({m.KIND.PING}))
    message, _ = m.decode(parts, frozenset({m.KIND.TOKENIZE, m.KIND.PING}))
    assert message == m.Tokenize(request_id=1, text="x")


# --- token ids ------------------------------------------------------------------------------------

@PROPERTY
@given(ids=st.lists(st.integers(0, 2**31 - 1), max_size=50))
def test_ids_round_trip(ids):
    packed = m.pack_ids(ids)
    assert len(packed) == 4 * len(ids)
    assert m.unpack_ids(packed) == ids
    assert m.pack_ids(torch.tensor(ids, dtype=torch.int64)) == packed


def test_ids_are_int32_little_endian():
    assert m.pack_ids([1, 2**31 - 1]) == b"\x01\x00\x00\x00\xff\xff\xff\x7f"
    assert m.pack_ids([]) == b""
    assert m.unpack_ids(b"") == []


@pytest.mark.parametrize("size", [1, 2, 3, 5, 4099])
def test_ids_not_a_multiple_of_four_bytes_are_malformed(size):
    with pytest.raises(m.MessageError) as info:
        m.unpack_ids(bytes(size))
    assert info.value.code == m.ErrorCode.MALFORMED
    assert f"multiple of 4, got {size}" in str(info.value)


@pytest.mark.parametrize("ids", [[-1], [5, -(2**31)], [2**31], [0, 2**40], [2**63], [2**64 + 3], [-(2**70)]])
def test_ids_out_of_range_are_refused(ids):
    with pytest.raises(m.MessageError) as info:
        m.pack_ids(ids)
    assert info.value.code == m.ErrorCode.INVALID_REQUEST
    assert "token ids must be in [0, 2^31)" in str(info.value)


@pytest.mark.parametrize(("ids", "bad"), [([0, 320], 320), ([5, -1, 400], -1), ([2**31 - 1], 2**31 - 1)])
def test_ids_outside_the_vocabulary_are_an_invalid_request(ids, bad):
    packed = np.asarray(ids, dtype="<i4").tobytes()
    with pytest.raises(m.MessageError) as info:
        m.unpack_ids(packed, vocab_size=320)
    assert info.value.code == m.ErrorCode.INVALID_REQUEST
    assert str(info.value) == f"token id {bad} is out of range: ids must be in [0, 320) (the model's vocabulary)"
    assert m.unpack_ids(m.pack_ids([0, 319]), vocab_size=320) == [0, 319]


# --- sampling and capacities ------------------------------------------------------------------------

@pytest.mark.parametrize(("field", "value", "bound"), [
    ("temperature", float("nan"), ">= 0.0"), ("temperature", float("inf"), "<= 100.0"), ("temperature", -0.5, ">= 0.0"),
    ("temperature", 101.0, "<= 100.0"), ("top_p", 0.0, "> 0.0"), ("top_p", float("nan"), "> 0.0"),
    ("top_p", 1.5, "<= 1.0"),
])
def test_sampling_outside_its_range_is_malformed(field, value, bound):
    parts = _wire(m.encode(m.Generate(request_id=1, prompt="x", **{field: value})))  # structs check on decode only
    position = m.Generate.__struct_fields__.index(field)
    _raises(parts, m.ErrorCode.MALFORMED, f"malformed Generate: Expected `float` {bound} - at `$[{position}]`")


@pytest.mark.parametrize("message", [
    m.Prefill(request_id=1, ids=m.pack_ids([1]), capacity=1 << 61),
    m.DecoderStep(request_id=1, start=0, streams=m.Tensor("uint8", [0], 0, 0), pre_mix=m.Tensor("uint8", [0], 1, 0),
                  capacity=m.MAX_TOKENS + 1),
])
def test_capacities_past_the_longest_context_are_malformed(message):
    frames = [b""] * len(m._descriptors(message))
    _raises([*_wire(m.encode(message)), *frames], m.ErrorCode.MALFORMED, f"<= {m.MAX_TOKENS}")


def test_a_reply_route_over_64_bytes_is_malformed():
    item = m.StepItem(request_id=2, ids=m.pack_ids([1]))
    assert m.decode(_wire(m.encode(m.BatchStep(request_id=1, items=[item], reply_to=b"r" * 64))))[0].reply_to == \
        b"r" * 64
    parts = _wire(m.encode(m.BatchStep(request_id=1, items=[item], reply_to=b"r" * 65)))
    _raises(parts, m.ErrorCode.MALFORMED, "Expected `bytes` of length <= 64")


# --- sizes ------------------------------------------------------------------------------------------

def test_a_message_over_its_kinds_limit_is_too_large_before_it_is_decoded():
    limits = m.Limits({**m.DEFAULT_LIMITS.by_kind, m.KIND.TOKENIZE: 100})
    fits = _wire(m.encode(m.Tokenize(request_id=1, text="x" * 80)))
    assert m.decode(fits, limits=limits)[0].text == "x" * 80
    for parts in ([fits[0], b"\xc1" * 101], [*fits, b"y" * 30]):  # undecodable body; extra frames count too
        with pytest.raises(m.MessageError) as info:
            m.decode(parts, limits=limits)
        assert info.value.code == m.ErrorCode.TOO_LARGE
        assert f"a Tokenize of {m.encoded_size(parts)} bytes is over the 100 bytes" in str(info.value)


def test_text_that_is_not_unicode_cannot_be_encoded():
    with pytest.raises(m.MessageError) as info:
        m.encode(m.Generate(request_id=1, prompt="ok \udcff\udcfe"))
    assert info.value.code == m.ErrorCode.INVALID_REQUEST
    assert "Generate holds text that is not valid Unicode: surrogates not allowed at character 3" in str(info.value)


def test_limits_cover_every_kind():
    with pytest.raises(ValueError, match="are missing"):
        m.Limits({m.KIND.PING: 10})


# --- no pickle anywhere (T13) ---------------------------------------------------------------------

UNSAFE = re.compile(r"\b(?:c?[pP]ickle|_pickle|cloudpickle|dill)\b|recv_pyobj|send_pyobj|allow_pickle\s*=\s*True|"
                    r"\byaml\.(?:load|unsafe_load|full_load)\(|\bext_hook\b")


def test_unsafe_pattern_matches_what_it_should():
    hits = ["import pickle", "from cloudpickle import dumps", "s.recv_pyobj()", "s.send_pyobj(x)",
            "yaml.load(text)", "Decoder(ext_hook=f)", "import dill", "np.load(f, allow_pickle=True)"]
    fine = ["never pickled", "yaml.safe_load(text)", "yaml.compose(text, Loader=yaml.SafeLoader)", "pickled_at"]
    assert [bool(UNSAFE.search(line)) for line in hits] == [True] * len(hits)
    assert [bool(UNSAFE.search(line)) for line in fine] == [False] * len(fine)


def test_no_pickle_in_the_package():
    sources = sorted(PACKAGE.rglob("*.py"))
    assert len(sources) > 20
    hits = [f"{path.relative_to(PACKAGE.parent)}:{n}: {line.strip()}"
            for path in sources for n, line in enumerate(path.read_text().splitlines(), 1) if UNSAFE.search(line)]
    assert not hits, "unpickling or unsafe loading on the wire:\n" + "\n".join(hits)
