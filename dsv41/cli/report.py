"""Text tables printed by `dsv41 info`."""

from __future__ import annotations

from dsv41.config import (
    ModelConfig,
    global_kv_bytes_per_token,
    index_k_entry_bytes,
    main_kv_entry_bytes,
    swa_entry_bytes,
)
from dsv41.model.transformer import build_model


def plan_table(config: ModelConfig) -> str:
    head = f"{'layer':>5}  {'part':<8} {'mode':<9} {'m':>2}  {'kv owner':>8}  {'top-k from':>10}  notes"
    rows = [head, "-" * len(head)]
    for s in config.plan.layers:
        notes = []
        if s.candidate_source:
            notes.append("builds candidate pool")
        if s.candidate_consumer:
            notes.append("scores inside pool")
        if s.engram:
            notes.append("Engram")
        if s.dspark_target:
            notes.append("feeds DSpark")
        notes.append(f"RoPE {s.rope.value} θ={s.rope_theta:g}")
        owner = "-" if s.kv_owner is None else str(s.kv_owner)
        producer = "-" if s.topk_producer is None else str(s.topk_producer)
        rows.append(f"{s.layer_id:>5}  {s.part.value:<8} {s.mode.value:<9} {s.ratio:>2}  {owner:>8}  "
                    f"{producer:>10}  {', '.join(notes)}")
    return "\n".join(rows)


def kv_table(config: ModelConfig) -> str:
    t = config.text_config
    entry = main_kv_entry_bytes(t.head_dim) + index_k_entry_bytes(t.index_head_dim)
    rows = [f"global KV group   ratio  bytes/entry (main {main_kv_entry_bytes(t.head_dim)} + "
            f"index {index_k_entry_bytes(t.index_head_dim)})  bytes/token"]
    for s in config.plan.kv_groups:
        rows.append(f"  owner layer {s.layer_id:<3}  {s.ratio:>5}  {entry:>14}  {entry / s.ratio:>30g}")
    rows.append(f"total global KV per token: {global_kv_bytes_per_token(config):g} B")
    return "\n".join(rows)


def params_table(config: ModelConfig) -> str:
    counts = build_model(config, device="meta").parameter_counts()
    backbone = sum(v for k, v in counts.items() if k not in ("engram tables", "vision"))
    rows = [f"{part:<16} {n / 1e9:>12.4f} B" for part, n in counts.items()]
    rows.append(f"{'backbone':<16} {backbone / 1e9:>12.4f} B   (all but Engram tables and vision)")
    rows.append(f"{'total':<16} {sum(counts.values()) / 1e9:>12.4f} B   (DSpark stages not built yet)")
    return "parameters (logical elements; FP4 counts two per byte, scales excluded)\n" + "\n".join(rows)


def info_report(config: ModelConfig) -> str:
    plan = config.plan
    t = config.text_config
    summary = (f"{t.num_hidden_layers} layers (encoder 0-{plan.decoder_start - 1}, decoder {plan.decoder_start}-"
               f"{t.num_hidden_layers - 1}) + {t.num_nextn_predict_layers} DSpark; hidden {t.hidden_size}, "
               f"{t.num_attention_heads} heads x {t.head_dim}, window {t.sliding_window}, Top-{t.index_topk}, "
               f"pool {t.candidate_topk_blocks} x {t.candidate_block_size}, experts {t.n_routed_experts} "
               f"(top-{t.num_experts_per_tok})")
    return "\n\n".join([summary, plan_table(config), params_table(config), kv_table(config)])


V4_FLASH = 3514  # global KV bytes per token of V4-Flash, technical report Figure 1(b)
GIB = 2**30


def kv_budget_report(config: ModelConfig, contexts: list[int]) -> str:
    """Bytes per token by group and by part, and per-sequence totals for the given contexts."""
    t = config.text_config
    main, swa = main_kv_entry_bytes(t.head_dim), swa_entry_bytes(t.head_dim)
    index = index_k_entry_bytes(t.index_head_dim)
    lines = [f"entry bytes: main KV {main}, indexer K {index}, SWA {swa}", "",
             f"{'group (owner layer)':<20} {'part':<8} {'ratio':>5} {'main B/tok':>11} {'index B/tok':>12} "
             f"{'total B/tok':>12}"]
    for s in config.plan.kv_groups:
        lines.append(f"{'layer ' + str(s.layer_id):<20} {s.part.value:<8} {s.ratio:>5} {main / s.ratio:>11g} "
                     f"{index / s.ratio:>12g} {(main + index) / s.ratio:>12g}")
    per_token = global_kv_bytes_per_token(config)
    main_total = sum(main / s.ratio for s in config.plan.kv_groups)
    lines += ["", f"global KV per token: {per_token:g} B (main KV {main_total:g} + indexer K "
                  f"{per_token - main_total:g})",
              f"V4-Flash global KV per token: {V4_FLASH} B -> ratio {per_token / V4_FLASH:.4f} "
              f"(about 1/{V4_FLASH / per_token:.2f})",
              f"SWA per sequence: {len(config.plan.backbone)} layers x min(context, {t.sliding_window}) x {swa} B "
              "(bounded, independent of context beyond the window)", "",
              f"{'context':>10} {'main KV':>14} {'indexer K':>14} {'global KV':>14} {'global GiB':>10} "
              f"{'SWA':>10} {'total GiB':>10}"]
    for n in contexts:
        main_bytes = sum((n // s.ratio) * main for s in config.plan.kv_groups)
        index_bytes = sum((n // s.ratio) * index for s in config.plan.kv_groups)
        swa_bytes = len(config.plan.backbone) * min(n, t.sliding_window) * swa
        glob = main_bytes + index_bytes
        lines.append(f"{n:>10} {main_bytes:>14,} {index_bytes:>14,} {glob:>14,} {glob / GIB:>10.3f} "
                     f"{swa_bytes:>10,} {(glob + swa_bytes) / GIB:>10.3f}")
    return "\n".join(lines)
