"""Prefix identity: fixed-size token blocks hashed as a SHA-256 chain.

key_i = SHA-256(key_{i-1} || tokens of block i as little-endian uint32 || extra keys of block i),
with key_{-1} = SHA-256(b"dsv41/prefix/v1" || fingerprint). Equal keys mean equal token prefixes
under the same model and KV format, in any process, on any day: nothing here depends on Python's
per-process `hash()` seed.

Default block size 256 tokens: every block holds whole ratio-2 pairs (entries of all four groups
end on the block boundary); a block of global KV is 256 x 890 B = 222.5 KiB, large enough that the
per-value header and the LMDB key cost nothing and a read is one sequential run, small enough that
an agent turn's tool result (typically a few hundred tokens) is reused at fine granularity. The
Mooncake traces hash 512-token blocks; the benchmark replays them at that size.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_BLOCK_SIZE = 256
KV_FORMAT_VERSION = 1  # bump when the byte layout of a stored block changes
_SEED_DOMAIN = b"dsv41/prefix/v1"

# What the fingerprint deliberately leaves out, because it does not change the stored bytes:
# - runtime limits (batch size, context capacity, chunk size, number of threads or devices);
# - sampling settings, DSpark settings and anything after the last layer (head, drafter);
# - the tokenizer's special-token text (token ids are hashed, not text);
# - file paths, host names and the dsv41 version (only KV_FORMAT_VERSION tracks the layout).


@dataclass(frozen=True)
class Fingerprint:
    """Identity of whatever determines the stored KV bytes."""

    model: str  # canonical JSON of the model config's text_config
    weights_revision: str  # checkpoint revision (or the seed of random weights)
    kv_format_version: int
    layer_plan: str  # owner layers and ratios of the global KV groups, entry sizes

    @classmethod
    def of(cls, config, weights_revision: str) -> Fingerprint:
        from dsv41.config import config_to_dict, index_k_entry_bytes, main_kv_entry_bytes

        t = config.text_config
        groups = [(s.layer_id, s.ratio) for s in config.plan.kv_groups]
        plan = json.dumps({"groups": groups, "main": main_kv_entry_bytes(t.head_dim),
                           "index": index_k_entry_bytes(t.index_head_dim)})
        model = json.dumps(config_to_dict(config)["text_config"], sort_keys=True)
        return cls(model, weights_revision, KV_FORMAT_VERSION, plan)

    def digest(self) -> bytes:
        parts = [self.model, self.weights_revision, str(self.kv_format_version), self.layer_plan]
        return hashlib.sha256("\x00".join(parts).encode()).digest()


def chain_seed(fingerprint: Fingerprint) -> bytes:
    return hashlib.sha256(_SEED_DOMAIN + fingerprint.digest()).digest()


def block_key(parent: bytes, tokens: Sequence[int], extra: Sequence[bytes] = ()) -> bytes:
    h = hashlib.sha256(parent)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    for item in extra:
        h.update(struct.pack("<I", len(item)) + item)
    return h.digest()


def image_extra(spans: Sequence[tuple[int, bytes]], block_size: int) -> dict[int, list[bytes]]:
    """Extra keys for `block_keys` from image spans given as (start position, content digest): each
    goes into the block where its span starts, so that block's key and, through the chain, every
    later block's key depend on the image; blocks before it stay shared with any other image."""
    extra: dict[int, list[bytes]] = {}
    for start, digest in sorted(spans):
        extra.setdefault(start // block_size, []).append(struct.pack("<Q", start) + digest)
    return extra


def block_keys(tokens: Sequence[int], fingerprint: Fingerprint, block_size: int = DEFAULT_BLOCK_SIZE,
               extra: dict[int, Sequence[bytes]] | None = None) -> list[bytes]:
    """One key per complete block of `tokens` (a trailing partial block has none). `extra` maps a
    block index to extra keys mixed into it, e.g. content hashes of images inside that block."""
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"block size must be a positive even number of tokens, got {block_size}")
    keys, parent = [], chain_seed(fingerprint)
    for i in range(len(tokens) // block_size):
        parent = block_key(parent, tokens[i * block_size : (i + 1) * block_size], (extra or {}).get(i, ()))
        keys.append(parent)
    return keys

