"""Coverage-guided fuzzing of the wire decoder and the tensor-descriptor checks (reliability plan T15).

Each input is cut into frames (`frames_of`) and given to `messages.decode`; whatever decodes must then
yield its tensors and survive a re-encode. Anything but a `MessageError` is a finding. The corpus lives
in `tests/fuzz/corpus/`; the default test suite replays it (`tests/test_fuzz_corpus.py`), and a fuzzing
run adds the inputs that reach new code to it.

    pip install -e '.[fuzz]'
    python tests/fuzz/fuzz_messages.py -max_total_time=60 tests/fuzz/corpus   # a 60 s run
    python tests/fuzz/fuzz_messages.py --write-seeds                           # remake the seeds
"""

from __future__ import annotations

import contextlib
import struct
import sys
from pathlib import Path

import msgspec

from dsv41 import messages as m

CORPUS = Path(__file__).parent / "corpus"
VOCAB = 320  # the built-in models' vocabulary: ids fields are also checked against it


def frames_of(data: bytes) -> list[bytes]:
    """Frames from fuzzer bytes: a count byte (up to past the frame limit), then each frame but the last
    as a 2-byte little-endian length and its bytes; the last frame takes what is left."""
    if not data:
        return []
    count, rest, frames = data[0] % (m.MAX_FRAMES + 4), data[1:], []
    for _ in range(max(count - 1, 0)):
        size = struct.unpack("<H", rest[:2].ljust(2, b"\0"))[0]
        frames.append(rest[2 : 2 + size])
        rest = rest[2 + size :]
    return [*frames, rest] if count else frames


def bytes_of(frames: list[bytes]) -> bytes:
    """The inverse of `frames_of`, for seeds (at most 65,535 bytes a frame but the last)."""
    out = bytearray([len(frames)])
    for frame in frames[:-1]:
        out += struct.pack("<H", len(frame)) + frame
    return bytes(out + (frames[-1] if frames else b""))


def one_input(data: bytes) -> None:
    """The decode contract on one input: a message whose tensors and ids can be read and that encodes
    back to the same body, or a `MessageError` with a code; any other exception escapes."""
    parts = frames_of(data)
    try:
        message, tensors = m.decode(parts)
    except m.MessageError as e:
        if not isinstance(e.code, m.ErrorCode):
            raise AssertionError(f"MessageError without a code: {e!r}") from None
        return
    for descriptor in m._descriptors(message):
        t = m.tensor(descriptor, tensors)
        if t.numel() * t.element_size() != descriptor.nbytes:
            raise AssertionError(f"{descriptor} read as {t.dtype} {tuple(t.shape)}")
    again, _ = m.decode(m.encode(message) + [bytes(t) for t in tensors])
    if msgspec.msgpack.encode(again) != msgspec.msgpack.encode(message):
        raise AssertionError(f"{type(message).__name__} does not survive a re-encode")
    ids = getattr(message, "ids", None)
    if isinstance(ids, bytes):
        with contextlib.suppress(m.MessageError):  # ids outside the vocabulary are a refusal too
            m.unpack_ids(ids, VOCAB)


def _minimal(t: msgspec.inspect.Type, frames: list[bytes]):
    """The smallest valid value of a message field's type; each tensor is two fp32 values in a frame
    of its own, appended to `frames`."""
    mi = msgspec.inspect
    if isinstance(t, mi.StructType):
        if t.cls is m.Tensor:
            frames.append(struct.pack("<2f", 1.5, -2.0))
            return m.Tensor("float32", [2], len(frames) - 1, 8)
        return t.cls(**{f.name: _minimal(f.type, frames) for f in t.fields if f.required})
    if isinstance(t, mi.UnionType):
        return _minimal(t.types[0], frames)
    if isinstance(t, mi.IntType):
        return t.ge if t.ge is not None else t.gt + 1 if t.gt is not None else 1
    if isinstance(t, mi.FloatType):
        return t.ge if t.ge is not None else 1.0
    if isinstance(t, mi.EnumType):
        return next(iter(t.cls))
    if isinstance(t, mi.ListType):
        return [_minimal(t.item_type, frames) for _ in range(t.min_length or 0)]
    simple = {mi.NoneType: None, mi.BoolType: False, mi.StrType: "a", mi.BytesType: b"", mi.DictType: {}}
    return simple[type(t)]


def seeds() -> dict[str, bytes]:
    """One valid message of every kind, with the tensor frames it names."""
    out = {}
    for kind, struct_type in m.TYPES.items():
        frames: list[bytes] = []
        message = _minimal(msgspec.inspect.type_info(struct_type), frames)
        out[f"seed-{kind.name.lower()}"] = bytes_of([bytes(p) for p in m.encode(message)] + frames)
    return out


def write_seeds() -> None:
    CORPUS.mkdir(exist_ok=True)
    for name, data in seeds().items():
        one_input(data)
        (CORPUS / name).write_bytes(data)
    print(f"wrote {len(m.TYPES)} seeds to {CORPUS}")


def main() -> None:
    if sys.argv[1:] == ["--write-seeds"]:
        write_seeds()
        return
    try:
        import atheris
    except ImportError:
        sys.exit("fuzzing needs atheris: pip install -e '.[fuzz]'")
    atheris.instrument_all()  # the Python code loaded so far, the wire module included, reports coverage
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
