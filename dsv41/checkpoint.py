"""Official checkpoint format: the flat `inference/config.json` mapping and weight loading.

The release ships two configs: the nested `config.json` (dsv41's own field names) and the flat
`inference/config.json` that the official `model.py` reads. `INFERENCE_FIELDS` maps one to the
other in both directions. Weights are safetensors with the official tensor names and on-disk
dtypes; `load_weights` matches them to the model by name and applies the release's load-time
conversions, reporting every missing, unexpected, mis-shaped or mistyped tensor in one error.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from dsv41.config import CONFIG_DIR, ConfigError, ModelConfig, config_from_dict, config_to_dict

# flat inference/config.json field -> path in the nested config.json
INFERENCE_FIELDS: dict[str, tuple[str, ...]] = {
    "vocab_size": ("text_config", "vocab_size"),
    "dim": ("text_config", "hidden_size"),
    "moe_inter_dim": ("text_config", "moe_intermediate_size"),
    "n_layers": ("text_config", "num_hidden_layers"),
    "n_mtp_layers": ("text_config", "num_nextn_predict_layers"),
    "dspark_block_size": ("text_config", "dspark_block_size"),
    "dspark_noise_token_id": ("text_config", "dspark_noise_token_id"),
    "dspark_target_layer_ids": ("text_config", "dspark_target_layer_ids"),
    "dspark_markov_rank": ("text_config", "dspark_markov_rank"),
    "dspark_n_routed_experts": ("text_config", "dspark_n_routed_experts"),
    "dspark_n_activated_experts": ("text_config", "dspark_num_experts_per_tok"),
    "n_heads": ("text_config", "num_attention_heads"),
    "n_routed_experts": ("text_config", "n_routed_experts"),
    "n_shared_experts": ("text_config", "n_shared_experts"),
    "n_activated_experts": ("text_config", "num_experts_per_tok"),
    "score_func": ("text_config", "scoring_func"),
    "route_scale": ("text_config", "routed_scaling_factor"),
    "swiglu_limit": ("text_config", "swiglu_limit"),
    "q_lora_rank": ("text_config", "q_lora_rank"),
    "head_dim": ("text_config", "head_dim"),
    "rope_head_dim": ("text_config", "qk_rope_head_dim"),
    "norm_eps": ("text_config", "rms_norm_eps"),
    "o_groups": ("text_config", "o_groups"),
    "o_lora_rank": ("text_config", "o_lora_rank"),
    "window_size": ("text_config", "sliding_window"),
    "kv_source_layers": ("text_config", "kv_source_layer_ids"),
    "index_source_layers": ("text_config", "index_source_layer_ids"),
    "original_seq_len": ("text_config", "rope_scaling", "original_max_position_embeddings"),
    "rope_theta": ("text_config", "rope_theta"),
    "rope_factor": ("text_config", "rope_scaling", "factor"),
    "beta_fast": ("text_config", "rope_scaling", "beta_fast"),
    "beta_slow": ("text_config", "rope_scaling", "beta_slow"),
    "index_n_heads": ("text_config", "index_n_heads"),
    "index_head_dim": ("text_config", "index_head_dim"),
    "index_topk": ("text_config", "index_topk"),
    "candidate_source_layer": ("text_config", "candidate_source_layer_id"),
    "candidate_topk_blocks": ("text_config", "candidate_topk_blocks"),
    "candidate_block_size": ("text_config", "candidate_block_size"),
    "hc_mult": ("text_config", "hc_mult"),
    "hc_sinkhorn_iters": ("text_config", "hc_sinkhorn_iters"),
    "hc_eps": ("text_config", "hc_eps"),
    "engram_layer_ids": ("text_config", "engram_layer_ids"),
    "engram_vocab_size": ("text_config", "engram_vocab_size"),
    "engram_num_embeddings": ("text_config", "engram_num_embeddings"),
    "engram_max_ngram_size": ("text_config", "engram_max_ngram_size"),
    "engram_pad_id": ("text_config", "engram_pad_token_id"),
    "engram_compressed_vocab_size": ("text_config", "engram_compressed_vocab_size"),
    "dtype": ("quantization_config", "quant_method"),
    "expert_dtype": ("quantization_config", "expert_dtype"),
    "compress_rope_theta": ("text_config", "compress_rope_theta"),
    "compress_ratios": ("text_config", "compress_ratios"),
    "vision_n_layers": ("vision_config", "num_hidden_layers"),
    "vision_dim": ("vision_config", "hidden_size"),
    "vision_n_heads": ("vision_config", "num_attention_heads"),
    "vision_inter_dim": ("vision_config", "intermediate_size"),
    "vision_patch_size": ("vision_config", "patch_size"),
    "vision_downsample_ratio": ("vision_config", "downsample_ratio"),
    "vision_max_n_token": ("vision_config", "max_image_tokens"),
    "vision_min_pixels": ("vision_config", "min_pixels"),
    "vision_max_wh_ratio": ("vision_config", "max_wh_ratio"),
    "image_token_id": ("image_token_id",),
    "engram_n_heads": ("text_config", "engram_n_heads"),
    "engram_head_dim": ("text_config", "engram_head_dim"),
    "vision_rope_theta": ("vision_config", "rope_theta"),
}
# Runtime limits of the official ModelArgs (they size its caches); not part of the model.
RUNTIME_FIELDS = ("max_batch_size", "max_seq_len", "temperature")


@dataclass(frozen=True)
class RuntimeArgs:
    max_batch_size: int | None = None
    max_seq_len: int | None = None
    temperature: float | None = None


def config_from_inference(flat: dict[str, Any], source: str = "<inference config>") -> tuple[ModelConfig, RuntimeArgs]:
    """Nested config from a flat inference/config.json; fields the flat file lacks (token ids of
    BOS/EOS/PAD, the context limit, activation scheme, ...) take the release's values."""
    unknown = [f"{key}: unknown inference config field" for key in flat
               if key not in INFERENCE_FIELDS and key not in RUNTIME_FIELDS]
    missing = [f"{key}: missing inference config field" for key in INFERENCE_FIELDS if key not in flat]
    if unknown or missing:
        raise ConfigError(source, unknown + missing)
    nested = json.loads((CONFIG_DIR / "official.json").read_text())
    for key, path in INFERENCE_FIELDS.items():
        target = nested
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = copy.deepcopy(flat[key])
    runtime = RuntimeArgs(**{k: flat[k] for k in RUNTIME_FIELDS if k in flat})
    return config_from_dict(nested, source), runtime


def inference_from_config(config: ModelConfig) -> dict[str, Any]:
    """The flat inference/config.json fields of a config (runtime fields not included)."""
    nested = config_to_dict(config)
    flat = {}
    for key, path in INFERENCE_FIELDS.items():
        value = nested
        for part in path:
            value = value[part]
        flat[key] = value
    return flat


def load_any_config(path: str | Path) -> tuple[ModelConfig, RuntimeArgs]:
    """A config.json in either official format (nested, or the flat inference one)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict) and "text_config" not in data and "dim" in data:
        return config_from_inference(data, str(path))
    return config_from_dict(data, str(path)), RuntimeArgs()


class CheckpointError(ValueError):
    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"checkpoint {source} does not fit the model: {len(problems)} problem(s)\n{lines}")


def weight_files(path: str | Path) -> list[Path]:
    """Safetensors files of a checkpoint: a file, or a folder with model.safetensors.index.json,
    model*.safetensors shards, or weights.safetensors."""
    path = Path(path)
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("weights.safetensors"))
    if not files:
        raise CheckpointError(str(path), ["no safetensors weight files found"])
    return files


# bf16 tensors the reference holds in fp32 (SPEC.md §4.2 and the golden notes); promotion is exact.
PROMOTED_TO_FP32 = ("head.weight", ".compressor.wkv.weight", ".compressor.wgate.weight")

# Tensors the model does not use yet, loaded by later parts (DSpark stages live under mtp.*).
NOT_YET_USED = ("mtp.",)


def _dequantize_fp8_tiles(weight: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    rows = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
    return (weight.float() * rows[: weight.size(0), : weight.size(1)]).to(torch.bfloat16)


def _convert(name: str, stored: torch.Tensor, param: torch.Tensor, read) -> torch.Tensor | str:
    """The stored tensor in the parameter's form, or a problem description."""
    if stored.dtype == torch.float8_e4m3fn and param.dtype == torch.bfloat16:
        scale_name = name[: -len("weight")] + "scale"
        stored = _dequantize_fp8_tiles(stored, read(scale_name))  # wo_a: exact, the scales are powers of 2
    elif stored.dtype == torch.bfloat16 and param.dtype == torch.float32 and name.endswith(PROMOTED_TO_FP32):
        stored = stored.float()
    if stored.dtype != param.dtype:
        return f"{name}: dtype {stored.dtype} does not fit the model's {param.dtype}"
    if stored.shape != param.shape:
        return f"{name}: shape {tuple(stored.shape)}, the model expects {tuple(param.shape)}"
    return stored


@torch.no_grad()
def load_weights(model: nn.Module, files: list[Path]) -> list[str]:
    """Copy the checkpoint's tensors into `model`; returns the names left for later parts."""
    handles = [safe_open(str(f), framework="pt") for f in files]
    where = {name: h for h in handles for name in h.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    params = dict(model.named_parameters())
    problems, consumed, deferred = [], set(), []

    def read(name: str) -> torch.Tensor:
        consumed.add(name)
        return where[name].get_tensor(name)

    for name, param in params.items():
        if name not in where:
            problems.append(f"{name}: missing from the checkpoint")
            continue
        value = _convert(name, read(name), param, read)
        if isinstance(value, str):
            problems.append(value)
        else:
            param.copy_(value)
    for name in where:
        if name in consumed:
            continue
        if name.startswith(NOT_YET_USED):
            deferred.append(name)
        else:
            problems.append(f"{name}: unexpected tensor (the model has no such parameter)")
    if problems:
        raise CheckpointError(", ".join(str(f) for f in files), problems)
    return deferred
