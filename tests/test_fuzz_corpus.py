"""The wire fuzzer's corpus replayed (reliability plan T15): every input a fuzzing run kept decodes or
is refused with a `MessageError`, and the seeds hold one valid message of every kind."""

from __future__ import annotations

import pytest

from dsv41 import messages as m
from tests.fuzz.fuzz_messages import CORPUS, bytes_of, frames_of, one_input, seeds

FILES = sorted(CORPUS.iterdir())


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_corpus_input_decodes_or_is_refused(path):
    one_input(path.read_bytes())


def test_the_seeds_hold_one_valid_message_of_every_kind():
    """A kind added to the wire format needs its seed: `python tests/fuzz/fuzz_messages.py --write-seeds`."""
    stored = {p.name: p.read_bytes() for p in FILES if p.name.startswith("seed-")}
    assert stored == seeds()
    kinds = {type(m.decode(frames_of(data))[0]) for data in stored.values()}
    assert kinds == set(m.TYPES.values())


@pytest.mark.parametrize("frames", [[], [b"\x05"], [b"\x05", b""], [b"\x01", b"abc", b"", bytes(300)]])
def test_frames_survive_the_fuzzer_framing(frames):
    assert frames_of(bytes_of(frames)) == frames


def test_a_frame_count_past_the_limit_is_refused():
    data = bytes_of([b"\x05", b"x"])
    data = bytes([m.MAX_FRAMES + 3]) + data[1:]  # claims more frames than the wire takes
    assert len(frames_of(data)) == m.MAX_FRAMES + 3
    with pytest.raises(m.MessageError, match="frames"):
        m.decode(frames_of(data))
    one_input(data)
