"""Number formats of the V4.1 release, as the official reference rounds them (SPEC.md §4.1).

Three quantizers matter:
- FP8 activations (E4M3, 32 per power-of-two scale, scale rounded *up*): before every FP8/FP4 GEMM
  and for the SWA cache;
- MXFP4 (E2M1, 32 per E8M0 scale, rounded up): indexer queries and keys;
- FP4 with E4M3 scales (E2M1, 16 per E4M3(amax/6) scale, no global scale): main compressed KV.

`*_qdq` functions quantize then dequantize back to the input dtype, which is how the reference
simulates the caches. Power-of-two scales here round up, unlike OCP MX's round-down convention.

Non-finite inputs (docs/kernels.md, "Special values"): a block's scale comes from its largest
*finite* magnitude, so a NaN or ±inf element changes only itself. NaN stays NaN where the element
format has a NaN (E4M3) and becomes -0 in E2M1, which has none; ±inf saturates to the format's
largest value. For finite inputs this is exactly the reference.
"""

from __future__ import annotations

import functools

import torch

from dsv41.kernels import codecs, cpu_loops
from dsv41.kernels.codecs import (
    E2M1_MAX,
    E4M3_MAX,
    e2m1_decode,
    e2m1_encode,
    e4m3_encode,
    e8m0_encode,
    pack_nibbles,
    pow2_scale_up,
    unpack_nibbles,
)
from dsv41.model import numerics

FP8_MAX, FP4_MAX = E4M3_MAX, E2M1_MAX


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> E4M3 (saturating, round-to-nearest-even) as a float8 tensor."""
    return e4m3_encode(x).view(torch.float8_e4m3fn)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes (uint8 or int8 storage) -> [..., K] fp32 values."""
    return e2m1_decode(unpack_nibbles(packed))


def _finite_amax(x: torch.Tensor, dim: int | tuple[int, ...] = -1) -> torch.Tensor:
    """The largest finite |x| along dim (0 if none): a NaN or inf element must not set the scale of
    its block, or the whole block would decode to zeros or NaN."""
    return x.abs().nan_to_num(nan=0.0, posinf=0.0).amax(dim=dim)


def _groups(x: torch.Tensor, block: int) -> torch.Tensor:
    if x.size(-1) % block:
        raise ValueError(f"last dim {x.size(-1)} is not a multiple of the quantization block {block}")
    return x.float().unflatten(-1, (-1, block))


_FP8_RECIPROCAL = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
_FP32_MANTISSA, _FP32_EXPONENT = 0x7FFFFF, 0x7F800000
_INF = torch.tensor(float("inf"), dtype=torch.float32)


def fp8_quant(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 activation quantization: (E4M3 values [..., K], fp32 pow-2 scales [..., K/block]).

    It runs before every quantized GEMM, so it takes a short path with the same bits: amax is
    clamped to >= 1e-4 and finite, so amax / 448 is a normal fp32 far inside E8M0's range and its
    power-of-two ceiling is one add and mask on the bits; the scaled values are within ±448 (±inf
    elements clamp there), so torch's saturating-free float8 cast rounds them as `to_e4m3` does.
    A NaN element takes the general path (its code keeps its sign there); only a block with a NaN
    or inf pays for the finite-only amax."""
    groups = _groups(x, block)
    amax = groups.abs().amax(dim=-1)  # NaN or inf where a block holds one
    if not (amax < _INF).all():  # (isfinite would cost four operators)
        amax = _finite_amax(groups)
        if groups.isnan().any():
            scale = pow2_scale_up(amax.clamp_min(1e-4), FP8_MAX)
            return to_e4m3(groups / scale.unsqueeze(-1)).flatten(-2), scale
    amax = amax.clamp_min(1e-4)
    ratio = (amax * _FP8_RECIPROCAL).view(torch.int32)
    mantissa, exponent = numerics.scalar(_FP32_MANTISSA, torch.int32), numerics.scalar(_FP32_EXPONENT, torch.int32)
    scale = ((ratio + mantissa) & exponent).view(torch.float32)
    values = (groups / scale.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return values.flatten(-2), scale


def straight_through(x: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """`rounded` in value, identity in gradient (the straight-through estimator), so training sees
    the cache formats' rounding; a tensor without gradient is returned as it is."""
    if not x.requires_grad:
        return rounded
    return rounded.detach() + (x - x.detach())


def fp8_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    values, scale = fp8_quant(x.detach(), block)
    rounded = (values.float().unflatten(-1, (-1, block)) * scale.unsqueeze(-1)).flatten(-2).to(x.dtype)
    return straight_through(x, rounded)


def _fp4_scaled(x: torch.Tensor, block: int, e4m3_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    groups = _groups(x, block)
    amax = _finite_amax(groups)
    scale = codecs.e4m3_scale(amax, FP4_MAX) if e4m3_scale else pow2_scale_up(amax.clamp_min(6 * 2**-126), FP4_MAX)
    return (groups / scale.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX), scale


def _fp4_by_loop(x: torch.Tensor, block: int, e4m3_scale: bool) -> tuple[torch.Tensor, ...] | None:
    """(E2M1 codes [..., K], dequantized values [..., K] fp32, scales [..., K/block]) of x by the
    compiled loop (`cpu_loops.fp4_quantize_rows`: the operators' bits, one call instead of about
    thirty), or None where it does not serve: off the CPU, under autograd, or a block holding a NaN
    or infinity (their finite-only amax and NaN codes stay with the operators)."""
    if not cpu_loops.serves(x) or x.size(-1) % block:  # (a shape error is raised by the operators)
        return None
    rows = x.reshape(-1, x.size(-1)).float().contiguous()
    codes = torch.empty(rows.shape, dtype=torch.uint8)
    values, scale = torch.empty_like(rows), rows.new_empty(rows.size(0), rows.size(1) // block)
    if not cpu_loops.fp4_quantize_rows(rows.numpy(), block, e4m3_scale, codes.numpy(), values.numpy(), scale.numpy()):
        return None
    return codes.view(x.shape), values.view(x.shape), scale.view(*x.shape[:-1], x.size(-1) // block)


def fp4_quant(x: torch.Tensor, block: int, e4m3_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 quantization: (packed E2M1 bytes [..., K/2], fp32 scales [..., K/block]).

    `e4m3_scale` selects the main-KV format (block 16, E4M3 scale); otherwise MXFP4 (block 32, E8M0).
    """
    by_loop = _fp4_by_loop(x, block, e4m3_scale)
    if by_loop is not None:
        return pack_nibbles(by_loop[0]), by_loop[2]
    scaled, scale = _fp4_scaled(x, block, e4m3_scale)
    return pack_nibbles(e2m1_encode(scaled).flatten(-2)), scale


def fp4_qdq(x: torch.Tensor, block: int, e4m3_scale: bool) -> torch.Tensor:
    by_loop = _fp4_by_loop(x, block, e4m3_scale)
    if by_loop is not None:  # (values of two E2M1 bits times a scale: exact in bf16 as in fp32)
        return by_loop[1].to(x.dtype)
    scaled, scale = _fp4_scaled(x.detach(), block, e4m3_scale)
    return straight_through(x, (e2m1_decode(e2m1_encode(scaled)) * scale.unsqueeze(-1)).flatten(-2).to(x.dtype))


def main_kv_qdq(x: torch.Tensor) -> torch.Tensor:
    """Main compressed KV: E2M1 with one E4M3 scale per 16 channels."""
    return fp4_qdq(x, 16, e4m3_scale=True)


def mxfp4_qdq(x: torch.Tensor) -> torch.Tensor:
    """Indexer queries and keys: E2M1 with one E8M0 scale per 32 channels."""
    return fp4_qdq(x, 32, e4m3_scale=False)


def block_scaled_matmul(
    a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, block: int = 32
) -> torch.Tensor:
    """sum over K blocks of (A_k W_k^T) * a_scale_k * w_scale_k, in fp32, blocks added in K order.

    a [M, K] and w [N, K] hold the quantized values as fp32; a_scale [M, K/block] and w_scale
    [N, K/block] are per row. Products of FP8/FP4 values are exact in fp32, so this reproduces the
    reference GEMM up to the summation order inside one block.
    """
    m, k = a.shape
    n, nk = w.size(0), k // block
    partials = _block_products(a.view(m, nk, block).transpose(0, 1), w.view(n, nk, block).permute(1, 2, 0))
    return _add_scaled_blocks(partials, a_scale.t(), w_scale.t())


BLOCK_K = cpu_loops.FP8_BLOCK  # the loop's block along K: the activations' and weights' scale block
# products of up to this many rows take the compiled loop: decode steps, their batches and verifications,
# short prompts' chunks (up to 64 rows it was faster than the GEMM at every shape measured, on 1 and 2 threads)
LOOP_ROWS = 64
LoopLayout = tuple[torch.Tensor, torch.Tensor]  # a weight as `cpu_loops.block_scaled_rows` reads it


def loop_layout(values: torch.Tensor, scale: torch.Tensor) -> LoopLayout:
    """A quantized weight's values [..., N, K] and per-row scales [..., N, K/32] as the compiled loop
    reads them: [..., K/32, 32, N] and [..., K/32, N], so that one K position of a block is a
    contiguous row over the outputs, which the loop runs along in vector registers."""
    *lead, n, k = values.shape
    blocks = values.reshape(*lead, n, k // BLOCK_K, BLOCK_K)
    return blocks.movedim(-3, -1).contiguous(), scale.transpose(-1, -2).contiguous()


def loop_serves(a: torch.Tensor, n: int) -> bool:
    """Whether the compiled loop computes the block-scaled product of rows a [..., M, K] with
    [N, K] weights: a few rows (at most LOOP_ROWS) on the CPU, outside stable numerics and autograd,
    at a shape where it gives this machine's GEMM bits (`_loop_keeps_bits`)."""
    return (a.size(-2) <= LOOP_ROWS and a.size(-1) % BLOCK_K == 0 and not numerics.is_stable()
            and not torch.is_grad_enabled() and cpu_loops.serves(a)
            and _loop_keeps_bits(a.size(-1), n, torch.get_num_threads()))


def block_scaled_rows(a: torch.Tensor, a_scale: torch.Tensor, layout: LoopLayout) -> torch.Tensor:
    """`block_scaled_matmul` of rows a [M, K] (scales [M, K/32]) by a weight in `loop_layout`, in one
    compiled loop instead of about thirty operator calls; the same bits where `loop_serves`."""
    out = a.new_empty(a.size(0), layout[0].size(-1))
    cpu_loops.block_scaled_rows(a.contiguous().numpy(), a_scale.contiguous().numpy(), layout[0].numpy(),
                                layout[1].numpy(), out.numpy())
    return out


def quantized_block_scaled_rows(x: torch.Tensor, layout: LoopLayout) -> torch.Tensor | None:
    """`block_scaled_rows` of x [..., K] through `layers.quantize_rows` -> [rows, N], in one compiled
    call (about 5 us a call less than quantizing and multiplying apart); None where x holds a NaN
    or infinity (the general quantizer then takes it). The same bits where `loop_serves`."""
    rows = x.reshape(-1, x.size(-1)).float().contiguous()
    out = rows.new_empty(rows.size(0), layout[0].size(-1))
    if cpu_loops.quantized_block_scaled_rows(rows.numpy(), layout[0].numpy(), layout[1].numpy(), out.numpy()):
        return out
    return None


def runs_block_scaled_rows(a: torch.Tensor, a_scale: torch.Tensor, layout: LoopLayout,
                           ends: torch.Tensor) -> torch.Tensor:
    """`block_scaled_rows` of rows a [R, K] (scales [R, K/32]) in runs, run e (rows ends[e-1] to
    ends[e]) by weight e of a stacked `loop_layout` ([E, ...]), read where it lies: the routed
    experts of a batched MoE step, their (token, expert) pairs sorted by expert, in one call."""
    out = a.new_empty(a.size(0), layout[0].size(-1))
    cpu_loops.runs_block_scaled_rows(a.contiguous().numpy(), a_scale.contiguous().numpy(), layout[0].numpy(),
                                     layout[1].numpy(), ends.long().contiguous().numpy(), out.numpy())
    return out


@functools.cache
def _loop_keeps_bits(k: int, n: int, threads: int) -> bool:
    """Whether the compiled loop gives the block-scaled GEMM's bits for [N, K] weights on this
    machine, at every row count it takes. Here MKL's fp32 kernels sum a 32-product block one fused
    multiply-add after another, which is what the loop does; but the BLAS picks its kernel by shape,
    layout and CPU, so random FP8 values at this shape decide it, once."""
    generator = torch.Generator().manual_seed(0)

    def fp8_rows(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = fp8_quant(torch.randn(*shape, generator=generator) * 4, BLOCK_K)
        return q.float(), scale.float()

    values, scale = fp8_rows(n, k)
    layout = loop_layout(values, scale)
    with torch.inference_mode():
        for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, LOOP_ROWS):
            a, a_scale = fp8_rows(rows, k)
            if not torch.equal(block_scaled_rows(a, a_scale, layout), block_scaled_matmul(a, a_scale, values, scale,
                                                                                           BLOCK_K)):
                return False
    return True


ALONE_ROWS = 4  # the fewest rows a block product is computed with (`_block_products`)


def _block_products(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [B, M, block] @ w [B, block, N], every row summed as it is alone: at the first place of a
    product of `ALONE_ROWS` rows, so that a row gets the same bits alone as in any batch. MKL's fp32
    kernels sum a short block in an order that depends on the row count when it is small: one row
    takes the matrix-vector kernel (on AVX-512/AMX another order than the matrix kernel), and on
    AVX2 one to three rows each sum another way than four or more. So fewer rows are padded with
    zero rows to `ALONE_ROWS`, and more rows run as one product only where a check on this shape
    shows they get those bits (`_many_rows_keep_bits`), else `ALONE_ROWS` at a time (a row's sums
    in a product depend on the product's shape, not on the other rows' values)."""
    a = a.contiguous()  # one layout for every row count: the kernel may depend on it
    if numerics.is_stable():
        return numerics.bmm(a, w)
    if a.size(1) > ALONE_ROWS and _many_rows_keep_bits(w):
        return numerics.bmm(a, w)
    return _in_products_of_alone_rows(a, w)


def _in_products_of_alone_rows(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a's rows in products of `ALONE_ROWS` rows, each row at a place that sums it as the first
    place does (`_places_as_alone`: every place on AVX2 and AVX-512; on MKL's SSE4.2 path only
    every other one), the other places zero."""
    places = _places_as_alone(w)
    batch, _, block = a.shape
    pieces = []
    for piece in a.split(len(places), dim=1):
        at = list(places[: piece.size(1)])
        if len(at) == ALONE_ROWS:
            pieces.append(numerics.bmm(piece, w))
        elif at == list(range(len(at))):  # the first places: the rows, then zero rows
            padded = torch.cat([piece, piece.new_zeros(batch, ALONE_ROWS - len(at), block)], 1)
            pieces.append(numerics.bmm(padded, w)[:, : len(at)])
        else:
            padded = piece.new_zeros(batch, ALONE_ROWS, block)
            padded[:, at] = piece
            pieces.append(numerics.bmm(padded, w)[:, at])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1)


def _once_per_layout(cache: dict, w: torch.Tensor, check):
    """`check(w, generator)` for w's shape, layout and the thread count, run once and kept in
    `cache`: the BLAS picks its kernel by shape and layout, not by value, so a check on random
    rows against w itself (which spares allocating a weight as large) holds for every call."""
    key = (tuple(w.shape), w.stride(), torch.get_num_threads())
    if key not in cache:
        cache[key] = check(w, torch.Generator().manual_seed(0))
    return cache[key]


_PLACES_AS_ALONE: dict[tuple, tuple[int, ...]] = {}


def _places_as_alone(w: torch.Tensor) -> tuple[int, ...]:
    """The places of a product of `ALONE_ROWS` rows by weights of w's shape and layout at which a
    row gets the bits it gets at the first (alone, padded with zero rows). MKL's SSE4.2 kernels sum
    the rows at odd places in another order."""
    def check(w: torch.Tensor, generator: torch.Generator) -> tuple[int, ...]:
        batch, block, _ = w.shape
        faithful = set(range(ALONE_ROWS))
        for _ in range(2):
            rows = torch.randn(batch, ALONE_ROWS, block, generator=generator, dtype=w.dtype)
            together = torch.bmm(rows, w)
            for i in range(1, ALONE_ROWS):
                first = torch.cat([rows[:, i : i + 1], rows.new_zeros(batch, ALONE_ROWS - 1, block)], 1)
                if not torch.equal(torch.bmm(first, w)[:, 0], together[:, i]):
                    faithful.discard(i)
        return tuple(sorted(faithful))

    return _once_per_layout(_PLACES_AS_ALONE, w, check)


_MANY_ROWS_KEEP_BITS: dict[tuple, bool] = {}


def _many_rows_keep_bits(w: torch.Tensor) -> bool:
    """Whether products of more than `ALONE_ROWS` rows with weights of w's shape and layout give
    every row the bits it gets in products of `ALONE_ROWS` rows, checked at several row counts."""
    def check(w: torch.Tensor, generator: torch.Generator) -> bool:
        batch, block, _ = w.shape
        rows = [torch.randn(batch, m, block, generator=generator, dtype=w.dtype) for m in (5, 8, 9, 17, 33)]
        return all(torch.equal(torch.bmm(a, w), _in_products_of_alone_rows(a, w)) for a in rows)

    return _once_per_layout(_MANY_ROWS_KEEP_BITS, w, check)


def _add_scaled_blocks(partials: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """partials [K/block, ..., M, N] (one block's products each), a_scale [K/block, ..., M], w_scale
    [K/block, ..., N]: every block's (partial * a_scale) * w_scale at once, then the blocks added in
    K order from +0 (a loop of in-place adds: a cumsum or sum would accumulate in another order or
    in double). On the CPU a compiled loop does it in one pass with the same roundings
    (`cpu_loops.add_scaled_blocks`)."""
    if partials.dim() == 3 and partials.dtype == torch.float32 and cpu_loops.serves(partials, a_scale, w_scale):
        return _add_scaled_blocks_by_loop(partials, a_scale, w_scale)
    return _add_scaled_blocks_by_operators(partials, a_scale, w_scale)


def _add_scaled_blocks_by_operators(partials: torch.Tensor, a_scale: torch.Tensor,
                                    w_scale: torch.Tensor) -> torch.Tensor:
    """`_add_scaled_blocks` by torch operators (partials overwritten)."""
    scaled = partials.mul_(a_scale.unsqueeze(-1)).mul_(w_scale.unsqueeze(-2))
    first, *rest = scaled.unbind(0)
    acc = first + numerics.scalar(0.0)  # +0 + first, as a sum from +0 starts (x + 0 == 0 + x, -0 included)
    for part in rest:
        acc.add_(part)
    return acc


def _add_scaled_blocks_by_loop(partials: torch.Tensor, a_scale: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """`_add_scaled_blocks` of partials [B, M, N] by `cpu_loops.add_scaled_blocks` (the same bits),
    on the calling thread: split over two threads it was slower at every shape of a `mini` prompt
    chunk (the loop is as fast as the memory; the operators take two threads and three passes)."""
    out = partials.new_empty(partials.size(1), partials.size(2))
    cpu_loops.add_scaled_blocks(partials.contiguous().numpy(), a_scale.float().contiguous().numpy(),
                                w_scale.float().contiguous().numpy(), out.numpy())
    return out


def quantize_weight_fp8(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense weight [out, in] -> (E4M3 [out, in], E8M0 scale per block x block tile), the
    checkpoint format of the release's FP8 linears."""
    n_out, n_in = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -n_in % block, 0, -n_out % block))
    tiles = padded.unflatten(0, (-1, block)).unflatten(2, (-1, block))  # [ro, block, ci, block]
    amax = _finite_amax(tiles, (1, 3)).clamp_min(1e-4)
    scale = pow2_scale_up(amax, FP8_MAX)
    q = to_e4m3(tiles / scale[:, None, :, None]).flatten(2).flatten(0, 1)[:n_out, :n_in]
    return q.contiguous(), e8m0_encode(scale).view(torch.float8_e8m0fnu)


def quantize_weight_fp4(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert weight [out, in] -> (packed E2M1 as int8 [out, in/2], E8M0 scale [out, in/block])."""
    packed, scale = fp4_quant(w, block, e4m3_scale=False)
    return packed.view(torch.int8), e8m0_encode(scale).view(torch.float8_e8m0fnu)
