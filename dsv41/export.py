"""Writing model directories in the release's Hugging Face layout, from held or float weights.

A written directory holds `config.json` (the official nested form), `generation_config.json`,
`tokenizer.json` when one is given, and the weights under their official names and on-disk dtypes:
one `model.safetensors`, or `model-0000i-of-0000n.safetensors` shards with
`model.safetensors.index.json`. `dsv41.checkpoint.open_model_dir` / `load_model` read it back.

`export_model` takes either a model as dsv41 holds it (stored formats: re-written as they are, so a
loaded checkpoint writes back bit for bit) or float master weights under the same names (quantised
here into the storage formats by the release's rules). The on-disk form of every tensor comes from
the model's own modules, built on the meta device, so writer and loader cannot disagree.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from dsv41.checkpoint import (
    CONFIG_FILE,
    DEQUANTIZED_AT_LOAD,
    GENERATION_FILE,
    INDEX_FILE,
    NOT_YET_USED,
    PROMOTED_TO_FP32,
    SINGLE_FILE,
    TOKENIZER_FILE,
    CheckpointError,
    GenerationConfig,
    ModelDir,
    dequantize_fp8_tiles,
    load_weights,
    open_model_dir,
    read_tensors,
)
from dsv41.config import ModelConfig, config_to_dict
from dsv41.model.engram import EngramTable
from dsv41.model.layers import BLOCK, Linear, Storage
from dsv41.model.quant import fp8_quant, quantize_weight_fp4, quantize_weight_fp8, unpack_e2m1
from dsv41.model.transformer import build_model


class Form(StrEnum):
    """How one weight is stored on disk."""

    FP8_TILES = "fp8_tiles"  # E4M3 [out, in] + E8M0 scale per 32x32 tile (dense linears, wo_a)
    FP4 = "fp4"  # E2M1 pairs as I8 [out, in/2] + E8M0 scale per 32 along K (routed experts)
    FP8_ROWS = "fp8_rows"  # E4M3 [rows, dim] + E8M0 scale per 32 channels of a row (Engram tables)
    PLAIN = "plain"  # BF16 / F32 as it is, or cast


@dataclass(frozen=True)
class Slot:
    """One model weight: its on-disk form, logical shape and dtype on disk (the weight's, for the
    quantised forms)."""

    form: Form
    shape: tuple[int, ...]
    dtype: torch.dtype


def storage_layout(config: ModelConfig) -> dict[str, Slot]:
    """Every weight of the model (scales implied by the form), in parameter order."""
    model = build_model(config, device="meta")
    slots: dict[str, Slot] = {}
    for prefix, module in model.named_modules():
        name = f"{prefix}.weight"
        if isinstance(module, EngramTable):
            slots[name] = Slot(Form.FP8_ROWS, tuple(module.weight.shape), torch.float8_e4m3fn)
        elif isinstance(module, Linear) and module.storage in (Storage.FP8, Storage.FP4):
            form = Form.FP8_TILES if module.storage is Storage.FP8 else Form.FP4
            slots[name] = Slot(form, (module.out_features, module.in_features), module.weight.dtype)
        elif isinstance(module, Linear) and name.endswith(DEQUANTIZED_AT_LOAD):
            slots[name] = Slot(Form.FP8_TILES, tuple(module.weight.shape), torch.float8_e4m3fn)
    for name, param in model.named_parameters():
        if name not in slots and not _is_scale_of(name, slots):
            promoted = param.dtype == torch.float32 and name.endswith(PROMOTED_TO_FP32)
            slots[name] = Slot(Form.PLAIN, tuple(param.shape), torch.bfloat16 if promoted else param.dtype)
    return {n: slots[n] for n, _ in model.named_parameters() if n in slots}


def _is_scale_of(name: str, slots: Mapping[str, Slot]) -> bool:
    return name.endswith(".scale") and name[: -len("scale")] + "weight" in slots


def _scale_name(name: str) -> str:
    return name[: -len("weight")] + "scale"


@dataclass(frozen=True)
class Stored:
    """On-disk tensors and the weights whose stored form does not give back the source's values
    (float weights quantised, or a held fp32 tensor that is not a bf16 value)."""

    tensors: dict[str, torch.Tensor]
    rounded: list[str]


def to_storage(weights: Mapping[str, torch.Tensor] | nn.Module, config: ModelConfig) -> Stored:
    """The on-disk tensors of `weights` (official names): tensors already in their stored format
    (a weight with its `.scale`) are kept; float weights are quantised; BF16/F32 tensors cast.
    Missing, unknown and mis-shaped tensors are all reported, before any work is done."""
    source = {name: t.detach().cpu() for name, t in
              (weights.state_dict() if isinstance(weights, nn.Module) else weights).items()}
    layout = storage_layout(config)
    problems = [f"{name}: missing" for name in layout if name not in source]
    problems += [f"{name}: not a weight of this model" for name in source
                 if name not in layout and not _is_scale_of(name, layout)]
    problems += [problem for name, slot in layout.items() if name in source
                 if (problem := _problem(name, slot, source[name], source.get(_scale_name(name))))]
    if problems:
        raise CheckpointError("<weights to export>", problems)
    out: dict[str, torch.Tensor] = {}
    rounded: list[str] = []
    for name, slot in layout.items():
        stored = _store(name, slot, source[name], source.get(_scale_name(name)))
        out.update(stored)
        if not _gives_back(slot, source[name], stored[name], stored.get(_scale_name(name))):
            rounded.append(name)
    return Stored(out, rounded)


def _held(slot: Slot, value: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether a quantised weight is given in its stored form (as a loaded model holds it)."""
    return slot.form is not Form.PLAIN and scale is not None and value.dtype == slot.dtype


def _problem(name: str, slot: Slot, value: torch.Tensor, scale: torch.Tensor | None) -> str | None:
    if _held(slot, value, scale):
        want = _stored_shapes(slot)
        if (tuple(value.shape), tuple(scale.shape)) != want or scale.dtype != torch.float8_e8m0fnu:
            return (f"{name}: stored as {tuple(value.shape)} with {scale.dtype} scale {tuple(scale.shape)}, "
                    f"expected {want[0]} with torch.float8_e8m0fnu scale {want[1]}")
        return None
    if not value.is_floating_point() or value.element_size() < 2:
        return f"{name}: {value.dtype} without a scale cannot be stored (give float weights)"
    if tuple(value.shape) != slot.shape:
        return f"{name}: shape {tuple(value.shape)}, expected {slot.shape}"
    return None


def _store(name: str, slot: Slot, value: torch.Tensor, scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """One checked weight (and its scale) in its on-disk form."""
    if slot.form is Form.PLAIN:
        return {name: value.to(slot.dtype).contiguous()}
    if _held(slot, value, scale):
        return {name: value.contiguous(), _scale_name(name): scale.contiguous()}
    if slot.form is Form.FP8_TILES:
        q, s = quantize_weight_fp8(value)
    elif slot.form is Form.FP4:
        q, s = quantize_weight_fp4(value)
    else:
        q, s = fp8_quant(value)
        s = s.to(torch.float8_e8m0fnu)  # powers of two: exact
    return {name: q, _scale_name(name): s}


def _stored_shapes(slot: Slot) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the stored weight and its scale."""
    rows, cols = slot.shape
    if slot.form is Form.FP8_TILES:
        return slot.shape, (-(-rows // BLOCK), -(-cols // BLOCK))
    if slot.form is Form.FP4:
        return (rows, cols // 2), (rows, cols // BLOCK)
    return slot.shape, (rows, cols // BLOCK)


def _gives_back(slot: Slot, source: torch.Tensor, stored: torch.Tensor, scale: torch.Tensor | None) -> bool:
    """Whether loading the stored form reproduces the source values exactly."""
    if scale is None:
        return torch.equal(stored.to(source.dtype), source)
    if source.dtype == stored.dtype:
        return True  # written as held
    return torch.equal(dequantize(slot.form, stored, scale).to(source.dtype), source)


def dequantize(form: Form, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values a stored weight stands for (what a float weight was quantised to)."""
    if form is Form.FP8_TILES:
        return dequantize_fp8_tiles(weight, scale).float()  # bf16 holds every FP8 value times a power of 2
    if form is Form.FP4:
        return (unpack_e2m1(weight).unflatten(-1, (-1, BLOCK)) * scale.float().unsqueeze(-1)).flatten(-2)
    return (weight.float().unflatten(-1, (-1, BLOCK)) * scale.float().unsqueeze(-1)).flatten(-2)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KIB|MIB|GIB|TIB)?\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes from an int or a size such as '5GB' or '500MiB' (HF's max_shard_size spelling)."""
    if isinstance(size, int) and not isinstance(size, bool):
        number = size
    else:
        match = _SIZE.match(str(size))
        if not match:
            raise ValueError(f"not a size: {size!r} (e.g. 5GB, 500MiB, 1000000)")
        number = int(float(match[1]) * _UNITS[(match[2] or "B").upper()])
    if number < 1:
        raise ValueError(f"a shard size must be at least 1 byte, got {size!r}")
    return number


def shard(tensors: Mapping[str, torch.Tensor], max_shard_size: int | str | None) -> list[dict[str, torch.Tensor]]:
    """Tensors in order, cut into shards of at most max_shard_size bytes (a larger tensor gets a
    shard of its own); one shard when no size is given."""
    if max_shard_size is None:
        return [dict(tensors)]
    limit, shards, size = parse_size(max_shard_size), [{}], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    return shards


def write_model_dir(tensors: Mapping[str, torch.Tensor], config: ModelConfig, out_dir: str | Path, *,
                    tokenizer_path: str | Path | None = None, generation: GenerationConfig | None = None,
                    max_shard_size: int | str | None = None) -> ModelDir:
    """Write on-disk tensors and the config files as a model directory. It is built beside
    `out_dir` and renamed into place, so a failed write leaves no partial directory; an existing
    non-empty `out_dir` is refused rather than mixed with."""
    out = Path(out_dir).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty directory; write to a new one")
    if tokenizer_path is not None and not Path(tokenizer_path).is_file():
        raise FileNotFoundError(f"no tokenizer file {tokenizer_path}")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        _write_weights(tensors, partial, max_shard_size)
        (partial / CONFIG_FILE).write_text(json.dumps(config_to_dict(config), indent=2) + "\n")
        generation = generation or GenerationConfig.for_config(config)
        (partial / GENERATION_FILE).write_text(json.dumps(generation.to_json(config.transformers_version),
                                                          indent=2) + "\n")
        if tokenizer_path is not None:
            shutil.copyfile(tokenizer_path, partial / TOKENIZER_FILE)
        if out.exists():
            out.rmdir()
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return open_model_dir(out)


def _write_weights(tensors: Mapping[str, torch.Tensor], directory: Path, max_shard_size: int | str | None) -> None:
    shards = shard(tensors, max_shard_size)
    if len(shards) == 1:
        save_file(shards[0], str(directory / SINGLE_FILE), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, part in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, file)
        total += sum(t.numel() * t.element_size() for t in part.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")


def export_model(weights: Mapping[str, torch.Tensor] | nn.Module, config: ModelConfig, out_dir: str | Path,
                 tokenizer_path: str | Path | None = None, *, generation: GenerationConfig | None = None,
                 max_shard_size: int | str | None = None,
                 extra: Mapping[str, torch.Tensor] | None = None) -> tuple[ModelDir, list[str]]:
    """Write `weights` (a model, or its tensors by official name, stored or float) as a model
    directory in the release layout. `extra` tensors (e.g. DSpark stages under `mtp.*`, which the
    model does not hold yet) are written as they are. Returns the directory and the weights whose
    stored form does not reproduce the given values (quantised or rounded; empty for a model
    loaded from a checkpoint)."""
    stored = to_storage(weights, config)
    extra = dict(extra or {})
    clash = sorted(set(extra) & set(stored.tensors))
    foreign = sorted(name for name in extra if not name.startswith(NOT_YET_USED))
    if clash or foreign:
        raise CheckpointError("<extra tensors>", [f"{n}: also a model weight" for n in clash] +
                              [f"{n}: extra tensors must be under {', '.join(NOT_YET_USED)}" for n in foreign])
    tensors = stored.tensors | {name: t.detach().cpu().contiguous() for name, t in extra.items()}
    model_dir = write_model_dir(tensors, config, out_dir, tokenizer_path=tokenizer_path, generation=generation,
                                max_shard_size=max_shard_size)
    return model_dir, stored.rounded


def convert(source: str | Path, out_dir: str | Path, *,
            max_shard_size: int | str | None = None) -> tuple[ModelDir, list[str]]:
    """Rewrite any model directory (either config format, single file, shards or the golden
    `weights.safetensors`) in the release layout, tensors the model does not use yet included."""
    model_dir = open_model_dir(source)
    model = build_model(model_dir.config)  # no Engram token map: only the weights are needed
    deferred = load_weights(model, list(model_dir.weights_files))
    extra = read_tensors(list(model_dir.weights_files), deferred)
    return export_model(model, model_dir.config, out_dir, model_dir.tokenizer_path, generation=model_dir.generation,
                        max_shard_size=max_shard_size, extra=extra)
