"""Prefill through the persistent prefix cache: look up, load stored global KV, replay, store.

A request's longest stored chain of complete blocks is loaded into a packed cache and the prefill
continues from there (`InferenceCore.prefill_from_prefix`); afterwards the new complete blocks'
global KV is written to the store and the encoder rings at the prompt's last block boundary to
the host SWA pool. A hit whose snapshot is pooled restores the rings instead of replaying the
prefix's last W tokens (exact when the decoder replay lies in the new tokens); otherwise encoder
replay rebuilds them. A store that is full or fails is a miss, never a failed request.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from dsv41.engine.core import InferenceCore, Sequence
from dsv41.model.cache import export_blocks
from dsv41.model.vision import ImageSpan
from dsv41.storage.blockfmt import BlockLayout
from dsv41.storage.policy import PrefixCachePolicy
from dsv41.storage.prefix import image_extra


@dataclass
class CachedPrefillResult:
    sequence: Sequence
    logits: torch.Tensor  # [vocab] at the last prompt token
    cached_tokens: int  # prompt tokens whose global KV came from the store
    stored_blocks: int  # new blocks written to the store


def span_digest(rows: torch.Tensor) -> bytes:
    """SHA-256 of an image span's rows (bf16, as the model takes them): the image content the span's
    KV was computed from (pixels through the ViT and the aligner, delimiters included)."""
    rows = rows.detach().to(torch.bfloat16).contiguous()
    h = hashlib.sha256(b"dsv41/image-span/v1")
    h.update(repr(tuple(rows.shape)).encode())
    h.update(rows.view(torch.uint8).numpy().tobytes())
    return h.digest()


def span_extra(spans: list[ImageSpan] | None, block_size: int) -> dict[int, list[bytes]] | None:
    """Chain-key extras of a prompt's image spans (None for a text prompt)."""
    return image_extra([(s.start, span_digest(s.rows)) for s in spans], block_size) if spans else None


def snapshot_position(n: int, block_tokens: int, cached: int) -> int | None:
    """Where a prefill keeps the encoder rings for the pool: the last block boundary of the
    prompt, when it lies in the tokens this prefill runs (a later request can only hit there)."""
    position = n // block_tokens * block_tokens
    return position if cached < position else None


class CachedPrefill:
    def __init__(self, core: InferenceCore, policy: PrefixCachePolicy):
        self.core, self.policy = core, policy
        self.layout = BlockLayout.of(core.model.config, policy.block_size)
        if policy.store.layout != self.layout:
            raise ValueError("the store's block layout does not match this model and block size")

    def prefill(self, ids: list[int], capacity: int | None = None,
                spans: list[ImageSpan] | None = None) -> CachedPrefillResult:
        """`spans`: the prompt's image spans; their content is part of the blocks' chain keys."""
        extra = span_extra(spans, self.layout.block_tokens)
        hit = self.policy.lookup(ids, extra)
        blocks = self._load(hit.keys[: hit.cached_blocks])
        while blocks and len(blocks) * self.layout.block_tokens >= len(ids):
            blocks.pop()  # keep at least one token to run, for the last logits
        snapshot = hit.swa_snapshot if len(blocks) == hit.cached_blocks else None  # rings of that position only
        cached = len(blocks) * self.layout.block_tokens
        snapshot_at = snapshot_position(len(ids), self.layout.block_tokens, cached)
        seq, logits = self.core.prefill_from_prefix(ids, blocks, self.layout, capacity, snapshot, snapshot_at, spans)
        plan = self.policy.plan_writes(hit, len(ids), [], ids, extra)
        new = {i: export_blocks(seq.cache, self.layout, i, 1)[0] for i, _ in plan.new_blocks}
        stored = len(new) if self.policy.write(plan, new, seq.snapshots) else 0
        return CachedPrefillResult(seq, logits, cached, stored)

    def _load(self, keys: list[bytes]) -> list[bytes]:
        """Payloads of the chain, stopping at the first block that is gone or damaged."""
        blocks = []
        for key in keys:
            payload = self.policy.store.get_copy(key)
            if payload is None:
                break
            blocks.append(payload)
        return blocks
