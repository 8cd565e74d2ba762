"""The model configuration: the official config.json fields, their validation, and the layer plan.

Field names are exactly the keys of the official `config.json` (nested `text_config`,
`vision_config`, root `quantization_config`), so an official file loads unchanged. Loading collects
every problem (unknown or missing keys, wrong types, inconsistent values) and raises them together.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Any, get_type_hints

import msgspec

BUILTIN_CONFIGS = ("official", "mini", "micro", "small")
CONFIG_DIR = Path(__file__).parent / "configs"


class ConfigError(ValueError):
    """A config file that cannot be used; `problems` lists every reason, one line each."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid model config {source}: {len(problems)} problem(s)\n{lines}")


class RopeScaling(msgspec.Struct, frozen=True):
    rope_type: str
    factor: float
    beta_fast: float
    beta_slow: float
    original_max_position_embeddings: int


class QuantizationConfig(msgspec.Struct, frozen=True):
    quant_method: str
    activation_scheme: str
    weight_block_size: list[int]
    scale_fmt: str
    expert_dtype: str


class TextConfig(msgspec.Struct, frozen=True):
    model_type: str
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    hidden_act: str
    swiglu_limit: float
    rms_norm_eps: float
    attention_bias: bool
    attention_dropout: float
    initializer_range: float
    use_cache: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: RopeScaling
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    sliding_window: int
    compress_ratios: list[int]
    compress_rope_theta: float
    kv_source_layer_ids: list[int]
    index_source_layer_ids: list[int]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer_id: int
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: list[int]
    engram_num_embeddings: list[int]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_token_id: int
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: list[int]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int


class VisionConfig(msgspec.Struct, frozen=True):
    model_type: str
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_image_tokens: int
    min_pixels: int
    max_wh_ratio: int | None


class ModelConfig(msgspec.Struct, frozen=True, dict=True):
    architectures: list[str]
    model_type: str
    dtype: str
    transformers_version: str
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int
    image_token_id: int
    quantization_config: QuantizationConfig
    text_config: TextConfig
    vision_config: VisionConfig

    @cached_property
    def plan(self) -> LayerPlan:
        return LayerPlan.build(self.text_config)


# ---------------------------------------------------------------------------------------------
# Loading: structural checks (keys and types) for every field, then the semantic rules.

_NESTED = {"quantization_config": QuantizationConfig, "text_config": TextConfig, "vision_config": VisionConfig}


def _check_struct(cls: type, data: Any, where: str, problems: list[str]) -> None:
    if not isinstance(data, dict):
        problems.append(f"{where or 'root'}: expected an object, got {type(data).__name__}")
        return
    hints = get_type_hints(cls)
    for key in data:
        if key not in hints:
            problems.append(f"{where}{key}: unknown field (value {data[key]!r})")
    for key, hint in hints.items():
        if key not in data:
            problems.append(f"{where}{key}: missing required field")
        elif key in _NESTED and cls is ModelConfig:
            _check_struct(_NESTED[key], data[key], f"{key}.", problems)
        else:
            try:
                msgspec.convert(data[key], hint, strict=True)
            except msgspec.ValidationError as exc:
                problems.append(f"{where}{key}: value {data[key]!r} has the wrong type ({exc})")


def config_from_dict(data: Any, source: str = "<dict>") -> ModelConfig:
    """Validate `data` (the parsed config.json) completely, then build the typed config."""
    problems: list[str] = []
    _check_struct(ModelConfig, data, "", problems)
    if problems:
        raise ConfigError(source, problems)
    config = msgspec.convert(data, ModelConfig, strict=True)
    problems = validate(config)
    if problems:
        raise ConfigError(source, problems)
    return config


def load_config(name_or_path: str | Path) -> ModelConfig:
    """Load a built-in config by name (`official`, `mini`, `micro`) or a config.json by path."""
    if str(name_or_path) in BUILTIN_CONFIGS:
        text = (CONFIG_DIR / f"{name_or_path}.json").read_text()
        source = f"built-in '{name_or_path}'"
    else:
        path = Path(name_or_path)
        if not path.is_file():
            names = ", ".join(BUILTIN_CONFIGS)
            raise ConfigError(str(path), [f"no such file, and not a built-in config name ({names})"])
        text, source = path.read_text(), str(path)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(source, [f"not valid JSON: {exc}"]) from None
    return config_from_dict(data, source)


def config_to_dict(config: ModelConfig) -> dict[str, Any]:
    return msgspec.to_builtins(config)


# ---------------------------------------------------------------------------------------------
# Semantic validation. Each rule names the field, the value and the rule that it breaks.

SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def validate(config: ModelConfig) -> list[str]:
    t, q = config.text_config, config.quantization_config
    problems: list[str] = []

    def need(ok: bool, field: str, value: Any, rule: str) -> None:
        if not ok:
            problems.append(f"{field} = {value!r}: {rule}")

    _validate_sizes(t, need)
    _validate_layer_lists(t, need)
    n_total = t.num_hidden_layers + t.num_nextn_predict_layers
    if len(t.compress_ratios) == n_total and not problems:
        _validate_sharing(t, need)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "image_token_id"):
        value = getattr(config, name)
        need(0 <= value < t.vocab_size, name, value, f"must be a token id below vocab_size {t.vocab_size}")
    need(q.weight_block_size == [32, 32], "quantization_config.weight_block_size", q.weight_block_size,
         "only 32x32 weight blocks are supported (the V4.1 release format)")
    need(q.scale_fmt == "ue8m0", "quantization_config.scale_fmt", q.scale_fmt, "must be 'ue8m0'")
    need(q.expert_dtype == "fp4", "quantization_config.expert_dtype", q.expert_dtype, "must be 'fp4'")
    need(q.quant_method == "fp8", "quantization_config.quant_method", q.quant_method, "must be 'fp8'")
    v = config.vision_config
    need(v.num_hidden_layers >= 0, "vision_config.num_hidden_layers", v.num_hidden_layers, "must be >= 0")
    return problems


def _validate_sizes(t: TextConfig, need) -> None:
    positive = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers",
                "num_attention_heads", "head_dim", "qk_rope_head_dim", "q_lora_rank", "o_lora_rank",
                "o_groups", "n_routed_experts", "num_experts_per_tok", "sliding_window", "index_n_heads",
                "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "max_position_embeddings")
    for name in positive:
        need(getattr(t, name) > 0, f"text_config.{name}", getattr(t, name), "must be > 0")
    for name in ("hidden_size", "head_dim", "q_lora_rank", "moe_intermediate_size", "index_head_dim"):
        value = getattr(t, name)
        need(value % 32 == 0, f"text_config.{name}", value,
             "must be a multiple of 32 (FP8 activation blocks / FP4 scale groups are 32 wide)")
    need(t.qk_rope_head_dim % 2 == 0 and t.qk_rope_head_dim <= min(t.head_dim, t.index_head_dim),
         "text_config.qk_rope_head_dim", t.qk_rope_head_dim,
         "must be even and fit inside head_dim and index_head_dim (RoPE covers the last dims)")
    need(t.num_attention_heads % max(t.o_groups, 1) == 0, "text_config.o_groups", t.o_groups,
         f"must divide num_attention_heads ({t.num_attention_heads})")
    need((t.o_groups * t.o_lora_rank) % 32 == 0, "text_config.o_lora_rank", t.o_lora_rank,
         "o_groups * o_lora_rank must be a multiple of 32 (input of the FP8 wo_b)")
    need(t.num_key_value_heads == 1, "text_config.num_key_value_heads", t.num_key_value_heads,
         "must be 1 (one shared latent serves as key and value)")
    need(t.num_experts_per_tok <= t.n_routed_experts, "text_config.num_experts_per_tok",
         t.num_experts_per_tok, f"cannot exceed n_routed_experts ({t.n_routed_experts})")
    need(t.n_shared_experts == 1, "text_config.n_shared_experts", t.n_shared_experts, "must be 1")
    need(t.scoring_func in SCORING_FUNCS, "text_config.scoring_func", t.scoring_func,
         f"must be one of {SCORING_FUNCS}")
    need(t.hidden_act == "silu", "text_config.hidden_act", t.hidden_act, "must be 'silu'")
    need(t.rope_scaling.rope_type == "yarn", "text_config.rope_scaling.rope_type",
         t.rope_scaling.rope_type, "must be 'yarn'")
    need(t.max_position_embeddings >= t.sliding_window, "text_config.max_position_embeddings",
         t.max_position_embeddings, f"must be at least sliding_window ({t.sliding_window})")
    need(0 <= t.engram_pad_token_id < t.vocab_size, "text_config.engram_pad_token_id",
         t.engram_pad_token_id, "must be a token id below vocab_size")
    if t.dspark_block_size:
        need(0 <= t.dspark_noise_token_id < t.vocab_size, "text_config.dspark_noise_token_id",
             t.dspark_noise_token_id, "must be a token id below vocab_size")
        need(0 < t.dspark_num_experts_per_tok <= t.dspark_n_routed_experts,
             "text_config.dspark_num_experts_per_tok", t.dspark_num_experts_per_tok,
             f"must be in 1..dspark_n_routed_experts ({t.dspark_n_routed_experts})")
    if t.engram_layer_ids:
        for name in ("engram_n_heads", "engram_head_dim", "engram_vocab_size", "engram_compressed_vocab_size"):
            need(getattr(t, name) > 0, f"text_config.{name}", getattr(t, name), "must be > 0 with Engram layers")
        need(t.engram_head_dim % 32 == 0, "text_config.engram_head_dim", t.engram_head_dim,
             "must be a multiple of 32 (one FP8 scale per 32 channels of a row)")
        need(t.engram_max_ngram_size >= 2, "text_config.engram_max_ngram_size", t.engram_max_ngram_size,
             "must be >= 2 (2-grams are the smallest hashed order)")


def _validate_layer_lists(t: TextConfig, need) -> None:
    n_layers, n_total = t.num_hidden_layers, t.num_hidden_layers + t.num_nextn_predict_layers
    need(len(t.compress_ratios) == n_total, "text_config.compress_ratios", t.compress_ratios,
         f"needs one entry per layer: num_hidden_layers + num_nextn_predict_layers = {n_total}")
    ratios = t.compress_ratios
    need(all(r >= 0 for r in ratios), "text_config.compress_ratios", ratios, "ratios must be >= 0")
    need(all(r == 0 for r in ratios[n_layers:]), "text_config.compress_ratios", ratios[n_layers:],
         "DSpark layers (after num_hidden_layers) must have ratio 0 (SWA only)")
    lists = {
        "kv_source_layer_ids": t.kv_source_layer_ids,
        "index_source_layer_ids": t.index_source_layer_ids,
        "engram_layer_ids": t.engram_layer_ids,
    }
    for name, ids in lists.items():
        need(ids == sorted(set(ids)), f"text_config.{name}", ids, "must be strictly increasing")
        for layer in ids:
            need(0 <= layer < n_layers, f"text_config.{name}", layer,
                 f"layer id outside the backbone range 0..{n_layers - 1}")
    for name in ("kv_source_layer_ids", "index_source_layer_ids"):
        for layer in getattr(t, name):
            if 0 <= layer < len(ratios):
                need(ratios[layer] > 0, f"text_config.{name}", layer,
                     f"layer {layer} has compress ratio 0, so it has no global KV to own or index")
    need(len(t.engram_num_embeddings) == len(t.engram_layer_ids), "text_config.engram_num_embeddings",
         t.engram_num_embeddings, "needs one table size per Engram layer")
    if t.dspark_block_size:
        need(len(t.dspark_target_layer_ids) > 0, "text_config.dspark_target_layer_ids",
             t.dspark_target_layer_ids, "DSpark needs at least one target layer")
        for layer in t.dspark_target_layer_ids:
            need(0 <= layer < n_layers, "text_config.dspark_target_layer_ids", layer,
                 f"DSpark target layer does not exist (backbone layers are 0..{n_layers - 1})")
    guaranteed = (t.candidate_topk_blocks - 1) * t.candidate_block_size + 1  # newest block may hold one entry
    need(guaranteed >= t.index_topk, "text_config.candidate_topk_blocks", t.candidate_topk_blocks,
         f"the candidate pool ({t.candidate_topk_blocks} blocks x {t.candidate_block_size}) cannot hold "
         f"index_topk = {t.index_topk} entries (it is sure to hold {guaranteed} when the newest block has one)")
    if t.engram_layer_ids and len(t.engram_num_embeddings) == len(t.engram_layer_ids) and t.engram_n_heads > 0:
        from dsv41.model.engram import table_rows

        for given, rows in zip(t.engram_num_embeddings, table_rows(t), strict=True):
            need(given == rows, "text_config.engram_num_embeddings", given,
                 f"the prime table layout gives {rows} rows for this table")


def _validate_sharing(t: TextConfig, need) -> None:
    """Every global-branch layer must find its KV owner, index-key owner and Top-k producer."""
    ratios, kv_src, idx_src = t.compress_ratios, set(t.kv_source_layer_ids), set(t.index_source_layer_ids)
    owner = producer = None
    for layer in range(t.num_hidden_layers):
        if ratios[layer] == 0:
            continue
        if layer in kv_src:
            owner = layer
            need(layer in idx_src, "text_config.index_source_layer_ids", t.index_source_layer_ids,
                 f"kv source layer {layer} must also be an index source (its indexer builds the index keys)")
        if owner is None or ratios[owner] != ratios[layer]:
            need(False, "text_config.kv_source_layer_ids", t.kv_source_layer_ids,
                 f"layer {layer} (ratio {ratios[layer]}) has no earlier kv source with the same ratio")
            continue
        if layer in idx_src:
            producer = layer
        if producer is None or producer < owner:
            need(False, "text_config.index_source_layer_ids", t.index_source_layer_ids,
                 f"layer {layer} has no index source in its KV group (owner {owner}) to take Top-k from")
    half = t.num_hidden_layers // 2
    decoder_sources = [layer for layer in t.kv_source_layer_ids if layer >= half]
    need(decoder_sources == [half], "text_config.kv_source_layer_ids", t.kv_source_layer_ids,
         f"CED needs exactly one decoder kv source, the first decoder layer {half} (decoder = layers "
         f"{half}..{t.num_hidden_layers - 1}), so decoder global KV depends on the encoder output only")
    cand = t.candidate_source_layer_id
    if cand >= 0:
        need(cand in idx_src and cand in kv_src, "text_config.candidate_source_layer_id", cand,
             "the candidate source must be a kv source and an index source")
    else:
        need(cand == -1, "text_config.candidate_source_layer_id", cand, "must be a layer id or -1 (no pool)")


# ---------------------------------------------------------------------------------------------
# The per-layer plan (SPEC.md §2).


class Part(StrEnum):
    ENCODER = "encoder"
    DECODER = "decoder"
    DSPARK = "dspark"


class Mode(StrEnum):
    SWA = "swa-only"
    FULL = "full"
    REINDEX = "reindex"
    REUSE = "reuse"


class Rope(StrEnum):
    PLAIN = "plain"  # rope_theta, no YaRN: ratio-0 layers and DSpark
    YARN = "yarn"  # compress_rope_theta with YaRN: every layer with a global branch


@dataclass(frozen=True)
class LayerSpec:
    layer_id: int
    part: Part
    mode: Mode
    ratio: int
    kv_owner: int | None  # layer whose main KV and indexer K this layer reads
    topk_producer: int | None  # layer whose Top-k indices this layer attends with
    candidate_source: bool  # builds the hierarchical candidate pool
    candidate_consumer: bool  # scores only inside the pool
    engram: bool
    rope: Rope
    rope_theta: float
    dspark_target: bool  # the stream entering this layer feeds DSpark


def _part_of(layer: int, decoder_start: int, n_backbone: int) -> Part:
    if layer >= n_backbone:
        return Part.DSPARK
    return Part.ENCODER if layer < decoder_start else Part.DECODER


@dataclass(frozen=True)
class LayerPlan:
    layers: tuple[LayerSpec, ...]
    decoder_start: int

    @classmethod
    def build(cls, t: TextConfig) -> LayerPlan:
        specs, owner, producer = [], None, None
        half = t.num_hidden_layers // 2
        cand = t.candidate_source_layer_id
        for layer, ratio in enumerate(t.compress_ratios):
            part = Part.DSPARK if layer >= t.num_hidden_layers else Part.ENCODER if layer < half else Part.DECODER
            if ratio == 0 or part is Part.DSPARK:
                mode, kv, topk = Mode.SWA, None, None
            else:
                if layer in t.kv_source_layer_ids:
                    owner = layer
                if layer in t.index_source_layer_ids:
                    producer = layer
                mode = Mode.FULL if layer == owner else Mode.REINDEX if layer == producer else Mode.REUSE
                kv, topk = owner, producer
            specs.append(LayerSpec(
                layer_id=layer, part=part, mode=mode, ratio=ratio, kv_owner=kv, topk_producer=topk,
                candidate_source=layer == cand,
                candidate_consumer=mode is Mode.REINDEX and 0 <= cand < layer,
                engram=layer in t.engram_layer_ids,
                rope=Rope.YARN if ratio > 0 else Rope.PLAIN,
                rope_theta=t.compress_rope_theta if ratio > 0 else t.rope_theta,
                dspark_target=layer in t.dspark_target_layer_ids,
            ))
        return cls(layers=tuple(specs), decoder_start=half)

    @property
    def backbone(self) -> tuple[LayerSpec, ...]:
        return tuple(s for s in self.layers if s.part is not Part.DSPARK)

    def count(self, mode: Mode) -> int:
        return sum(1 for s in self.backbone if s.mode is mode)

    @property
    def kv_groups(self) -> tuple[LayerSpec, ...]:
        """The Full layers: each owns one shared global KV group."""
        return tuple(s for s in self.backbone if s.mode is Mode.FULL)


# ---------------------------------------------------------------------------------------------
# Global KV bytes per token, from the entry formats (SPEC.md §4.3).


def main_kv_entry_bytes(head_dim: int) -> int:
    """FP4 E2M1 codes (two per byte) + one E4M3 scale per 16 channels."""
    return head_dim // 2 + head_dim // 16


def index_k_entry_bytes(index_head_dim: int) -> int:
    """MXFP4: E2M1 codes (two per byte) + one E8M0 scale per 32 channels."""
    return index_head_dim // 2 + index_head_dim // 32


def swa_entry_bytes(head_dim: int) -> int:
    """FP8 E4M3 values + one power-of-two scale byte per 32 channels."""
    return head_dim + head_dim // 32


def global_kv_bytes_per_token(config: ModelConfig) -> float:
    t = config.text_config
    entry = main_kv_entry_bytes(t.head_dim) + index_k_entry_bytes(t.index_head_dim)
    return sum(entry / spec.ratio for spec in config.plan.kv_groups)
