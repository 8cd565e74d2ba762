"""The prefix-cache policy the inference core (and later the encoder component) calls.

Lookup: the longest stored chain of complete blocks, and whether the encoder SWA snapshot at that
position is in the pool (then it is reused) or encoder replay of the last W tokens is needed.
After a request: store the global KV of the new complete blocks, and pool SWA snapshots at the
block-aligned prompt end and output end (a later request can only hit on a block boundary).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dsv41.storage.prefix import DEFAULT_BLOCK_SIZE, Fingerprint, block_keys, chain_seed
from dsv41.storage.store import GlobalKVStore, StoreFullError
from dsv41.storage.swa_pool import SWAPool


@dataclass(frozen=True)
class PrefixHit:
    keys: list[bytes]  # keys of every complete block of the tokens
    cached_blocks: int
    cached_tokens: int
    swa_snapshot: bytes | None  # encoder SWA rings at cached_tokens, if pooled
    needs_encoder_replay: bool  # global KV is cached but its SWA state is not


@dataclass(frozen=True)
class WritePlan:
    new_blocks: list[tuple[int, bytes]]  # (block index, key) whose global KV to store
    snapshots: list[tuple[int, bytes]]  # (token position, key) where to pool encoder SWA


@dataclass
class PolicyCounters:
    lookups: int = 0
    hit_blocks: int = 0
    replays: int = 0
    store_full: int = 0


class PrefixCachePolicy:
    def __init__(self, store: GlobalKVStore, pool: SWAPool, fingerprint: Fingerprint,
                 block_size: int = DEFAULT_BLOCK_SIZE):
        self.store, self.pool, self.fingerprint, self.block_size = store, pool, fingerprint, block_size
        self.counters = PolicyCounters()

    def keys(self, tokens: Sequence[int], extra: dict[int, Sequence[bytes]] | None = None) -> list[bytes]:
        """Chain keys of the complete blocks; `extra` (prefix.image_extra) covers image content."""
        return block_keys(tokens, self.fingerprint, self.block_size, extra)

    def position_key(self, keys: list[bytes], blocks: int) -> bytes:
        """Identity of the position after `blocks` complete blocks (the chain key, or the seed)."""
        return keys[blocks - 1] if blocks else chain_seed(self.fingerprint)

    def lookup(self, tokens: Sequence[int], extra: dict[int, Sequence[bytes]] | None = None) -> PrefixHit:
        keys = self.keys(tokens, extra)
        cached = self.store.longest_prefix(keys)
        snapshot = self.pool.get(self.position_key(keys, cached)) if cached else None
        self.counters.lookups += 1
        self.counters.hit_blocks += cached
        replay = cached > 0 and snapshot is None
        self.counters.replays += int(replay)
        return PrefixHit(keys, cached, cached * self.block_size, snapshot, replay)

    def plan_writes(self, hit: PrefixHit, prompt_len: int, output_tokens: Sequence[int],
                    prompt: Sequence[int], extra: dict[int, Sequence[bytes]] | None = None) -> WritePlan:
        """New complete blocks of prompt + output beyond the hit, and the snapshot positions."""
        full = list(prompt[:prompt_len]) + list(output_tokens)
        keys = self.keys(full, extra)
        new = [(i, keys[i]) for i in range(hit.cached_blocks, len(keys))]
        positions = sorted({prompt_len // self.block_size, len(full) // self.block_size} - {0})
        return WritePlan(new, [(b * self.block_size, self.position_key(keys, b)) for b in positions])

    def write(self, plan: WritePlan, block_payloads: dict[int, bytes], snapshots: dict[int, bytes]) -> bool:
        """Store what the plan names; False when the store is full (nothing stored, counted)."""
        for position, key in plan.snapshots:
            if position in snapshots:
                self.pool.put(key, snapshots[position])
        try:
            self.store.put_many({key: block_payloads[i] for i, key in plan.new_blocks if i in block_payloads})
        except StoreFullError:
            self.counters.store_full += 1
            return False
        return True
