"""Triton kernels over the packed cache formats. Each has a torch twin of the same signature in
`torch_ops.py`; `dispatch.py` picks one per device. Every number-format conversion here is done
with integer bit operations, so encodes are bit-exact on any backend (including the CPU
interpreter, whose float8 casts do not round ties to even).

Kernels: quantize + pack rows; decode sparse attention gathering Top-k main-KV entries and the SWA
ring straight from packed bytes; indexer scoring over packed keys (all entries or a candidate
pool); the single-pass mHC update (residual update, input collapse, next coefficients, Sinkhorn).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from dsv41.kernels.layouts import EntryFormat


def _bf16_dots() -> bool:
    """bf16 tensor-core dots on a GPU; the CPU interpreter mishandles bf16 dots, so there the same
    products (exact in fp32) go through an IEEE fp32 dot."""
    return os.environ.get("TRITON_INTERPRET") != "1"


@triton.jit
def _dot(a, b, BF16: tl.constexpr):
    """a @ b with exact products of bf16 values and fp32 accumulation."""
    if BF16:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
    return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def _round_bf16(x):
    """fp32 -> the nearest bf16 value (ties to even), still as fp32. Done on the bits because a
    plain cast truncates in the CPU interpreter."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_encode(x):
    """fp32 -> E4M3 code (int32), saturating at ±448 (±inf too), round-to-nearest-even; NaN -> 0x7F
    with its sign, as the torch codec (checked explicitly: min/max of a NaN differ by backend)."""
    sign = (x.to(tl.int32, bitcast=True) >> 31) & 1
    a = tl.minimum(tl.abs(x), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    mantissa = bits & 0x7FFFFF
    keep = mantissa >> 20
    rest = mantissa & 0xFFFFF
    keep = keep + ((rest > 0x80000) | ((rest == 0x80000) & ((keep & 1) == 1))).to(tl.int32)
    normal = ((exponent + 7) << 3) + keep  # a carry out of the mantissa bumps the exponent
    q = a * 512.0  # subnormals: multiples of 2^-9
    whole = tl.floor(q)
    frac = q - whole
    sub = whole.to(tl.int32) + ((frac > 0.5) | ((frac == 0.5) & ((whole.to(tl.int32) & 1) == 1))).to(tl.int32)
    code = tl.where(exponent < -6, sub, normal)
    return tl.where(x != x, 0x7F, code) | (sign << 7)


@triton.jit
def _e4m3_decode(code):
    code = code.to(tl.int32)
    exponent = (code >> 3) & 0xF
    mantissa = (code & 7).to(tl.float32)
    value = tl.where(exponent == 0, mantissa * 0.001953125, (8.0 + mantissa) * tl.exp2(exponent.to(tl.float32) - 10.0))
    return tl.where((code & 0x80) != 0, -value, value)


@triton.jit
def _e2m1_encode(v):
    """fp32 -> 4-bit code (int32); ties go to the even code, beyond ±6 (±inf too) saturates, NaN
    -> 0x8 as the torch codec (E2M1 has no NaN)."""
    a = tl.abs(v)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    sign = (v.to(tl.int32, bitcast=True) >> 31) & 1
    return tl.where(v != v, 8, code | (sign << 3))


@triton.jit
def _e2m1_decode(code):
    code = code.to(tl.int32)
    e = (code >> 1) & 3
    f = (code & 1).to(tl.float32)
    value = tl.where(e == 0, f * 0.5, (2.0 + f) * tl.exp2(e.to(tl.float32) - 2.0))
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _e8m0_decode(code):
    """2^(code - 127); code 0 is 2^-127 (an fp32 subnormal, not a shifted 0), 0xFF NaN."""
    code = code.to(tl.int32)
    bits = tl.where(code == 0, 0x400000, code << 23)
    return tl.where(code == 0xFF, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _pow2_scale_up(amax, inv_max):
    """(2^ceil(log2(amax * inv_max)), its E8M0 code) for a finite amax >= 0, clamped to codes
    0..254 like the torch codec: a subnormal ratio rounds up to 2^-127 or 2^-126 by its value."""
    bits = (amax * inv_max).to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    bump = tl.where(exponent == 0, mantissa > 0x400000, mantissa != 0).to(tl.int32)
    code = tl.minimum(exponent + bump, 254)
    return _e8m0_decode(code), code


@triton.jit
def _pack_rows_kernel(x_ptr, out_ptr, DIM: tl.constexpr, BLOCK: tl.constexpr, FP4: tl.constexpr,
                      E4M3_SCALE: tl.constexpr, CODE_BYTES: tl.constexpr, ENTRY: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x = tl.load(x_ptr + row * DIM + tl.arange(0, DIM)).to(tl.float32)
    groups = tl.reshape(x, (DIM // BLOCK, BLOCK))
    magnitude = tl.abs(groups)
    amax = tl.max(tl.where(magnitude < float("inf"), magnitude, 0.0), axis=1)  # NaN/inf: not the scale
    out = out_ptr + row * ENTRY
    if FP4:
        if E4M3_SCALE:
            scale_code = _e4m3_encode(tl.maximum(amax, 6 * 2.0**-9) / 6.0)
            scale = _e4m3_decode(scale_code)
        else:
            scale, scale_code = _pow2_scale_up(tl.maximum(amax, 6 * 2.0**-126), 1.0 / 6.0)
        codes = tl.reshape(_e2m1_encode(groups / scale[:, None]), (DIM // 2, 2))  # the encode saturates
        low, high = tl.split(codes)
        tl.store(out + tl.arange(0, DIM // 2), (low | (high << 4)).to(tl.uint8))
    else:
        scale, scale_code = _pow2_scale_up(tl.maximum(amax, 1e-4), 1.0 / 448.0)
        # a NaN element is passed on itself: a GPU division may return a NaN without its sign
        codes = _e4m3_encode(tl.where(groups != groups, groups, groups / scale[:, None]))
        tl.store(out + tl.arange(0, DIM), tl.reshape(codes, (DIM,)).to(tl.uint8))
    tl.store(out + CODE_BYTES + tl.arange(0, DIM // BLOCK), scale_code.to(tl.uint8))


def pack_rows(x: torch.Tensor, fmt: EntryFormat) -> torch.Tensor:
    rows = x.reshape(-1, fmt.dim).contiguous()
    out = torch.empty(rows.size(0), fmt.entry_bytes, dtype=torch.uint8, device=x.device)
    if rows.size(0):
        _pack_rows_kernel[(rows.size(0),)](rows, out, fmt.dim, fmt.block, fmt.fp4, fmt.e4m3_scale,
                                           fmt.code_bytes, fmt.entry_bytes)
    return out.view(*x.shape[:-1], fmt.entry_bytes)


@triton.jit
def _load_main_kv(ptr, rows, valid, D: tl.constexpr):
    """Packed main-KV entries [N] -> bf16-rounded values [N, D] (E2M1 codes, E4M3 scale per 16)."""
    base = ptr + rows[:, None] * (D // 2 + D // 16)
    packed = tl.load(base + tl.arange(0, D // 2)[None, :], mask=valid[:, None], other=0).to(tl.int32)
    values = tl.reshape(tl.join(_e2m1_decode(packed & 15), _e2m1_decode(packed >> 4)), (rows.shape[0], D))
    scales = _e4m3_decode(tl.load(base + D // 2 + tl.arange(0, D // 16)[None, :], mask=valid[:, None], other=0))
    scaled = tl.reshape(values, (rows.shape[0], D // 16, 16)) * scales[:, :, None]
    return tl.reshape(scaled, (rows.shape[0], D)).to(tl.bfloat16)


@triton.jit
def _load_swa(ptr, rows, valid, D: tl.constexpr):
    """Packed SWA entries [N] -> bf16 values [N, D] (E4M3 values, E8M0 scale per 32)."""
    base = ptr + rows[:, None] * (D + D // 32)
    values = _e4m3_decode(tl.load(base + tl.arange(0, D)[None, :], mask=valid[:, None], other=0))
    scales = _e8m0_decode(tl.load(base + D + tl.arange(0, D // 32)[None, :], mask=valid[:, None], other=127))
    scaled = tl.reshape(values, (rows.shape[0], D // 32, 32)) * scales[:, :, None]
    return tl.reshape(scaled, (rows.shape[0], D)).to(tl.bfloat16)


@triton.jit
def _softmax_step(q, k, valid, scale, running_max, denom, acc, BF16: tl.constexpr):
    """One online-softmax step over a chunk of keys; probabilities are rounded to bf16 before P·V."""
    logits = _dot(q, tl.trans(k), BF16)
    logits = tl.where(valid[None, :], logits, float("-inf")) * scale
    new_max = tl.maximum(running_max, tl.max(logits, axis=1))
    rescale = tl.exp(running_max - new_max)
    probs = tl.exp(logits - new_max[:, None])
    denom = denom * rescale + tl.sum(probs, axis=1)
    acc = acc * rescale[:, None] + _dot(_round_bf16(probs), k, BF16)
    return new_max, denom, acc


@triton.jit
def _sparse_attention_decode_kernel(q_ptr, ring_ptr, slots_ptr, main_ptr, topk_ptr, sink_ptr, out_ptr, scale,
                                    W, K, MAIN_STRIDE, H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr,
                                    BLOCK_N: tl.constexpr, BF16: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, H_PAD)
    q = tl.load(q_ptr + b * H * D + heads[:, None] * D + tl.arange(0, D)[None, :], mask=heads[:, None] < H, other=0.0)
    running_max = tl.full((H_PAD,), -1e30, tl.float32)
    denom = tl.zeros((H_PAD,), tl.float32)
    acc = tl.zeros((H_PAD, D), tl.float32)
    for start in range(0, W, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        slot = tl.load(slots_ptr + b * W + j, mask=j < W, other=-1)
        valid = slot >= 0
        k = _load_swa(ring_ptr + b * W * (D + D // 32), tl.maximum(slot, 0).to(tl.int64), valid, D)
        running_max, denom, acc = _softmax_step(q, k, valid, scale, running_max, denom, acc, BF16)
    for start in range(0, K, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        entry = tl.load(topk_ptr + b * K + j, mask=j < K, other=-1)
        valid = entry >= 0
        k = _load_main_kv(main_ptr + b * MAIN_STRIDE, tl.maximum(entry, 0).to(tl.int64), valid, D)
        running_max, denom, acc = _softmax_step(q, k, valid, scale, running_max, denom, acc, BF16)
    sink = tl.load(sink_ptr + heads, mask=heads < H, other=0.0)
    denom = denom + tl.exp(sink - running_max)
    out = _round_bf16(acc / denom[:, None]).to(tl.bfloat16)
    tl.store(out_ptr + b * H * D + heads[:, None] * D + tl.arange(0, D)[None, :], out, mask=heads[:, None] < H)


def sparse_attention_decode(q, ring, slots, main, topk, sink, scale: float, block_n: int = 64) -> torch.Tensor:
    """q [b, h, d] bf16; ring [b, W, swa bytes] with slots [b, W] (-1 unused); main [b, n, main bytes]
    with topk [b, k] entry ids (-1 unused); sink [h] fp32 -> out [b, h, d] bf16. A main expanded over
    the batch (stride 0: every sequence's pages in one shared pool) is read in place, not copied."""
    b, h, d = q.shape
    out = torch.empty_like(q)
    if main.stride(0) != 0 or not main[0].is_contiguous():
        main = main.contiguous()
    _sparse_attention_decode_kernel[(b,)](
        q.contiguous(), ring.contiguous(), slots.int().contiguous(), main, topk.int().contiguous(),
        sink.float().contiguous(), out, scale, ring.size(1), topk.size(1), main.stride(0),
        h, max(16, triton.next_power_of_2(h)), d, block_n, _bf16_dots())
    return out


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, keys_ptr, ids_ptr, out_ptr, N, N_KEYS, HI: tl.constexpr,
                         HI_PAD: tl.constexpr, DI: tl.constexpr, BLOCK_N: tl.constexpr, POOL: tl.constexpr,
                         BF16: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    heads = tl.arange(0, HI_PAD)
    q = tl.load(q_ptr + b * HI * DI + heads[:, None] * DI + tl.arange(0, DI)[None, :], mask=heads[:, None] < HI,
                other=0.0)
    w = tl.load(w_ptr + b * HI + heads, mask=heads < HI, other=0.0).to(tl.float32)
    in_range = j < N
    entry = tl.load(ids_ptr + b * N + j, mask=in_range, other=0) if POOL else j
    base = keys_ptr + b * N_KEYS * (DI // 2 + DI // 32) + entry.to(tl.int64)[:, None] * (DI // 2 + DI // 32)
    packed = tl.load(base + tl.arange(0, DI // 2)[None, :], mask=in_range[:, None], other=0).to(tl.int32)
    values = tl.reshape(tl.join(_e2m1_decode(packed & 15), _e2m1_decode(packed >> 4)), (BLOCK_N, DI))
    scales = _e8m0_decode(tl.load(base + DI // 2 + tl.arange(0, DI // 32)[None, :], mask=in_range[:, None], other=127))
    keys = tl.reshape(tl.reshape(values, (BLOCK_N, DI // 32, 32)) * scales[:, :, None], (BLOCK_N, DI)).to(tl.bfloat16)
    dots = _round_bf16(_dot(q, tl.trans(keys), BF16))
    weighted = _round_bf16(tl.maximum(dots, 0.0) * w[:, None])
    score = _round_bf16(tl.sum(weighted, axis=0)).to(tl.bfloat16)
    tl.store(out_ptr + b * N + j, score, mask=in_range)


def index_scores(q, weights, keys, entry_ids=None, block_n: int = 16) -> torch.Tensor:
    """q [b, hi, di] bf16 (MXFP4 values), weights [b, hi] bf16, keys [b, n_keys, 68-byte entries];
    scores bf16 [b, n] for entries 0..n_keys-1, or for entry_ids [b, n] (a candidate pool)."""
    b, hi, di = q.shape
    n = keys.size(1) if entry_ids is None else entry_ids.size(1)
    out = torch.empty(b, n, dtype=torch.bfloat16, device=q.device)
    ids = entry_ids.int().contiguous() if entry_ids is not None else out  # unused without a pool
    if n:
        grid = (b, triton.cdiv(n, block_n))
        _index_scores_kernel[grid](q.contiguous(), weights.contiguous(), keys.contiguous(), ids, out, n, keys.size(1),
                                   hi, max(16, triton.next_power_of_2(hi)), di, block_n, entry_ids is not None,
                                   _bf16_dots())
    return out


@triton.jit
def _mix_rows(fn_ptr, first: tl.constexpr, n: tl.constexpr, D: tl.constexpr, HC: tl.constexpr, stream, cols, y):
    """Partial dot products of fn rows first..first+n-1 with one stream chunk y [CH] -> [n]."""
    rows = first + tl.arange(0, n)
    w = tl.load(fn_ptr + rows[:, None] * (HC * D) + stream * D + cols[None, :])
    return tl.sum(w * y[None, :], axis=1)


@triton.jit
def _mhc_update_kernel(x_ptr, f_ptr, post_ptr, comb_ptr, mix_ptr, fn_ptr, scale_ptr, base_ptr, y_ptr, collapsed_ptr,
                       pre_out, post_out, comb_out, hc_eps, norm_eps, iters, D: tl.constexpr, CH: tl.constexpr):
    """One token: y = post*f + comb^T x (4 streams), collapsed = sum_i mix_i y_i, and the next
    sub-layer's (pre, post, comb) from y, Sinkhorn included; one pass over the streams."""
    HC: tl.constexpr = 4
    t = tl.program_id(0).to(tl.int64)
    streams = tl.arange(0, HC)
    post = tl.load(post_ptr + t * HC + streams)
    comb = tl.load(comb_ptr + t * HC * HC + streams[:, None] * HC + streams[None, :])  # [i, j]
    mix = tl.load(mix_ptr + t * HC + streams)
    square_sum = tl.zeros((1,), tl.float32)
    acc_pre = tl.zeros((HC,), tl.float32)
    acc_post = tl.zeros((HC,), tl.float32)
    acc_comb = tl.zeros((HC * HC,), tl.float32)
    for c in range(0, D, CH):
        cols = c + tl.arange(0, CH)
        x = tl.load(x_ptr + t * HC * D + streams[:, None] * D + cols[None, :]).to(tl.float32)
        f = tl.load(f_ptr + t * D + cols).to(tl.float32)
        mixed = tl.sum(comb[:, :, None] * x[:, None, :], axis=0)
        y = _round_bf16(post[:, None] * f[None, :] + mixed)
        tl.store(y_ptr + t * HC * D + streams[:, None] * D + cols[None, :], y.to(tl.bfloat16))
        collapsed = _round_bf16(tl.sum(mix[:, None] * y, axis=0))
        tl.store(collapsed_ptr + t * D + cols, collapsed.to(tl.bfloat16))
        square_sum += tl.sum(tl.sum(y * y, axis=1), axis=0)
        for i in tl.static_range(HC):
            yi = tl.sum(tl.where(streams[:, None] == i, y, 0.0), axis=0)
            acc_pre += _mix_rows(fn_ptr, 0, HC, D, HC, i, cols, yi)
            acc_post += _mix_rows(fn_ptr, HC, HC, D, HC, i, cols, yi)
            acc_comb += _mix_rows(fn_ptr, 2 * HC, HC * HC, D, HC, i, cols, yi)
    rsqrt = 1.0 / tl.sqrt(square_sum / (HC * D) + norm_eps)
    s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    pre = tl.sigmoid(acc_pre * rsqrt * s0 + tl.load(base_ptr + streams)) + hc_eps
    post_next = 2 * tl.sigmoid(acc_post * rsqrt * s1 + tl.load(base_ptr + HC + streams))
    logits = tl.reshape(acc_comb * rsqrt * s2 + tl.load(base_ptr + 2 * HC + tl.arange(0, HC * HC)), (HC, HC))
    comb_next = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    comb_next = comb_next / tl.sum(comb_next, axis=1)[:, None] + hc_eps
    comb_next = comb_next / (tl.sum(comb_next, axis=0)[None, :] + hc_eps)
    for _ in range(iters - 1):
        comb_next = comb_next / (tl.sum(comb_next, axis=1)[:, None] + hc_eps)
        comb_next = comb_next / (tl.sum(comb_next, axis=0)[None, :] + hc_eps)
    tl.store(pre_out + t * HC + streams, pre)
    tl.store(post_out + t * HC + streams, post_next)
    tl.store(comb_out + t * HC * HC + streams[:, None] * HC + streams[None, :], comb_next)


def mhc_update(x, f, post, comb, mix, fn, scale, base, iters: int, hc_eps: float, norm_eps: float,
               rows: list[int] | None = None):
    """x [..., 4, d] bf16 stream, f [..., d] bf16 sub-layer output, post [..., 4], comb [..., 4, 4],
    mix [..., 4]; fn/scale/base: the next sub-layer's predictor (`rows` is not needed: every token is
    its own program). Returns (new stream, its collapse by mix, pre, post, comb of the next sub-layer)."""
    *lead, hc, d = x.shape
    if hc != 4:
        raise ValueError(f"the fused mHC kernel handles 4 streams, got {hc}")
    tokens = x.numel() // (hc * d)
    y = torch.empty_like(x)
    collapsed = torch.empty(*lead, d, dtype=x.dtype, device=x.device)
    pre_n = torch.empty(*lead, hc, dtype=torch.float32, device=x.device)
    post_n = torch.empty(*lead, hc, dtype=torch.float32, device=x.device)
    comb_n = torch.empty(*lead, hc, hc, dtype=torch.float32, device=x.device)
    chunk = min(d, 64)
    if d % chunk:
        raise ValueError(f"hidden size {d} must be a multiple of {chunk}")
    _mhc_update_kernel[(tokens,)](
        x.contiguous(), f.contiguous(), post.float().contiguous(), comb.float().contiguous(), mix.float().contiguous(),
        fn.float().contiguous(), scale.float().contiguous(), base.float().contiguous(), y, collapsed, pre_n, post_n,
        comb_n, hc_eps, norm_eps, iters, d, chunk)
    return y, collapsed, pre_n, post_n, comb_n
