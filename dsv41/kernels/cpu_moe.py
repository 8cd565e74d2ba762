"""Compiled loops (numba) for the MoE of a decode step's tokens on the CPU: their routed experts and
their shared expert in two calls, with the bits of `MoE._routed_per_expert` (or `_routed_grouped`)
and `Expert.forward`.

An expert of one token runs about twenty small operators (the side-by-side gate and up products,
the clamps, the SiLU and its products, the conversions, the down product's quantization and
product, the sum into the output): about 80 µs on `mini`, three experts a layer. Here one loop
does every expert's gate and up products and clamps, torch computes the SiLU (whose bits only it
gives), and a second loop does the rest, each float32 operation as the operators do it, in the
same order: the block-scaled products by `cpu_loops.block_scaled_rows` (which its callers check
against the GEMM once per shape, `quant.loop_serves`), every rounding to bf16 where the operators
convert, the experts added into the output in the order the operators add them.
"""

from __future__ import annotations

import numba
import numpy as np

from dsv41.kernels.cpu_loops import block_scaled_rows, fp8_quantize_rows, round_to_bf16


@numba.njit(cache=True, nogil=True)
def experts_gate_up(q: np.ndarray, q_scale: np.ndarray, w_t: np.ndarray, w_scale_t: np.ndarray,
                    shared_w_t: np.ndarray, shared_w_scale_t: np.ndarray, tokens: np.ndarray, experts: np.ndarray,
                    limit: float, gate: np.ndarray, up: np.ndarray) -> None:
    """Each (token, expert) pair's gate (w1) and up (w3) outputs, as `Expert.activate` clamps them.

    q [R, K] and q_scale [R, K/32]: the tokens through `quantize_rows`; w_t [E, K/32, 32, 2I] and
    w_scale_t [E, K/32, 2I]: the routed experts' w1 and w3 side by side in the loop's layout
    (`quant.loop_layout`), shared_w_t [K/32, 32, 2I] and shared_w_scale_t the shared expert's;
    tokens [P] and experts [P]: each pair's token and routed expert (-1: the shared one). Row i of
    gate and up [P, I] (float32) gets the pair's products rounded to bf16 (a linear's output), then,
    with a limit above 0, up clamped to [-limit, limit] and gate to at most limit (a NaN stays)."""
    inter = gate.shape[1]
    both = np.empty((1, 2 * inter), np.float32)
    bound = np.float32(limit)
    for i in range(experts.shape[0]):
        t, e = tokens[i], experts[i]
        if e < 0:
            block_scaled_rows(q[t : t + 1], q_scale[t : t + 1], shared_w_t, shared_w_scale_t, both)
        else:
            block_scaled_rows(q[t : t + 1], q_scale[t : t + 1], w_t[e], w_scale_t[e], both)
        round_to_bf16(both[0])
        for j in range(inter):
            g, u = both[0, j], both[0, inter + j]
            if limit > 0:
                if u < -bound:
                    u = -bound
                elif u > bound:
                    u = bound
                if g > bound:
                    g = bound
            gate[i, j] = g
            up[i, j] = u


@numba.njit(cache=True, nogil=True)
def experts_down(silu: np.ndarray, up: np.ndarray, weights: np.ndarray, w_t: np.ndarray, w_scale_t: np.ndarray,
                 shared_w_t: np.ndarray, shared_w_scale_t: np.ndarray, tokens: np.ndarray, experts: np.ndarray,
                 y: np.ndarray) -> bool:
    """Each (token, expert) pair's output, added into its token's row of y [R, D] (float32) in pair
    order (a token's routed experts by increasing id, then its shared expert).

    silu and up [P, I]: torch's SiLU of `experts_gate_up`' gate, and its up; weights [P]: each
    pair's routing weight (1 for the shared expert, whose product it leaves as it is); w_t
    [E, I/32, 32, D] and w_scale_t: the routed experts' w2 in the loop's layout, shared_w_t the
    shared expert's; tokens and experts as for `experts_gate_up`. A pair's hidden activation is
    silu x up, times its weight, rounded to bf16; it is quantized (`quantize_rows`) and multiplied
    by w2, the product rounded to bf16 and added into y. False (y unfinished) where a hidden
    activation holds a NaN or infinity: the general quantizer takes those."""
    n, inter = silu.shape
    hidden = np.empty((1, inter), np.float32)
    values = np.empty((1, inter), np.float32)
    scales = np.empty((1, inter // 32), np.float32)
    out = np.empty((1, y.shape[1]), np.float32)
    for i in range(n):
        weight = weights[i]
        for j in range(inter):
            hidden[0, j] = weight * (silu[i, j] * up[i, j])
        round_to_bf16(hidden[0])
        if not fp8_quantize_rows(hidden, values, scales):
            return False
        e = experts[i]
        if e < 0:
            block_scaled_rows(values, scales, shared_w_t, shared_w_scale_t, out)
        else:
            block_scaled_rows(values, scales, w_t[e], w_scale_t[e], out)
        round_to_bf16(out[0])
        row = y[tokens[i]]
        for j in range(y.shape[1]):
            row[j] = row[j] + out[0, j]
    return True
