"""DeepSeekMoE: sqrt-softplus router with selection-only bias, clamped SwiGLU experts (SPEC.md §5)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dsv41.kernels import cpu_moe
from dsv41.model import numerics
from dsv41.model.layers import Linear, LinearsBeside, QuantizedRows, Storage, quantize_rows
from dsv41.model.quant import LoopLayout, loop_layout, loop_serves, runs_block_scaled_rows

# A step of at most this many tokens runs its routed experts as one compiled-loop call per
# projection (`MoE._routed_grouped`): below it the per-expert loop's operator calls dominate; above
# it (prefill chunks) the loop no longer serves (`quant.LOOP_ROWS`) and each expert's GEMM is worth its calls.
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
        self._stacks: dict[tuple[str, ...], tuple[list[tuple], LoopLayout]] = {}  # each expert's key, the stack
        self._linears: dict[tuple[str, ...], list[list[Linear]]] = {}
        self._uniform_experts: bool | None = None  # every expert quantized, of one width and clamp

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
        y = self._tokens_by_loops(weights, ids, quantized) if x.size(0) <= GROUPED_MAX_TOKENS else None
        if y is None:
            if quantized is not None and 1 < x.size(0) <= GROUPED_MAX_TOKENS and not torch.is_grad_enabled():
                y = self._routed_grouped(x, weights, ids, quantized)
            else:
                y = self._routed_per_expert(x, weights, ids, quantized)
            y += self.shared_experts(x, quantized=quantized)
        return y.type_as(x).view(shape)

    def _tokens_by_loops(self, weights, ids, quantized: QuantizedRows | None) -> torch.Tensor | None:
        """A decode step's tokens' routed experts (each token's in increasing id) and shared expert,
        summed into fp32 [n, dim] as `_routed_per_expert` (or `_routed_grouped`) and the shared
        expert's call do it, in two compiled loops around one SiLU (`cpu_moe`: the same bits, a
        tenth of the operator calls). None where the loops do not serve (the operators then run):
        a product the loop does not take at this shape, or a hidden activation the general
        quantizer must take."""
        shared = self.shared_experts
        if quantized is None or not self._loops_serve(quantized[0]):
            return None
        n, k = ids.shape
        chosen = ids.numpy()
        order = np.argsort(chosen, axis=1, kind="stable")  # each token's experts by increasing id
        experts = np.concatenate([np.take_along_axis(chosen, order, 1), np.full((n, 1), -1)], axis=1)
        scale = np.ones((n, k + 1), dtype=np.float32)  # the shared expert's product is left as it is
        scale[:, :k] = np.take_along_axis(weights.numpy(), order, 1)
        tokens = np.repeat(np.arange(n), k + 1)
        used = np.unique(chosen).tolist()
        up_layout, down_layout = self._stacked_loop(("w1", "w3"), used), self._stacked_loop(("w2",), used)
        shared_up, shared_down = shared.gate_up.joined_loop_layout(), shared.w2.loop_layout()
        gate = torch.empty(n * (k + 1), shared.w1.out_features, dtype=torch.float32)
        up = torch.empty_like(gate)
        pairs = tokens, experts.reshape(-1).astype(np.int64)
        cpu_moe.experts_gate_up(quantized[0].numpy(), quantized[1].numpy(), *(t.numpy() for t in up_layout),
                                *(t.numpy() for t in shared_up), *pairs, shared.limit, gate.numpy(), up.numpy())
        # each pair's row as alone: rows in whole vector strides (at most 64 floats) already are
        aligned = gate.size(1) % 64 == 0
        silu = F.silu(gate) if aligned else numerics.elementwise_runs(F.silu, gate, gate.size(1))
        y = torch.zeros(n, self.dim, dtype=torch.float32)
        if not cpu_moe.experts_down(silu.numpy(), up.numpy(), scale.reshape(-1), *(t.numpy() for t in down_layout),
                                    *(t.numpy() for t in shared_down), *pairs, y.numpy()):
            return None
        return y

    def _loops_serve(self, q: torch.Tensor) -> bool:
        """Whether `_tokens_by_loops` gives the operators' bits for the quantized tokens q [n, K]:
        the operators then multiply every projection by the compiled loop too."""
        if self._uniform_experts is None:  # the experts' structure, read once (a submodule lookup costs ~1 µs)
            shared = self.shared_experts
            self._uniform_experts = all(
                expert.w1.scale is not None and expert.w1.out_features == shared.w1.out_features
                and expert.limit == shared.limit for expert in [*self.experts, shared])
        inter = self.shared_experts.w1.out_features
        hidden = q.new_empty(q.size(0), inter)
        return (self._uniform_experts and not numerics.opt_in("DSV41_FAST_GEMM", "one GEMM per quantized linear")
                and loop_serves(q, inter) and loop_serves(q, 2 * inter) and loop_serves(hidden, self.dim))

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
        """`_routed_per_expert` with the (token, expert) pairs sorted by expert, so that each
        expert's rows are one run: each projection is one compiled-loop call over every expert's
        run, its weight read where it lies (or, where the loop does not serve, the expert's own
        `Linear` per run). A row's products do not depend on the rows beside it, so nothing is padded,
        and each token's outputs are added in increasing expert id as there."""
        n, k = ids.shape
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)  # pairs by expert, in token order within each
        counts = torch.bincount(flat, minlength=len(self.experts))
        runs = counts.cumsum(0), int(counts.max())  # (where each expert's run ends, the longest run)
        tokens = order // k
        q = quantized[0][tokens], quantized[1][tokens]
        gate, up = self._by_expert(("w1", "w3"), q, runs).chunk(2, dim=-1)
        hidden = self.experts[0].activate(gate, up, weights.reshape(-1, 1)[order]).to(x.dtype)
        out = self._by_expert(("w2",), quantize_rows(hidden), runs)
        place = order.argsort().view(n, k)  # where each (token, slot) pair went
        by_expert = out[place.sort(dim=1).values]  # [n, k, dim]: a token's pairs sort by expert id
        y = torch.zeros_like(x, dtype=torch.float32)
        for slot in range(k):
            y += by_expert[:, slot]
        return y

    def _by_expert(self, names: tuple[str, ...], q: QuantizedRows, runs: tuple[torch.Tensor, int]) -> torch.Tensor:
        """Projections `names` (w1 and w3 side by side, or w2) of FP8 rows q ([R, K] values, [R, K/32]
        scales) whose runs belong to expert 0, 1, ... in turn (`runs`: where each ends, the longest's
        length) -> [R, sum of N] bf16, each run as its expert's `Linear`s compute it. The loop serves
        runs as long as the longest where it serves each projection alone: a row's products and an
        output column's sums are its own, so neither the runs nor the side-by-side weights change them."""
        ends, longest = runs
        linears = self._projections(names)
        if all(loop_serves(q[0][:longest], linear.out_features) for linear in linears[0]) and not numerics.opt_in(
                "DSV41_FAST_GEMM", "one GEMM per quantized linear"):
            used = torch.diff(ends, prepend=ends.new_zeros(1)).nonzero().flatten().tolist()
            return runs_block_scaled_rows(*q, self._stacked_loop(names, used), ends).to(torch.bfloat16)
        bounds = [0, *ends.tolist()]
        return torch.cat([torch.cat([linear(q[0][a:b], (q[0][a:b], q[1][a:b])) for linear in mine], -1)
                          for mine, a, b in zip(linears, bounds, bounds[1:], strict=False) if b > a])

    def _projections(self, names: tuple[str, ...]) -> list[list[Linear]]:
        """Each routed expert's linears `names`, looked up once (a submodule's lookup costs about a
        microsecond, and a batched step asks in every layer)."""
        linears = self._linears.get(names)
        if linears is None:
            linears = self._linears[names] = [[getattr(expert, name) for name in names] for expert in self.experts]
        return linears

    def _stacked_loop(self, names: tuple[str, ...], used: Iterable[int]) -> LoopLayout:
        """Every routed expert's projections `names`, side by side, stacked in the compiled loop's
        layout (`quant.loop_layout`). The experts `used` by the caller are checked against their
        weights' versions and restacked where one changed; the others are not read, so they are
        checked when they are (a step routes a few of the experts: the official 256 would cost 768
        version checks a layer, `small`'s 8 were 3 % of its decode step)."""
        linears = self._projections(names)
        cached = self._stacks.get(names)
        if cached is None:
            keys = [tuple(linear.version() for linear in mine) for mine in linears]
            values, scales = zip(*(self._joined_expert(mine) for mine in linears), strict=True)
            cached = self._stacks[names] = (keys, loop_layout(torch.stack(values), torch.stack(scales)))
            return cached[1]
        keys, layout = cached
        for e in used:
            key = tuple(linear.version() for linear in linears[e])
            if key != keys[e]:
                for stacked, part in zip(layout, loop_layout(*self._joined_expert(linears[e])), strict=True):
                    stacked[e] = part
                keys[e] = key
        return layout

    @staticmethod
    def _joined_expert(linears: list[Linear]) -> tuple[torch.Tensor, torch.Tensor]:
        """One expert's projections' weight values and scales, side by side."""
        parts = [linear.dequantized() for linear in linears]
        return torch.cat([v for v, _ in parts]), torch.cat([s for _, s in parts])
