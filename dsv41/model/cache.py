"""Per-sequence state for incremental decoding with the reference numerics.

Caches hold the fake-quantized values the reference attends to (bf16), laid out as the official
implementation keeps them: a W-slot SWA ring per layer (slot = position mod W), and per global KV
group its main KV and index keys by entry id plus the fp32 partial-group state of a ratio-m
compressor. Packed byte layouts replace these tensors in the KV-format work; the decode math
does not change.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.config import Mode, ModelConfig


@dataclass
class GroupCache:
    main_kv: torch.Tensor  # [b, capacity // m, head_dim]
    index_k: torch.Tensor  # [b, capacity // m, index_head_dim]
    kv_state: torch.Tensor | None  # [b, m, head_dim] fp32, ratio > 1 only
    score_state: torch.Tensor | None  # [b, m, head_dim] fp32, -inf until written


@dataclass
class DecodeCache:
    capacity: int
    windows: dict[int, torch.Tensor]  # layer -> [b, W, head_dim]
    groups: dict[int, GroupCache]  # Full layer -> its group
    ids: torch.Tensor  # [b, capacity] token history (Engram looks back)
    live: torch.Tensor  # [b, capacity] False for image-span tokens
    length: int = 0
    # Compatibility with the official decode path (SPEC.md §17): the official code shares index keys
    # through one slot that only an emitting source refreshes. When set, a Full layer without a new
    # entry scores against the slot's keys, as the official implementation does.
    official_decode_slots: bool = False
    index_k_slot: int | None = field(default=None)

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, capacity: int,
                 official_decode_slots: bool = False) -> DecodeCache:
        t = config.text_config
        if capacity > t.max_position_embeddings:
            raise ValueError(f"cache capacity {capacity} exceeds the context limit {t.max_position_embeddings}")
        windows = {s.layer_id: torch.zeros(batch, t.sliding_window, t.head_dim, dtype=torch.bfloat16)
                   for s in config.plan.backbone}
        groups = {}
        for s in config.plan.backbone:
            if s.mode is not Mode.FULL:
                continue
            n = capacity // s.ratio
            state = (s.ratio, t.head_dim)
            groups[s.layer_id] = GroupCache(
                main_kv=torch.zeros(batch, n, t.head_dim, dtype=torch.bfloat16),
                index_k=torch.zeros(batch, n, t.index_head_dim, dtype=torch.bfloat16),
                kv_state=torch.zeros(batch, *state) if s.ratio > 1 else None,
                score_state=torch.full((batch, *state), -torch.inf) if s.ratio > 1 else None,
            )
        return cls(capacity, windows, groups, torch.zeros(batch, capacity, dtype=torch.long),
                   torch.ones(batch, capacity, dtype=torch.bool), official_decode_slots=official_decode_slots)
