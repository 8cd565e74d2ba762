"""Byte format of one stored block: a checked header, then the block's global KV.

    magic "DSKV" | format u16 | layout u16 | block tokens u32 | payload bytes u32 | XXH3-128 of payload
    payload: for each global KV group in plan order (owner layer ascending):
             main-KV entries (block/m x 288 B), then indexer-K entries (block/m x 68 B)

LMDB does not detect damaged values, so every read checks magic, version, layout, sizes and the
checksum; a value that fails is a miss, never data for the model. XXH3 checks a 222 KiB block at
tens of GB/s, so verifying every read costs little next to the read itself.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"DSKV"
_HEADER = struct.Struct("<4sHHII16s")
HEADER_BYTES = _HEADER.size


class BadBlock(ValueError):
    """A stored value that is not a valid block of the expected layout."""


@dataclass(frozen=True)
class BlockLayout:
    """Sizes of one block's payload: (entries, main bytes, index bytes) per group."""

    block_tokens: int
    groups: tuple[tuple[int, int, int], ...]  # (ratio, main entry bytes, index entry bytes)
    format_version: int = 1

    @property
    def layout_id(self) -> int:
        spec = repr((self.block_tokens, self.groups)).encode()
        return int.from_bytes(hashlib.blake2b(spec, digest_size=2).digest(), "little")

    def group_bytes(self) -> list[int]:
        return [(self.block_tokens // m) * (main + index) for m, main, index in self.groups]

    @property
    def payload_bytes(self) -> int:
        return sum(self.group_bytes())

    @classmethod
    def of(cls, config, block_tokens: int) -> BlockLayout:
        from dsv41.config import index_k_entry_bytes, main_kv_entry_bytes

        t = config.text_config
        main, index = main_kv_entry_bytes(t.head_dim), index_k_entry_bytes(t.index_head_dim)
        return cls(block_tokens, tuple((s.ratio, main, index) for s in config.plan.kv_groups))


def encode(layout: BlockLayout, payload: bytes | memoryview) -> bytes:
    if len(payload) != layout.payload_bytes:
        raise ValueError(f"block payload is {len(payload)} bytes, the layout needs {layout.payload_bytes}")
    digest = xxhash.xxh3_128_digest(payload)
    header = _HEADER.pack(MAGIC, layout.format_version, layout.layout_id, layout.block_tokens, len(payload), digest)
    return header + bytes(payload)


def decode(layout: BlockLayout, value: bytes | memoryview) -> memoryview:
    """The payload of a stored value (a view into it, no copy), after every check."""
    view = memoryview(value)
    if len(view) < HEADER_BYTES:
        raise BadBlock(f"value of {len(view)} bytes is shorter than the header")
    magic, version, layout_id, tokens, size, digest = _HEADER.unpack(view[:HEADER_BYTES])
    if magic != MAGIC:
        raise BadBlock("not a dsv41 block (bad magic)")
    if version != layout.format_version:
        raise BadBlock(f"block format version {version}, this build reads {layout.format_version}")
    if layout_id != layout.layout_id or tokens != layout.block_tokens:
        raise BadBlock(f"block layout {layout_id}/{tokens} tokens does not match {layout.layout_id}/"
                       f"{layout.block_tokens}")
    payload = view[HEADER_BYTES:]
    if len(payload) != size or size != layout.payload_bytes:
        raise BadBlock(f"payload is {len(payload)} bytes, header says {size}, layout needs {layout.payload_bytes}")
    if xxhash.xxh3_128_digest(payload) != digest:
        raise BadBlock("checksum mismatch")
    return payload


def split(layout: BlockLayout, payload: memoryview) -> list[tuple[memoryview, memoryview]]:
    """(main-KV bytes, indexer-K bytes) per group, as views into the payload."""
    out, offset = [], 0
    for m, main, index in layout.groups:
        n = layout.block_tokens // m
        out.append((payload[offset : offset + n * main], payload[offset + n * main : offset + n * (main + index)]))
        offset += n * (main + index)
    return out
