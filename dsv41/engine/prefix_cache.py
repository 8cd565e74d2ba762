"""Prefill through the persistent prefix cache: look up, load stored global KV, replay, store.

A request's longest stored chain of complete blocks is loaded into a packed cache and the prefill
continues from there (`InferenceCore.prefill_from_prefix`: encoder replay of the prefix's last W
tokens, then the suffix); afterwards the new complete blocks' global KV is written to the store.
A store that is full or fails is a miss, never a failed request. SWA snapshots from the host pool
are not used yet: every hit replays.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.engine.core import InferenceCore, Sequence
from dsv41.model.cache import export_blocks
from dsv41.storage.blockfmt import BlockLayout
from dsv41.storage.policy import PrefixCachePolicy


@dataclass
class CachedPrefillResult:
    sequence: Sequence
    logits: torch.Tensor  # [vocab] at the last prompt token
    cached_tokens: int  # prompt tokens whose global KV came from the store
    stored_blocks: int  # new blocks written to the store


class CachedPrefill:
    def __init__(self, core: InferenceCore, policy: PrefixCachePolicy):
        self.core, self.policy = core, policy
        self.layout = BlockLayout.of(core.model.config, policy.block_size)
        if policy.store.layout != self.layout:
            raise ValueError("the store's block layout does not match this model and block size")

    def prefill(self, ids: list[int], capacity: int | None = None) -> CachedPrefillResult:
        hit = self.policy.lookup(ids)
        blocks = self._load(hit.keys[: hit.cached_blocks])
        while blocks and len(blocks) * self.layout.block_tokens >= len(ids):
            blocks.pop()  # keep at least one token to run, for the last logits
        if blocks:
            seq, logits = self.core.prefill_from_prefix(ids, blocks, self.layout, capacity)
        else:
            seq, logits = self.core.prefill(ids, "ced", capacity=capacity, packed=True)
        plan = self.policy.plan_writes(hit, len(ids), [], ids)
        new = {i: export_blocks(seq.cache, self.layout, i, 1)[0] for i, _ in plan.new_blocks}
        stored = len(new) if self.policy.write(plan, new, {}) else 0
        return CachedPrefillResult(seq, logits, len(blocks) * self.layout.block_tokens, stored)

    def _load(self, keys: list[bytes]) -> list[bytes]:
        """Payloads of the chain, stopping at the first block that is gone or damaged."""
        blocks = []
        for key in keys:
            payload = self.policy.store.get_copy(key)
            if payload is None:
                break
            blocks.append(payload)
        return blocks
