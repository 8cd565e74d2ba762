"""Seeded random weights in the checkpoint's own storage formats, for the built-in small configs.

Scales follow the recipe of the official golden data: projections N(0,1)·fan_in^-1/2·gain,
quantized to their storage format (FP8 with 32x32 power-of-two tiles, MXFP4 experts); norms
around 1 (0.5 for the block norms); biases and mHC tensors small. Magnitudes stay O(1) through
the 40 layers so every path (clamps, routing, Top-k) is exercised.
"""

from __future__ import annotations

import torch
from torch import nn

from dsv41.model.engram import EngramTable
from dsv41.model.layers import Linear, RMSNorm, Storage
from dsv41.model.quant import fp8_quant, quantize_weight_fp4, quantize_weight_fp8

GAINS = {"wo_b": 0.7, "w1": 1.5, "w3": 1.5, "w2": 0.7, "wgate": 2.0, "head": 3.0}


def _normal(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32)


def _fill_linear(module: Linear, name: str, gen: torch.Generator) -> None:
    gain = GAINS.get(name.rsplit(".", 1)[-1], 1.0)
    w = _normal(gen, module.out_features, module.in_features) * module.in_features**-0.5 * gain
    if module.storage is Storage.FP8:
        values, scale = quantize_weight_fp8(w)
    elif module.storage is Storage.FP4:
        values, scale = quantize_weight_fp4(w)
    else:
        module.weight.copy_(w.to(module.weight.dtype))
        return
    module.weight.copy_(values)
    module.scale.copy_(scale)


def _fill_engram_table(module: EngramTable, gen: torch.Generator) -> None:
    rows, dim = module.weight.shape
    values, scale = fp8_quant(_normal(gen, rows, dim))  # one scale per 32 channels of each row
    module.weight.copy_(values)
    module.scale.copy_(scale.to(torch.float8_e8m0fnu))


def _fill_tensor(name: str, p: nn.Parameter, gen: torch.Generator, dim: int) -> None:
    leaf = name.rsplit(".", 1)[-1]
    n = _normal(gen, *p.shape)
    if leaf.endswith("_fn"):
        value = n * (4 * dim) ** -0.5
    elif leaf.endswith("_base"):
        value = 0.5 * n
    elif leaf.endswith("_scale"):
        value = 1 + 0.3 * n
    elif leaf in ("bias", "bias_vl"):
        value = 0.3 * n
    elif leaf in ("q_weight", "k_weight"):
        value = 1 + 0.2 * n
    elif leaf == "weight" and name.startswith(("vision.", "aligner.")):
        value = n * p.size(-1) ** -0.5
    elif leaf == "weight" and ".gate." in name:
        value = n * p.size(-1) ** -0.5 * 2.0
    else:  # embeddings and attention sinks
        value = n
    p.copy_(value.to(p.dtype))


@torch.no_grad()
def init_random(model: nn.Module, seed: int) -> nn.Module:
    """Fill every parameter of `model` deterministically from `seed`, in module order."""
    gen = torch.Generator().manual_seed(seed)
    dim = model.config.text_config.hidden_size
    handled: set[int] = set()
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            _fill_linear(module, name, gen)
        elif isinstance(module, RMSNorm):
            mean = 0.5 if name.endswith(("attn_norm", "ffn_norm")) else 1.0
            module.weight.copy_((mean * (1 + 0.1 * _normal(gen, *module.weight.shape))).to(module.weight.dtype))
        elif isinstance(module, EngramTable):
            _fill_engram_table(module, gen)
        else:
            continue
        handled.update(id(p) for p in module.parameters())
    for name, p in model.named_parameters():
        if id(p) not in handled:
            _fill_tensor(name, p, gen, dim)
    return model
