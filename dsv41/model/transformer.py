"""The V4.1 text network: embed -> 4 mHC streams -> 40 blocks -> collapse -> norm -> head.

Module and parameter names are the official checkpoint names (`embed.weight`,
`layers.{i}.attn.wq_a.weight` / `.scale`, `layers.{i}.ffn.experts.{e}.w1.weight`, `head.weight`, ...)
so weights load by name. The vision tower and DSpark stages attach to the seams marked below.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from dsv41.config import ModelConfig, Part
from dsv41.model import mhc, numerics
from dsv41.model.attention import SharedAttention, SharedBatch
from dsv41.model.blocks import Block
from dsv41.model.cache import DecodeCache
from dsv41.model.engram import Engram, EngramHasher
from dsv41.model.layers import Embedding, Linear, RMSNorm, Storage
from dsv41.model.rope import table_for
from dsv41.model.trace import Trace
from dsv41.model.vision import ImageSpan, attach_vision, overwrite_spans, span_mask


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # [b, s, vocab] fp32
    hidden: torch.Tensor  # [b, s, dim] final normed hidden state
    main_hidden: torch.Tensor | None  # [b, s, n_targets * dim]: DSpark's input (SPEC.md §8)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, token_map: list[int] | None = None, device=None):
        super().__init__()
        t = config.text_config
        self.config, self.plan = config, config.plan
        with_vision = config.vision_config.num_hidden_layers > 0
        self.embed = Embedding(t.vocab_size, t.hidden_size, device)
        self.layers = nn.ModuleList(Block(t, spec, with_vision, device) for spec in self.plan.backbone)
        for index, layer in enumerate(t.engram_layer_ids):
            self.layers[layer].engram = Engram(t, index, device)
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps, device)
        self.head = Linear(t.hidden_size, t.vocab_size, Storage.FP32, device)
        self.hasher = EngramHasher.build(t, token_map) if t.engram_layer_ids and token_map is not None else None
        self.vision = self.aligner = None
        if with_vision:  # vision.*, aligner.*, image_start/end/newline (SPEC.md §9)
            attach_vision(self, config, device)

    def embed_inputs(self, ids: torch.Tensor, spans: list[ImageSpan] | None = None, start: int = 0) -> torch.Tensor:
        """Token embeddings [b, s] of the positions start..; image spans overwrite theirs."""
        return overwrite_spans(self.embed(ids), spans, start)

    def forward(
        self, ids: torch.Tensor, image_mask: torch.Tensor | None = None, trace: Trace | None = None,
        cache: DecodeCache | None = None, scored: dict[str, int] | None = None,
        dense_index: bool = False, index_targets: list | None = None, spans: list[ImageSpan] | None = None,
    ) -> ForwardOutput:
        """Run ids [b, s] through every layer.

        Without a cache: positions 0..s-1, nothing kept (the oracle). With a cache: the tokens go at
        the cache's next positions (a prompt, a chunk of one, a decode step or tokens to verify).
        image_mask [b, s] marks image-span tokens (VL routing bias, dead for Engram);
        `trace` receives per-layer intermediates; `scored` counts index entries scored by layer kind.
        Training (train mode, see dsv41.training): `dense_index` attends every visible entry,
        `index_targets` collects each indexer layer's KL inputs (SharedAttention).
        `spans` (dsv41.model.vision.encode_image) overwrite the embeddings of image-span positions;
        without an image_mask they also mark those positions as image tokens.
        """
        start, s = (0 if cache is None else cache.length), ids.size(1)
        self.check_span(start, s, cache)
        if spans and image_mask is None:
            image_mask = span_mask(spans, start, s, ids.size(0))
        x, pre_mix, rows, live = self.begin(ids, start, cache, image_mask, spans)
        shared = SharedAttention(start=start, cache=cache, trace=trace, scored=scored, dense_index=dense_index,
                                 index_targets=index_targets)
        targets: list[torch.Tensor] = []
        for layer in self.layers:
            x, pre_mix = self.run_layer(layer, x, pre_mix, shared, rows, live, image_mask, targets)
        hidden, logits = self.finish(x, pre_mix)
        if cache is not None:
            cache.length += s
        if trace is not None:
            if rows is not None:
                trace.put(None, "engram_hash_ids", rows)
            trace.put(None, "final_normed_hidden", hidden)
        return ForwardOutput(logits, hidden, torch.cat(targets, dim=-1) if targets else None)

    def begin(self, ids: torch.Tensor, start: int, cache: DecodeCache | None, image_mask: torch.Tensor | None = None,
              spans: list[ImageSpan] | None = None):
        """The 4 replicated streams of ids at positions start.., the first pre-mix, Engram row ids
        and the live-token mask."""
        hc = self.config.text_config.hc_mult
        live = None if image_mask is None else ~image_mask
        rows = self._engram_rows(ids, live, start, cache)
        x = self.embed_inputs(ids, spans, start).unsqueeze(2).repeat(1, 1, hc, 1)
        return x, mhc.first_pre_mix(x, hc), rows, live

    def run_layer(self, layer, x, pre_mix, shared: SharedAttention, rows=None, live=None, image_mask=None,
                  targets: list | None = None):
        """One block (with its Engram) on streams x at positions shared.start.. . `rows` are Engram
        row ids [b, s, n_tables, n_cols], or a mapping from table index to looked-up rows (prefetched)."""
        t, spec = self.config.text_config, layer.spec
        if layer.engram is not None:
            index = layer.engram.table_index
            looked = rows[index] if isinstance(rows, Mapping) else layer.engram.embed(rows[:, :, index])
            x = layer.engram(x, looked, live, shared.split_sizes)
            if shared.trace is not None:
                shared.trace.put(spec.layer_id, "engram_out", x)
        if spec.dspark_target and targets is not None:
            targets.append(numerics.wide(x).mean(dim=2).to(x.dtype))
        if isinstance(shared, SharedBatch):
            n_positions = shared.capacity
        else:
            n_positions = shared.start + x.size(1) if shared.cache is None else shared.cache.capacity
        return layer(x, pre_mix, table_for(t, spec.rope, n_positions), shared, image_mask)

    def finish(self, x: torch.Tensor, pre_mix: torch.Tensor,
               rows: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Collapse with the last pre-mix, final norm, head: (hidden, fp32 logits). `rows`: a batch's
        sequences along the tokens, whose logits are then computed as alone."""
        hidden = self.norm(mhc.collapse(x, pre_mix))
        return hidden, numerics.linear(hidden.float(), self.head.weight, rows)

    def check_span(self, start: int, s: int, cache: DecodeCache | None) -> None:
        if s == 0:
            raise ValueError("no tokens to run")
        limit = self.config.text_config.max_position_embeddings if cache is None else cache.capacity
        if start + s > limit:
            raise ValueError(f"positions up to {start + s} exceed the limit of {limit} tokens")

    def _engram_rows(self, ids: torch.Tensor, live: torch.Tensor | None, start: int,
                     cache: DecodeCache | None) -> torch.Tensor | None:
        if not self.config.text_config.engram_layer_ids:
            return None
        if self.hasher is None:
            raise RuntimeError("this model has Engram layers but was built without a compressed token map")
        if cache is None:
            return self.hasher(ids, live)
        end = start + ids.size(1)
        cache.ids[:, start:end] = ids
        if live is not None:
            cache.live[:, start:end] = live
        first = max(0, start - (self.config.text_config.engram_max_ngram_size - 1))  # enough look-back
        rows = self.hasher(cache.ids[:, first:end], cache.live[:, first:end])
        return rows[:, start - first :]

    def parameter_counts(self) -> dict[str, int]:
        """Logical parameters by part (packed FP4 counts two values per byte; scales excluded)."""
        counts = {"embed+head": 0, "encoder dense": 0, "decoder dense": 0, "routed experts": 0, "engram tables": 0}
        if self.vision is not None:
            counts["vision"] = 0
        for name, p in self.named_parameters():
            if name.endswith(".scale") and p.dtype == torch.float8_e8m0fnu:
                continue
            n = p.numel() * (2 if p.dtype == torch.int8 else 1)
            counts[self._part_of(name)] += n
        return counts

    def _part_of(self, name: str) -> str:
        if name.startswith(("vision.", "aligner.", "image_")):
            return "vision"
        if not name.startswith("layers."):
            return "embed+head"
        if ".ffn.experts." in name:
            return "routed experts"
        if ".engram.embed." in name:
            return "engram tables"
        layer = int(name.split(".")[1])
        return "encoder dense" if self.plan.layers[layer].part is Part.ENCODER else "decoder dense"


def build_model(config: ModelConfig, token_map: list[int] | None = None, device: str | None = None) -> Transformer:
    """Build with uninitialised weights ('meta' builds shapes only, for the official config)."""
    with torch.device(device or "cpu"):
        return Transformer(config, token_map, device).eval()
