"""Basic modules whose parameters are the official checkpoint tensors (names, shapes, dtypes)."""

from __future__ import annotations

import functools
from enum import StrEnum

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.kernels import cpu_bf16_rows, cpu_loops
from dsv41.model import numerics
from dsv41.model.quant import (
    LoopLayout,
    block_scaled_matmul,
    block_scaled_rows,
    fp8_quant,
    loop_layout,
    loop_serves,
    quantized_block_scaled_rows,
    unpack_e2m1,
)

BLOCK = 32  # FP8 weight blocks are 32x32; FP4 expert scales and activation scales cover 32 along K


class Storage(StrEnum):
    FP8 = "fp8"  # E4M3 weight [out, in] + E8M0 scale [ceil(out/32), ceil(in/32)]
    FP4 = "fp4"  # packed E2M1 pairs as int8 [out, in/2] + E8M0 scale [out, in/32]
    BF16 = "bf16"
    FP32 = "fp32"


def _weight_tensors(storage: Storage, n_out: int, n_in: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    def ceil(n: int) -> int:
        return (n + BLOCK - 1) // BLOCK

    if storage is Storage.FP8:
        weight = torch.empty(n_out, n_in, dtype=torch.float8_e4m3fn, device=device)
        return weight, torch.empty(ceil(n_out), ceil(n_in), dtype=torch.float8_e8m0fnu, device=device)
    if storage is Storage.FP4:
        weight = torch.empty(n_out, n_in // 2, dtype=torch.int8, device=device)
        return weight, torch.empty(n_out, n_in // BLOCK, dtype=torch.float8_e8m0fnu, device=device)
    dtype = torch.bfloat16 if storage is Storage.BF16 else torch.float32
    return torch.empty(n_out, n_in, dtype=dtype, device=device), None


QuantizedRows = tuple[torch.Tensor, torch.Tensor]  # FP8 values as fp32 [rows, K], scales [rows, K/32]


class Linear(nn.Module):
    """y = x W^T. Quantized weights take an FP8-quantized activation and a block-scaled fp32 GEMM
    with a bf16 result, as the reference does; bf16/fp32 weights use a plain matmul."""

    def __init__(self, n_in: int, n_out: int, storage: Storage = Storage.FP8, device=None):
        super().__init__()
        self.in_features, self.out_features, self.storage = n_in, n_out, Storage(storage)
        weight, scale = _weight_tensors(self.storage, n_out, n_in, device)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.scale = None if scale is None else nn.Parameter(scale, requires_grad=False)
        self._dequant: tuple[tuple, torch.Tensor, torch.Tensor] | None = None
        self._scaled: tuple[torch.Tensor, torch.Tensor] | None = None
        self._loop: tuple[torch.Tensor, LoopLayout] | None = None
        self._rows_layout: tuple[tuple, tuple[torch.Tensor, float] | None] | None = None

    def version(self) -> tuple[int, int, int]:
        """Changes whenever the weight or its scale does: the key of caches derived from them. Read
        from `_parameters` (what `self.weight` resolves to: a parameter's slot takes only a
        Parameter), as `nn.Module.__getattr__` made this key 7x dearer; it is checked at every
        quantized linear's call and per routed expert in a batched step."""
        parameters = self._parameters
        weight = parameters["weight"]
        return weight.data_ptr(), weight._version, parameters["scale"]._version

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Weight values (fp32, unscaled) and per-row per-32 scales, cached until the weight changes."""
        key = self.version()
        if self._dequant is None or self._dequant[0] != key:
            if self.storage is Storage.FP4:
                values, scale = unpack_e2m1(self.weight), self.scale.float()
            else:
                values = self.weight.float()
                scale = self.scale.float().repeat_interleave(BLOCK, dim=0)[: self.out_features]
            self._dequant = (key, values, scale)
        return self._dequant[1], self._dequant[2]

    def scaled(self) -> torch.Tensor:
        """The weight's real values [in, out] (fp32, scales applied), cached until the weight changes."""
        values, scale = self.dequantized()
        if self._scaled is None or self._scaled[0] is not values:
            real = (values.unflatten(1, (-1, BLOCK)) * scale.unsqueeze(-1)).flatten(1)
            self._scaled = (values, real.t().contiguous())
        return self._scaled[1]

    def loop_layout(self) -> LoopLayout:
        """The weight as the compiled loop of decode-sized products reads it (`quant.loop_layout`),
        cached with the values it comes from."""
        values, scale = self.dequantized()
        if self._loop is None or self._loop[0] is not values:
            self._loop = (values, loop_layout(values, scale))
        return self._loop[1]

    def one_row_products(self, x: torch.Tensor, groups: int, path: str = "grouped") -> torch.Tensor | None:
        """x [R, groups, in/groups] bf16 -> [R, groups, out/groups]: each row's group g times group g's
        rows of this bf16 weight, each with the bits of that row's own one-row GEMM (`path`:
        `numerics.grouped_projection` of it alone, or, one group, `numerics.linear` of it alone),
        all in one compiled loop (`cpu_bf16_rows`; torch pays about 35 µs around each such GEMM).
        None where the loop does not serve: stable numerics, autograd, a weight of more than
        `cpu_bf16_rows.MOST_WEIGHTS` values (the GEMM's own work then outweighs the call), a shape
        whose order `cpu_bf16_rows.find_order` did not find on this machine, a weight or a row
        outside the loop's exact range (`cpu_bf16_rows.row_floor`)."""
        weight = self._parameters["weight"]
        if (numerics.is_stable() or torch.is_grad_enabled() or not x.is_cpu or x.dtype != torch.bfloat16
                or weight.dtype != torch.bfloat16 or weight.numel() > cpu_bf16_rows.MOST_WEIGHTS):
            return None
        rows, _, k = x.shape
        n = self.out_features // groups
        order = cpu_bf16_rows.find_order(path, groups, k, n, torch.get_num_threads())
        if order is None:
            return None
        key = (weight.data_ptr(), weight._version, groups)
        if self._rows_layout is None or self._rows_layout[0] != key:
            w = weight.view(groups, n, k)
            floor = cpu_bf16_rows.row_floor(w)
            self._rows_layout = (key, None if floor is None else (cpu_bf16_rows.layout(w), floor))
        if self._rows_layout[1] is None:
            return None
        layout, floor = self._rows_layout[1]
        out = torch.empty(rows, groups, n, dtype=torch.bfloat16)
        if not cpu_bf16_rows.run(x.contiguous().view(torch.int16).numpy(), layout.numpy(), order, floor,
                                 out.view(torch.int16).numpy()):
            return None
        return out

    def _one_row_each(self, x: torch.Tensor, rows: list[int] | None) -> torch.Tensor | None:
        """`numerics.linear` of a bf16 weight by the one-row loop, where x [1, s, in] holds one token
        alone or one token of each sequence of a batch (`rows` all 1); None elsewhere."""
        if self.storage is not Storage.BF16 or x.dim() != 3 or x.size(0) != 1:
            return None
        if not (x.size(1) == 1 or (rows is not None and max(rows) == 1)):
            return None
        y = self.one_row_products(x.view(x.size(1), 1, x.size(2)), 1, "linear")
        return None if y is None else y.view(1, x.size(1), self.out_features)

    def forward(self, x: torch.Tensor, quantized: QuantizedRows | None = None,
                rows: list[int] | None = None) -> torch.Tensor:
        """y = x W^T; `quantized` is x already through `quantize_rows` (linears that share an input
        quantize it once). With DSV41_FAST_GEMM=1 (inference only) the quantized activations and
        the weight's cached real values go through one fp32 GEMM: the same exact products summed in
        the GEMM's own order instead of block by block. `rows`: a batch's token counts per sequence
        along x's second-to-last axis; a bf16/fp32 weight's GEMM then runs per sequence, as alone
        (`numerics.linear`); the block-scaled products of a quantized weight sum each row alone anyway."""
        if self.scale is None:
            y = self._one_row_each(x, rows)
            return y if y is not None else numerics.linear(x, self.weight, rows)
        fast = numerics.opt_in("DSV41_FAST_GEMM", "one GEMM per quantized linear")
        if quantized is None and not fast and loop_serves(x.reshape(-1, x.size(-1)), self.out_features):
            y = quantized_block_scaled_rows(x, self.loop_layout())
            if y is not None:
                return y.to(torch.bfloat16).view(*x.shape[:-1], self.out_features)
        q, q_scale = quantized if quantized is not None else quantize_rows(x)
        if fast:
            y = torch.mm((q.unflatten(1, (-1, BLOCK)) * q_scale.unsqueeze(-1)).flatten(1), self.scaled())
        elif loop_serves(q, self.out_features):
            y = block_scaled_rows(q, q_scale, self.loop_layout())
        else:
            values, scale = self.dequantized()
            y = block_scaled_matmul(q, q_scale, values, scale, BLOCK)
        return y.to(torch.bfloat16).view(*x.shape[:-1], self.out_features)



SIDE_BY_SIDE_ROWS = 64  # up to this many rows (decode steps) linears sharing an input multiply as one GEMM


class LinearsBeside:
    """Linears that take the same input (an expert's w1 and w3, attention's wq_a and wkv), each
    output as its own `Linear.forward` gives it. The input is quantized once; at decode sizes the
    block-scaled GEMMs of quantized weights run as one over the weights side by side (a GEMM of
    one or a few rows costs about its fixed overhead), where this machine's GEMM gives every column
    the bits it gets in its own linear's GEMM (`_beside_keeps_bits`, checked once per shape). The
    side-by-side weights are the linears' own cached values: each linear's cache becomes a view of
    them, so nothing is held twice."""

    def __init__(self, *linears: Linear):
        self.linears = linears
        self._joined: tuple[tuple, torch.Tensor, torch.Tensor] | None = None
        self._joined_loop: tuple[torch.Tensor, LoopLayout] | None = None

    def __call__(self, x: torch.Tensor, quantized: QuantizedRows | None = None) -> list[torch.Tensor]:
        if any(linear.scale is None for linear in self.linears):
            return [linear(x) for linear in self.linears]
        widths = [linear.out_features for linear in self.linears]
        flat = x.reshape(-1, x.size(-1))
        rows = flat.size(0)
        if (rows > SIDE_BY_SIDE_ROWS or numerics.is_stable() or torch.is_grad_enabled()
                or numerics.opt_in("DSV41_FAST_GEMM", "one GEMM per quantized linear")
                or not _beside_keeps_bits(x.size(-1), tuple(widths), rows, torch.get_num_threads())):
            quantized = quantized if quantized is not None else quantize_rows(x)
            return [linear(x, quantized) for linear in self.linears]
        values, scale = self.joined()
        y = None
        if loop_serves(flat, values.size(0)):
            y = (quantized_block_scaled_rows(x, self.joined_loop_layout()) if quantized is None
                 else block_scaled_rows(*quantized, self.joined_loop_layout()))
        if y is None:
            quantized = quantized if quantized is not None else quantize_rows(x)
            y = block_scaled_matmul(*quantized, values, scale, BLOCK)
        y = y.to(torch.bfloat16)
        return [part.reshape(*x.shape[:-1], part.size(-1)) for part in y.split(widths, dim=-1)]

    def joined(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every linear's weight values [sum of out, in] and per-row scales, side by side."""
        key = tuple(linear.version() for linear in self.linears)
        if self._joined is None or self._joined[0] != key:
            parts = [linear.dequantized() for linear in self.linears]
            values, scale = torch.cat([v for v, _ in parts]), torch.cat([s for _, s in parts])
            widths = [linear.out_features for linear in self.linears]
            for linear, v, s in zip(self.linears, values.split(widths), scale.split(widths), strict=True):
                linear._dequant = (linear.version(), v, s)
            self._joined = (key, values, scale)
        return self._joined[1], self._joined[2]

    def joined_loop_layout(self) -> LoopLayout:
        """The side-by-side weights in the compiled loop's layout, cached with them."""
        values, scale = self.joined()
        if self._joined_loop is None or self._joined_loop[0] is not values:
            self._joined_loop = (values, loop_layout(values, scale))
        return self._joined_loop[1]


def fill_weight_caches(model: nn.Module) -> None:
    """Build every quantized linear's dequantized weights, and the side-by-side joins of those that
    share an input, now instead of at first use, each with its compiled loop's layout (a linear
    inside a join only the join's): what a served model holds after its warm-up (whose prefill
    stacks every routed expert), for measuring decode steps without a prefill before them, where
    each routed expert's first token would pay its dequantization and layout."""
    joins = [value for module in model.modules() for value in vars(module).values()
             if isinstance(value, LinearsBeside) and all(linear.scale is not None for linear in value.linears)]
    joined = {id(linear) for join in joins for linear in join.linears}
    for join in joins:
        join.joined_loop_layout()
    for module in model.modules():
        if isinstance(module, Linear) and module.scale is not None and id(module) not in joined:
            module.loop_layout()  # (dequantizes too; a joined linear's values came with its join)


@functools.cache
def _beside_keeps_bits(k: int, widths: tuple[int, ...], rows: int, threads: int) -> bool:
    """Whether block_scaled_matmul over weights side by side gives each column the bits of its own
    weight's product, for rows x k inputs on this machine (the BLAS picks kernels by shape, so
    random FP8 values at the shape decide it)."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(rows, k, generator=generator, dtype=torch.float32)
    weights = [torch.randn(n, k, generator=generator, dtype=torch.float32) for n in widths]
    a_values, a_scale = quantize_rows(a)
    quantized = [quantize_rows(w) for w in weights]
    alone = [block_scaled_matmul(a_values, a_scale, v, s, BLOCK) for v, s in quantized]
    together = block_scaled_matmul(a_values, a_scale, torch.cat([v for v, _ in quantized]),
                                   torch.cat([s for _, s in quantized]), BLOCK)
    return torch.equal(together, torch.cat(alone, dim=-1))


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """x [..., K] as the input of a quantized linear: FP8 values as fp32 [rows, K] and their
    power-of-two scales [rows, K/32]. Row i of the result depends on row i of x alone. On the CPU
    without autograd one compiled loop computes `fp8_quant`'s bits (`cpu_loops.fp8_quantize_rows`;
    a block with a NaN or infinity takes `fp8_quant` itself): in torch operators this was about 20
    calls, before every quantized GEMM."""
    if cpu_loops.serves(x) and BLOCK == cpu_loops.FP8_BLOCK and x.size(-1) % BLOCK == 0:
        rows = x.reshape(-1, x.size(-1)).float().contiguous()
        values, scale = torch.empty_like(rows), rows.new_empty(rows.size(0), rows.size(1) // BLOCK)
        if cpu_loops.fp8_quantize_rows(rows.numpy(), values.numpy(), scale.numpy()):
            return values, scale
    q, q_scale = fp8_quant(x, BLOCK)
    flat = q.reshape(-1, x.size(-1)).float()
    return flat, q_scale.reshape(flat.size(0), -1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.bfloat16, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    mean_square = numerics.mean(numerics.wide(xf).square(), -1).float()
    xf = xf * numerics.elementwise(torch.rsqrt, mean_square + numerics.scalar(eps))
    return (weight * xf).to(x.dtype)


def rms_norm_by_loop(x: torch.Tensor, weight: torch.Tensor, eps: float, width: int) -> torch.Tensor | None:
    """`RMSNorm` by `cpu_loops.rms_norm_rows` (bf16 or fp32 CPU rows, the weight bf16), whose
    `cpu_loops.rms_norm_row` the compiled attention inputs use: the check of its sum order. Not
    the norms' own path: alone, its call cost what the operators do. None where a bf16 output
    would be NaN."""
    rows = x.reshape(-1, x.size(-1)).contiguous()
    out = torch.empty_like(rows)
    bf16 = x.dtype == torch.bfloat16
    if bf16:  # as their bits: numpy has no bf16
        rows, out = rows.view(torch.int16), out.view(torch.int16)
    if not cpu_loops.rms_norm_rows(rows.numpy(), bf16, weight.view(torch.int16).numpy(), eps, width, out.numpy()):
        return None
    return out.view(x.dtype).view(x.shape)


@functools.cache
def norm_sum_width(n: int) -> int | None:
    """The vector width (in floats) whose lanes give torch's sum of n float32 values on this machine
    (`cpu_loops._lanes_sum`; 8 on the machines measured, AVX-512 ones too), or None: checked once
    per length on whole norms of random bf16 and fp32 rows, 1, 3 and 17 at a time (a norm's
    rsqrt runs in torch's vector code from 16 rows)."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(n, generator=generator, dtype=torch.float32) + 1).bfloat16()
    spread = [4.0 ** torch.randint(-8, 8, (rows, 1), generator=generator).float() for rows in (1, 3, 17)]
    trials = [((torch.randn(scale.size(0), n, generator=generator, dtype=torch.float32) * scale).to(dtype), eps)
              for dtype in (torch.bfloat16, torch.float32) for scale in spread for eps in (1e-6, 1e-20)]
    with torch.inference_mode():
        for width in (8, 16, 4):
            if all(_same_bits(_rms_norm(x, weight, eps), rms_norm_by_loop(x, weight, eps, width))
                   for x, eps in trials):
                return width
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return b is not None and torch.equal(a.view(bits), b.view(bits))


class Embedding(nn.Module):
    def __init__(self, n_rows: int, dim: int, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_rows, dim, dtype=torch.bfloat16, device=device),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
