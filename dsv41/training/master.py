"""fp32 master weights: the trainable form of a model, and back to the checkpoint's storage formats.

In training every weight is an fp32 parameter that forward uses as it is (quantized linears and
Engram tables become plain float matmuls and lookups; no `scale`); the number formats of the
release are applied once, at export, by `inference_state`. Activation and cache rounding (FP8 SWA,
FP4 main KV, MXFP4 index Q/K) stays in the forward through straight-through estimators.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv41.checkpoint import DEQUANTIZED_AT_LOAD, PROMOTED_TO_FP32, dequantize_fp8_tiles
from dsv41.model.engram import EngramTable
from dsv41.model.layers import BLOCK, Linear, Storage
from dsv41.model.quant import fp8_quant, quantize_weight_fp4, quantize_weight_fp8
from dsv41.model.transformer import Transformer, build_model

# selection-only router biases: moved by the balancing rule, never by gradients
UNTRAINED = ("gate.bias", "gate.bias_vl")


def _dequantize(values: torch.Tensor, scale: torch.Tensor, n_in: int) -> torch.Tensor:
    """values [out, in] fp32 times per-row scales [out, ceil(in/32)] spread over their 32 columns."""
    return values * scale.float().repeat_interleave(BLOCK, dim=-1)[:, :n_in]


@torch.no_grad()
def to_training(model: Transformer) -> Transformer:
    """Turn `model` (any storage formats) into its trainable form in place and switch it to train
    mode: fp32 masters with requires_grad, router biases fixed to the balancing rule."""
    for module in model.modules():
        if isinstance(module, Linear) and module.scale is not None:
            values, scale = module.dequantized()
            module.weight = nn.Parameter(_dequantize(values, scale, module.in_features))
            module.scale, module._dequant = None, None
        elif isinstance(module, EngramTable) and module.scale is not None:
            module.weight = nn.Parameter(_dequantize(module.weight.float(), module.scale, module.weight.size(1)))
            module.scale = None
    for name, p in model.named_parameters():
        p.data = p.data.float()
        p.requires_grad_(not name.endswith(UNTRAINED))
    return model.train()


@torch.no_grad()
def inference_state(model: nn.Module, reference: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The masters in the checkpoint's storage formats, by official name: FP8 (32x32 E8M0 tiles)
    and FP4 linears, FP8 Engram rows (one scale per 32 channels), bf16/fp32 tensors cast; tensors a
    loaded checkpoint holds in another form than it stores (FP8 wo_a dequantized, bf16 promoted to
    fp32) take that form, so a model from these values equals the exported directory loaded.
    `reference` is the served module on the meta device (default: the backbone of model.config)."""
    reference = reference if reference is not None else build_model(model.config, device="meta")
    state: dict[str, torch.Tensor] = {}
    for name, module in reference.named_modules():
        prefix = f"{name}." if name else ""
        master = model.get_submodule(name) if name else model
        if isinstance(module, Linear) and module.storage in (Storage.FP8, Storage.FP4):
            quantize = quantize_weight_fp8 if module.storage is Storage.FP8 else quantize_weight_fp4
            state[f"{prefix}weight"], state[f"{prefix}scale"] = quantize(master.weight)
        elif isinstance(module, EngramTable):
            values, scale = fp8_quant(master.weight)
            state[f"{prefix}weight"], state[f"{prefix}scale"] = values, scale.to(torch.float8_e8m0fnu)
    for name, p in reference.named_parameters():
        if name in state:
            continue
        master = model.get_parameter(name).detach()
        if name.endswith(DEQUANTIZED_AT_LOAD):  # stored FP8, held as its bf16 dequantization
            state[name] = dequantize_fp8_tiles(*quantize_weight_fp8(master))
        elif name.endswith(PROMOTED_TO_FP32):  # stored bf16, held in fp32
            state[name] = master.to(torch.bfloat16).to(p.dtype)
        else:
            state[name] = master.to(p.dtype)
    return state


def inference_model(model: Transformer) -> Transformer:
    """A new model in eval mode, its weights the masters in storage formats (what export writes)."""
    token_map = None if model.hasher is None else model.hasher.token_map.tolist()
    served = build_model(model.config, token_map)
    served.load_state_dict(inference_state(model))
    return served
