"""A precision-weighted FLOP model of one decode token (BF16 = 1, FP8 = 0.5, FP4 = 0.25).

Counts the multiply-adds of every part of one decode step at a given context length from the
config and layer plan: dense projections in their storage precision, routed experts in FP4,
attention over the SWA window plus the selected global entries, and the indexers: ratio-2 Full
layers and the candidate source score every visible entry, Reindex layers only the candidate
pool. Weights follow the release: FP8 dense linears, FP4 routed experts, BF16 wo_a (dequantized
at load), compressors, head and router in BF16/FP32 (weight 1), indexer keys and queries FP4.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dsv41.config import Mode, ModelConfig

BF16, FP8, FP4 = 1.0, 0.5, 0.25


@dataclass
class FlopBreakdown:
    context: int
    parts: dict[str, float] = field(default_factory=dict)

    def add(self, part: str, flops: float) -> None:
        self.parts[part] = self.parts.get(part, 0.0) + flops

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def decode_token_flops(config: ModelConfig, context: int, weighted: bool = True) -> FlopBreakdown:
    """weighted=False counts every multiply-add as 2 FLOPs whatever its precision (what a CPU that
    computes everything in fp32 does)."""
    bf16, fp8, fp4 = (BF16, FP8, FP4) if weighted else (1.0, 1.0, 1.0)
    t, out = config.text_config, FlopBreakdown(context)
    d, h, hd = t.hidden_size, t.num_attention_heads, t.head_dim
    pool = t.candidate_topk_blocks * t.candidate_block_size
    for spec in config.plan.backbone:
        out.add("attention projections", 2 * fp8 * (d * t.q_lora_rank + t.q_lora_rank * h * hd + d * hd
                                                   + t.o_groups * t.o_lora_rank * d))
        out.add("attention projections", 2 * bf16 * h * hd * t.o_lora_rank)  # wo_a, grouped
        entries = 0 if spec.ratio == 0 else min(t.index_topk, context // spec.ratio)
        out.add("attention (SWA + selected)", 2 * 2 * bf16 * h * hd * (min(context, t.sliding_window) + entries))
        out.add("mHC", 2 * 2 * bf16 * (2 + t.hc_mult) * t.hc_mult * t.hc_mult * d)
        out.add("MoE routed (FP4)", 2 * fp4 * t.num_experts_per_tok * 3 * d * t.moe_intermediate_size)
        out.add("MoE shared + router", 2 * (fp8 * 3 * d * t.moe_intermediate_size + bf16 * d * t.n_routed_experts))
        if spec.mode is Mode.FULL:
            projections = (2 if spec.ratio > 1 else 1) * d * hd + hd * t.index_head_dim  # wkv (+ wgate), wk
            out.add("compressor + index keys", 2 * bf16 * projections)
        if spec.mode in (Mode.FULL, Mode.REINDEX):
            out.add("indexer queries", 2 * (fp8 * t.q_lora_rank * t.index_n_heads * t.index_head_dim + bf16 * d
                                            * t.index_n_heads))
            scored = context // spec.ratio if spec.mode is Mode.FULL else min(pool, context)
            kind = "indexer scoring (Reindex, pool)" if spec.mode is Mode.REINDEX else "indexer scoring (Full)"
            out.add(kind, 2 * fp4 * t.index_n_heads * t.index_head_dim * scored)
        if spec.engram:
            n_cols = (t.engram_max_ngram_size - 1) * t.engram_n_heads
            out.add("Engram", 2 * fp8 * n_cols * t.engram_head_dim * d * (t.hc_mult + 1))
    out.add("head", 2 * bf16 * d * t.vocab_size)
    return out
