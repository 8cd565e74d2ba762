"""DeepSeekMoE: sqrt-softplus router with selection-only bias, clamped SwiGLU experts (SPEC.md §5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.model import numerics
from dsv41.model.layers import Linear, QuantizedRows, Storage, quantize_rows


class Gate(nn.Module):
    """Scores every expert; the correction bias (a separate one for image-span tokens) only picks
    the experts, the weights come from the unbiased scores."""

    def __init__(self, dim: int, n_experts: int, topk: int, route_scale: float, scoring: str,
                 with_vision_bias: bool, device=None):
        super().__init__()
        self.topk, self.route_scale, self.scoring = topk, route_scale, scoring
        self.weight = nn.Parameter(torch.empty(n_experts, dim, dtype=torch.bfloat16, device=device),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_experts, dtype=torch.float32, device=device), requires_grad=False)
        self.bias_vl = (nn.Parameter(torch.empty(n_experts, dtype=torch.float32, device=device),
                                     requires_grad=False) if with_vision_bias else None)

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        logits = numerics.linear(x.float(), self.weight.float())
        if self.scoring == "softmax":
            return numerics.elementwise(torch.softmax, logits, dim=-1)
        if self.scoring == "sigmoid":
            return numerics.elementwise(torch.sigmoid, logits)
        return numerics.elementwise(torch.sqrt, numerics.elementwise(F.softplus, logits))

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, dim] -> (weights [n, topk] fp32, expert ids [n, topk])."""
        scores = self.scores(x)
        bias = self.bias
        if image_mask is not None and self.bias_vl is not None:
            bias = torch.where(image_mask.unsqueeze(-1), self.bias_vl, bias)
        ids = (scores + bias).topk(self.topk, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.topk > 1:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + numerics.scalar(1e-20))
        return weights * numerics.scalar(self.route_scale), ids


class Expert(nn.Module):
    """SwiGLU with the training clamps: the up branch on both sides, the gate branch from above.
    The routing weight multiplies the hidden activation before the down projection."""

    def __init__(self, dim: int, inter: int, storage: Storage, limit: float, device=None):
        super().__init__()
        self.w1 = Linear(dim, inter, storage, device)
        self.w2 = Linear(inter, dim, storage, device)
        self.w3 = Linear(dim, inter, storage, device)
        self.limit = limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None,
                quantized: QuantizedRows | None = None) -> torch.Tensor:
        """`quantized`: x through `quantize_rows` (w1 and w3 share it; the MoE quantizes once for
        every expert)."""
        if quantized is None and self.w1.scale is not None:  # (fp32 masters in training have no scale)
            quantized = quantize_rows(x)
        gate, up = self.w1(x, quantized).float(), self.w3(x, quantized).float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        hidden = numerics.elementwise(F.silu, gate) * up
        if weights is not None:
            hidden = weights * hidden
        return self.w2(hidden.to(x.dtype))


class MoE(nn.Module):
    def __init__(self, dim: int, inter: int, n_experts: int, topk: int, route_scale: float, scoring: str,
                 limit: float, with_vision_bias: bool, device=None):
        super().__init__()
        self.dim, self.n_experts = dim, n_experts
        self.gate = Gate(dim, n_experts, topk, route_scale, scoring, with_vision_bias, device)
        self.experts = nn.ModuleList(Expert(dim, inter, Storage.FP4, limit, device) for _ in range(n_experts))
        self.shared_experts = Expert(dim, inter, Storage.FP8, limit, device)

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None,
                routing: dict | None = None) -> torch.Tensor:
        """Routed outputs are summed in fp32 in increasing expert id, then the shared expert.
        `routing`, when given, receives the router's choice ('gate_indices', 'gate_weights')."""
        shape = x.shape
        x = x.reshape(-1, self.dim)
        weights, ids = self.gate(x, None if image_mask is None else image_mask.reshape(-1))
        if routing is not None:
            routing.update(gate_indices=ids, gate_weights=weights)
        y = torch.zeros_like(x, dtype=torch.float32)
        quantized = quantize_rows(x) if self.shared_experts.w1.scale is not None else None
        if x.size(0) == 1:  # a decode step: every chosen expert takes the one row, no gathers
            for e, slot in sorted((e, slot) for slot, e in enumerate(ids[0].tolist())):
                y += self.experts[e](x, weights[:, slot, None], quantized)
        else:
            for e in torch.unique(ids).tolist():
                rows, slot = torch.where(ids == e)
                picked = None if quantized is None else (quantized[0][rows], quantized[1][rows])
                y[rows] += self.experts[e](x[rows], weights[rows, slot, None], picked)
        y += self.shared_experts(x, quantized=quantized)
        return y.type_as(x).view(shape)
