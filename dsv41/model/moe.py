"""DeepSeekMoE: sqrt-softplus router with selection-only bias, clamped SwiGLU experts (SPEC.md §5)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.model import numerics
from dsv41.model.layers import BLOCK, Linear, LinearsBeside, QuantizedRows, Storage, quantize_rows
from dsv41.model.quant import (
    block_major,
    grouped_block_scaled_matmul,
    grouped_block_scaled_rows,
    loop_layout,
    loop_serves,
)

# A step of at most this many tokens runs its routed experts as one grouped GEMM per projection
# (each expert's tokens padded to the busiest expert's count): below it the per-expert loop's
# operator calls dominate; above it (prefill chunks) the padding would waste real work.
GROUPED_MAX_TOKENS = 64


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

    def scores(self, x: torch.Tensor, tokens_each: int | None = None) -> torch.Tensor:
        """Every expert's score [n, experts]. `tokens_each`: x holds sequences of this many tokens
        each, scored as alone (their GEMMs as one batched GEMM where that keeps the bits, the
        transcendentals over each sequence's scores as a run of its own)."""
        rows = None if tokens_each is None else [tokens_each] * (x.size(0) // tokens_each)
        logits = numerics.linear(x.float(), self.weight.float(), rows)
        if self.scoring == "softmax":
            return numerics.elementwise(torch.softmax, logits, dim=-1)

        def apply(fn, t: torch.Tensor) -> torch.Tensor:
            if rows is None:
                return numerics.elementwise(fn, t)
            return numerics.elementwise_runs(fn, t, tokens_each * t.size(-1))

        if self.scoring == "sigmoid":
            return apply(torch.sigmoid, logits)
        return apply(torch.sqrt, apply(F.softplus, logits))

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None,
                sizes: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [n, dim] -> (weights [n, topk] fp32, expert ids [n, topk]). `sizes`: the token counts
        of a batch's sequences along n, whose scores are then computed as alone (an fp32 GEMM's
        sums change with its row count, and softplus's vector and scalar code, which covers a
        tensor's last elements, differ in the last bits on some CPUs)."""
        if sizes is None:
            scores = self.scores(x)
        elif len(set(sizes)) == 1 and self.scoring != "softmax":
            scores = self.scores(x, sizes[0])
        else:
            scores = torch.cat([self.scores(part) for part in x.split(sizes)])
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
        self.gate_up = LinearsBeside(self.w1, self.w3)
        self.limit = limit

    def forward(self, x: torch.Tensor, weights: torch.Tensor | None = None,
                quantized: QuantizedRows | None = None) -> torch.Tensor:
        """`quantized`: x through `quantize_rows` (w1 and w3 share it; the MoE quantizes once for
        every expert)."""
        if quantized is None and self.w1.scale is not None:  # (fp32 masters in training have no scale)
            quantized = quantize_rows(x)
        hidden = self.activate(*self.gate_up(x, quantized), weights)
        return self.w2(hidden.to(x.dtype))

    def activate(self, gate: torch.Tensor, up: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """The clamped SwiGLU of the w1 (gate) and w3 (up) outputs, times the routing weights (fp32)."""
        gate, up = gate.float(), up.float()
        if self.limit > 0:
            up = up.clamp(-self.limit, self.limit)
            gate = gate.clamp(max=self.limit)
        hidden = numerics.elementwise(F.silu, gate) * up
        return hidden if weights is None else weights * hidden


class MoE(nn.Module):
    def __init__(self, dim: int, inter: int, n_experts: int, topk: int, route_scale: float, scoring: str,
                 limit: float, with_vision_bias: bool, device=None):
        super().__init__()
        self.dim, self.n_experts = dim, n_experts
        self.gate = Gate(dim, n_experts, topk, route_scale, scoring, with_vision_bias, device)
        self.experts = nn.ModuleList(Expert(dim, inter, Storage.FP4, limit, device) for _ in range(n_experts))
        self.shared_experts = Expert(dim, inter, Storage.FP8, limit, device)
        self._stacks: dict[tuple[str, str], tuple[tuple, tuple[torch.Tensor, ...]]] = {}

    def forward(self, x: torch.Tensor, image_mask: torch.Tensor | None = None,
                routing: dict | None = None, sizes: list[int] | None = None) -> torch.Tensor:
        """Routed outputs are summed in fp32 in increasing expert id, then the shared expert.
        `routing`, when given, receives the router's choice ('gate_indices', 'gate_weights');
        `sizes`: a batch's sequences along the tokens, scored each as alone (`Gate.forward`)."""
        shape = x.shape
        x = x.reshape(-1, self.dim)
        weights, ids = self.gate(x, None if image_mask is None else image_mask.reshape(-1), sizes)
        if routing is not None:
            routing.update(gate_indices=ids, gate_weights=weights)
        quantized = quantize_rows(x) if self.shared_experts.w1.scale is not None else None
        if quantized is not None and 1 < x.size(0) <= GROUPED_MAX_TOKENS and not torch.is_grad_enabled():
            y = self._routed_grouped(x, weights, ids, quantized)
        else:
            y = self._routed_per_expert(x, weights, ids, quantized)
        y += self.shared_experts(x, quantized=quantized)
        return y.type_as(x).view(shape)

    def _routed_per_expert(self, x, weights, ids, quantized: QuantizedRows | None) -> torch.Tensor:
        """The routed experts' outputs summed per token [n, dim] (fp32), one expert at a time."""
        y = torch.zeros_like(x, dtype=torch.float32)
        if x.size(0) == 1:  # a decode step: every chosen expert takes the one row, no gathers
            for e, slot in sorted((e, slot) for slot, e in enumerate(ids[0].tolist())):
                y += self.experts[e](x, weights[:, slot, None], quantized)
            return y
        for e in torch.unique(ids).tolist():
            rows, slot = torch.where(ids == e)
            picked = None if quantized is None else (quantized[0][rows], quantized[1][rows])
            y[rows] += self.experts[e](x[rows], weights[rows, slot, None], picked)
        return y

    def _routed_grouped(self, x, weights, ids, quantized: QuantizedRows) -> torch.Tensor:
        """`_routed_per_expert` with each projection of the experts as one batched GEMM: every
        expert when more than half are in use (idle ones get padding rows; no weights copied),
        else only those in use. Rows are padded to the busiest expert's count (padding rows carry
        weight 0 and are dropped), and each token's outputs are added in increasing expert id as there."""
        n, k = ids.shape
        group = ids.flatten()
        counts = torch.bincount(group, minlength=len(self.experts))
        used = torch.arange(len(self.experts))
        if 2 * int((counts > 0).sum()) <= len(self.experts):  # few in use: only theirs (their weights picked)
            used = counts.nonzero().squeeze(1)
            group = (torch.cumsum(counts > 0, 0) - 1)[group]
            counts = counts[used]
        width = int(counts.max())
        order = torch.argsort(group, stable=True)
        rank = torch.empty_like(order)
        rank[order] = torch.arange(n * k) - (counts.cumsum(0) - counts)[group[order]]
        padded = group * width + rank  # row of each (token, slot) pair in [experts in use * width]
        tokens = torch.arange(n).repeat_interleave(k)
        rows = torch.zeros(used.numel() * width, dtype=torch.long).index_put_((padded,), tokens)
        row_weights = weights.new_zeros(rows.numel(), 1).index_put_((padded,), weights.reshape(-1, 1))
        q = quantized[0][rows].unflatten(0, (-1, width)), quantized[1][rows].unflatten(0, (-1, width))
        gate, up = self._grouped_linear("w1", used, q), self._grouped_linear("w3", used, q)
        hidden = self.experts[0].activate(gate, up, row_weights.unflatten(0, (-1, width))).to(x.dtype)
        hidden_q = tuple(t.unflatten(0, (-1, width)) for t in quantize_rows(hidden.flatten(0, 1)))
        out = self._grouped_linear("w2", used, hidden_q).flatten(0, 1)
        by_expert = out[padded.view(n, k).gather(1, ids.argsort(dim=1))]  # [n, k, dim], ascending expert id
        y = torch.zeros_like(x, dtype=torch.float32)
        for slot in range(k):
            y += by_expert[:, slot]
        return y

    def _grouped_linear(self, name: str, used: torch.Tensor, q: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Projection `name` (w1, w2 or w3) of the experts `used` over their padded FP8 rows q
        ([experts, width, K] values, [experts, width, K/32] scales) -> [experts, width, N] bf16,
        as each expert's `Linear` computes it (the fast GEMM when DSV41_FAST_GEMM=1)."""
        fast = numerics.opt_in("DSV41_FAST_GEMM", "one GEMM per quantized linear")
        if not fast and loop_serves(q[0], getattr(self.experts[0], name).out_features, grouped=True):
            return grouped_block_scaled_rows(*q, self._stacked(name, "loop"), used).to(torch.bfloat16)
        stacked = self._stacked(name, "fast" if fast else "blocks")
        if used.numel() < len(self.experts):
            stacked = tuple(t[used] for t in stacked)
        if fast:
            y = torch.bmm((q[0].unflatten(-1, (-1, BLOCK)) * q[1].unsqueeze(-1)).flatten(-2), stacked[0])
        else:
            y = grouped_block_scaled_matmul(q[0], q[1], *stacked, BLOCK)
        return y.to(torch.bfloat16)

    def _stacked(self, name: str, kind: str) -> tuple[torch.Tensor, ...]:
        """Every routed expert's projection `name` stacked, cached until a weight changes: for kind
        "fast" their real values [E, K, N] (the fast GEMM), "blocks" block-major values and per-row
        scales (`grouped_block_scaled_matmul`), "loop" the compiled loop's layout (`quant.loop_layout`)."""
        linears = [getattr(expert, name) for expert in self.experts]
        key = tuple(linear.version() for linear in linears)
        cached = self._stacks.get((name, kind))
        if cached is None or cached[0] != key:
            if kind == "fast":
                stacked = (torch.stack([linear.scaled() for linear in linears]),)
            else:
                parts = zip(*(linear.dequantized() for linear in linears), strict=True)
                values, scales = (torch.stack(t) for t in parts)
                stacked = loop_layout(values, scales) if kind == "loop" else (block_major(values, BLOCK), scales)
            cached = self._stacks[(name, kind)] = (key, stacked)
        return cached[1]
