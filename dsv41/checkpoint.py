"""Official checkpoint format: the flat `inference/config.json` mapping and weight loading.

The release ships two configs: the nested `config.json` (dsv41's own field names) and the flat
`inference/config.json` that the official `model.py` reads. `INFERENCE_FIELDS` maps one to the
other in both directions. Weights are safetensors with the official tensor names and on-disk
dtypes; `load_weights` matches them to the model by name and applies the release's load-time
conversions, reporting every missing, unexpected, mis-shaped or mistyped tensor in one error.
A model directory (`open_model_dir`) bundles a config, its weight files, an optional
`tokenizer.json` and `generation_config.json`; `dsv41.export` writes one.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from dsv41.config import (
    BUILTIN_CONFIGS,
    CONFIG_DIR,
    ConfigError,
    ModelConfig,
    config_from_dict,
    config_to_dict,
    load_config,
)

if TYPE_CHECKING:
    from dsv41.model.transformer import Transformer

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


def load_named_config(name_or_path: str | Path) -> ModelConfig:
    """A built-in config by name, or a config.json in either official format; a name that is
    neither gets `load_config`'s error (which lists the built-in names)."""
    path = Path(name_or_path).expanduser()
    if str(name_or_path) in BUILTIN_CONFIGS or not path.is_file():
        return load_config(name_or_path)
    try:
        return load_any_config(path)[0]
    except json.JSONDecodeError as exc:
        raise ConfigError(str(path), [f"not valid JSON: {exc}"]) from None


class CheckpointError(ValueError):
    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"checkpoint {source}: {len(problems)} problem(s)\n{lines}")


CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
GENERATION_FILE = "generation_config.json"
BUILTIN_MODELS_DIR = Path(__file__).resolve().parent / "models"


def builtin_models() -> list[str]:
    """Names of the model directories shipped in the package."""
    return sorted(p.parent.name for p in BUILTIN_MODELS_DIR.glob(f"*/{CONFIG_FILE}"))


def resolve_model_dir(model: str | Path) -> Path:
    """A model directory given by path, or a built-in model by name (`small` is dsv41/models/small).
    A bare name of a built-in model comes first, as built-in config names do."""
    name = str(model)
    if name == Path(name).name and (BUILTIN_MODELS_DIR / name / CONFIG_FILE).is_file():
        return BUILTIN_MODELS_DIR / name
    return Path(model).expanduser()


def weight_files(path: str | Path) -> list[Path]:
    """Safetensors files of a checkpoint: a file, or a folder with model.safetensors.index.json,
    model*.safetensors shards, or weights.safetensors. Shards the index names must all exist."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise CheckpointError(str(path), ["no such file or directory"])
    index = path / INDEX_FILE
    if index.is_file():
        shards = sorted(set(_index_map(index).values()))
        missing = [f"{INDEX_FILE} names shard {shard}, which is missing" for shard in shards
                   if not (path / shard).is_file()]
        if missing:
            raise CheckpointError(str(path), missing)
        return [path / shard for shard in shards]
    files = sorted(path.glob("model*.safetensors")) or sorted(path.glob("weights.safetensors"))
    if not files:
        raise CheckpointError(str(path), ["no safetensors weight files found (model.safetensors, "
                                          f"{INDEX_FILE} with its shards, or weights.safetensors)"])
    return files


def _index_map(index: Path) -> dict[str, str]:
    """The weight_map of a shard index (tensor name -> shard file name), checked for shape."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, AttributeError):
        weight_map = None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(str(index), ['not a shard index: expected {"weight_map": {tensor: shard file}}'])
    if any(Path(v).name != v for v in weight_map.values()):
        raise CheckpointError(str(index), ["shard names must be plain file names in the same directory"])
    return weight_map


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(str(file), [f"not a readable safetensors file: {exc}"]) from None


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling defaults and special ids of a model directory, as HF's generation_config.json holds
    them; temperature 0 means greedy (HF: do_sample false)."""

    bos_token_id: int
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0

    @classmethod
    def for_config(cls, config: ModelConfig) -> GenerationConfig:
        """Greedy decoding with the config's special ids: what a directory without the file means."""
        return cls(config.bos_token_id, (config.eos_token_id,), config.pad_token_id)

    def to_json(self, transformers_version: str) -> dict[str, Any]:
        data: dict[str, Any] = {"bos_token_id": self.bos_token_id,
                                "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1
                                else list(self.eos_token_ids)}
        if self.pad_token_id is not None:
            data["pad_token_id"] = self.pad_token_id
        data["do_sample"] = self.temperature > 0
        if self.temperature > 0:
            data |= {"temperature": self.temperature, "top_p": self.top_p}
        return data | {"transformers_version": transformers_version}

    @classmethod
    def from_json(cls, data: Any, config: ModelConfig, source: str) -> GenerationConfig:
        """Read HF fields; ids left out take the config's, sampling fields HF's defaults."""
        if not isinstance(data, dict):
            raise CheckpointError(source, ["not a JSON object"])
        eos = data.get("eos_token_id", config.eos_token_id)
        eos = list(eos) if isinstance(eos, list) else [eos]
        problems = [f"{key}: expected an integer id, got {value!r}"
                    for key, value in (("bos_token_id", data.get("bos_token_id", 0)),
                                       ("pad_token_id", data.get("pad_token_id", 0)),
                                       *(("eos_token_id", e) for e in eos))
                    if value is not None and (isinstance(value, bool) or not isinstance(value, int))]
        sample = data.get("do_sample", False)
        temperature, top_p = data.get("temperature", 1.0), data.get("top_p", 1.0)
        for key, value, ok in (("do_sample", sample, isinstance(sample, bool)),
                               ("temperature", temperature, _number(temperature) and temperature >= 0),
                               ("top_p", top_p, _number(top_p) and 0 < top_p <= 1)):
            if not ok:
                problems.append(f"{key}: {value!r} is out of range")
        if not eos:
            problems.append("eos_token_id: empty list")
        if problems:
            raise CheckpointError(source, problems)
        return cls(data.get("bos_token_id", config.bos_token_id), tuple(eos),
                   data.get("pad_token_id", config.pad_token_id),
                   float(temperature) if sample else 0.0, float(top_p) if sample else 1.0)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


@dataclass(frozen=True)
class ModelDir:
    """A model directory: what every command that takes a model needs. The tokenizer file is passed
    through as a path; building a tokenizer from it is the tokenizer's business."""

    path: Path
    config: ModelConfig
    runtime: RuntimeArgs
    weights_files: tuple[Path, ...]
    tokenizer_path: Path | None
    generation: GenerationConfig


def open_model_dir(path: str | Path) -> ModelDir:
    """Check a model directory and describe it, without reading any weights: the config (either
    official format), the weight files (single file, or an index and every shard it names, each
    holding the tensors the index puts there), tokenizer.json and generation_config.json if present.
    `path` may name a built-in model (`resolve_model_dir`)."""
    path = resolve_model_dir(path)
    if not path.is_dir():
        raise CheckpointError(str(path), ["no such model directory"])
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointError(str(path), [f"{CONFIG_FILE} is missing"])
    try:
        config, runtime = load_any_config(path / CONFIG_FILE)
    except json.JSONDecodeError as exc:
        raise CheckpointError(str(path / CONFIG_FILE), [f"not valid JSON: {exc}"]) from None
    files = weight_files(path)
    if (path / INDEX_FILE).is_file():
        _check_index(path, _index_map(path / INDEX_FILE))
    generation = GenerationConfig.for_config(config)
    if (path / GENERATION_FILE).is_file():
        source = str(path / GENERATION_FILE)
        try:
            data = json.loads((path / GENERATION_FILE).read_text())
        except json.JSONDecodeError as exc:
            raise CheckpointError(source, [f"not valid JSON: {exc}"]) from None
        generation = GenerationConfig.from_json(data, config, source)
    tokenizer = path / TOKENIZER_FILE
    return ModelDir(path, config, runtime, tuple(files), tokenizer if tokenizer.is_file() else None, generation)


def _check_index(path: Path, weight_map: dict[str, str]) -> None:
    """Every tensor the index lists is in its shard, and every shard tensor is listed."""
    listed: dict[str, set[str]] = {}
    for name, shard in weight_map.items():
        listed.setdefault(shard, set()).add(name)
    problems = []
    for shard, names in sorted(listed.items()):
        held = set(_open(path / shard).keys())
        problems += [f"{name}: {INDEX_FILE} puts it in {shard}, which does not hold it"
                     for name in sorted(names - held)]
        problems += [f"{name}: in {shard} but not listed in {INDEX_FILE}" for name in sorted(held - names)]
    if problems:
        raise CheckpointError(str(path), problems)


def engram_token_map(model_dir: ModelDir) -> list[int]:
    """The Engram compressed-token map of the directory's tokenizer (its tokenizer.json, else the
    byte-level stand-in), checked against the config."""
    from dsv41.model.engram import token_map_from_tokenizer
    from dsv41.model.tokenizer import load_tokenizer

    t = model_dir.config.text_config
    which = TOKENIZER_FILE if model_dir.tokenizer_path else f"the byte-level tokenizer (no {TOKENIZER_FILE})"
    try:
        token_map = token_map_from_tokenizer(load_tokenizer(model_dir.path, t.vocab_size))[0]
    except ValueError as exc:  # a tokenizer.json of another vocabulary size
        raise CheckpointError(str(model_dir.path), [str(exc)]) from None
    if max(token_map) + 1 != t.engram_compressed_vocab_size:
        raise CheckpointError(str(model_dir.path), [
            f"{which} compresses to {max(token_map) + 1} Engram ids; {CONFIG_FILE} has "
            f"engram_compressed_vocab_size {t.engram_compressed_vocab_size}"])
    return token_map


def engram_tables_file(model_dir: ModelDir) -> Path:
    """The weight file holding every Engram table (what the engram component memory-maps)."""
    names = [f"layers.{layer}.engram.embed.{part}" for layer in model_dir.config.text_config.engram_layer_ids
             for part in ("weight", "scale")]
    found = {name: file for file in model_dir.weights_files for name in _open(file).keys()  # noqa: SIM118
             if name in names}
    holders = sorted({file.name for file in found.values()})
    if len(found) != len(names) or len(holders) != 1:
        missing = [name for name in names if name not in found]
        raise CheckpointError(str(model_dir.path), [f"the Engram tables must all be in one file; they are in "
                                                    f"{', '.join(holders) or 'no file'}" +
                                                    (f", and {', '.join(missing)} missing" if missing else "")])
    return next(iter(found.values()))


def load_model(model_dir: ModelDir | str | Path, device: str | None = None) -> tuple[Transformer, list[str]]:
    """Build the directory's model and load its weights; also returns the names of stored tensors
    left for later parts (DSpark stages)."""
    from dsv41.model.transformer import build_model

    if not isinstance(model_dir, ModelDir):
        model_dir = open_model_dir(model_dir)
    t = model_dir.config.text_config
    token_map = engram_token_map(model_dir) if t.engram_layer_ids else None
    model = build_model(model_dir.config, token_map, device)
    return model, load_weights(model, list(model_dir.weights_files))


# bf16 tensors the reference holds in fp32 (SPEC.md §4.2 and the golden notes); promotion is exact.
PROMOTED_TO_FP32 = ("head.weight", ".compressor.wkv.weight", ".compressor.wgate.weight",
                    ".norm1.weight", ".norm2.weight", "vision.norm.weight")  # the last three: ViT norms
# Stored FP8 with 32x32 scales, held in bf16 (dequantized at load, as the release's convert.py does).
DEQUANTIZED_AT_LOAD = (".wo_a.weight",)

# Tensors the model does not use yet, loaded by later parts (DSpark stages live under mtp.*).
NOT_YET_USED = ("mtp.",)


def dequantize_fp8_tiles(weight: torch.Tensor, scale: torch.Tensor, block: int = 32) -> torch.Tensor:
    rows = scale.float().repeat_interleave(block, 0).repeat_interleave(block, 1)
    return (weight.float() * rows[: weight.size(0), : weight.size(1)]).to(torch.bfloat16)


def _convert(name: str, stored: torch.Tensor, param: torch.Tensor, read) -> torch.Tensor | str:
    """The stored tensor in the parameter's form, or a problem description."""
    if stored.dtype == torch.float8_e4m3fn and param.dtype == torch.bfloat16:
        scale = read(name[: -len("weight")] + "scale")
        if scale is None:
            return f"{name}: FP8 weight without its {name[: -len('weight')]}scale"
        if scale.dtype != torch.float8_e8m0fnu or scale.shape != _tile_grid(stored.shape):
            return (f"{name[: -len('weight')]}scale: {scale.dtype} {tuple(scale.shape)}, expected "
                    f"torch.float8_e8m0fnu {_tile_grid(stored.shape)}")
        stored = dequantize_fp8_tiles(stored, scale)  # wo_a: exact, the scales are powers of 2
    elif stored.dtype == torch.bfloat16 and param.dtype == torch.float32 and name.endswith(PROMOTED_TO_FP32):
        stored = stored.float()
    if stored.dtype != param.dtype:
        return f"{name}: dtype {stored.dtype} does not fit the model's {param.dtype}"
    if stored.shape != param.shape:
        return f"{name}: shape {tuple(stored.shape)}, the model expects {tuple(param.shape)}"
    return stored


def _tile_grid(shape: torch.Size, block: int = 32) -> tuple[int, int]:
    return (-(-shape[0] // block), -(-shape[1] // block))


@torch.no_grad()
def load_weights(model: nn.Module, files: list[Path]) -> list[str]:
    """Copy the checkpoint's tensors into `model`; returns the names left for later parts.
    Every problem names its tensor and, when it was found, the file that holds it."""
    where: dict[str, tuple[Path, Any]] = {}
    problems, consumed, deferred = [], set(), []
    for file in files:
        handle = _open(Path(file))
        for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if name in where:
                problems.append(f"{name}: in both {where[name][0].name} and {Path(file).name}")
            where[name] = (Path(file), handle)
    params = dict(model.named_parameters())

    def read(name: str) -> torch.Tensor | None:
        if name not in where:
            return None
        consumed.add(name)
        return where[name][1].get_tensor(name)

    for name, param in params.items():
        if name not in where:
            problems.append(f"{name}: missing from the checkpoint")
            continue
        value = _convert(name, read(name), param, read)
        if isinstance(value, str):
            problems.append(f"{value} [{where[name][0].name}]")
        else:
            param.copy_(value)
    for name, (file, _) in where.items():
        if name in consumed:
            continue
        if name.startswith(NOT_YET_USED):
            deferred.append(name)
        else:
            problems.append(f"{name}: unexpected tensor (the model has no such parameter) [{file.name}]")
    if problems:
        raise CheckpointError(", ".join(str(f) for f in files), problems)
    return deferred


def read_tensors(files: list[Path], names: list[str]) -> dict[str, torch.Tensor]:
    """Stored tensors by name, as they are on disk (for passing tensors the model does not hold yet,
    such as the DSpark stages, through a conversion)."""
    wanted, out = set(names), {}
    for file in files:
        handle = _open(Path(file))
        for name in handle.keys():  # noqa: SIM118
            if name in wanted:
                out[name] = handle.get_tensor(name)
    return out
