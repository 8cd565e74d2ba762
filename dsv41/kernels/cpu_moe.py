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
def _runs_by_expert(experts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The pairs ordered by expert (the shared one, -1, first), each expert's in pair order, and
    where each expert's run of that order ends: an expert's weight is then read once for all of
    its rows (at a prompt chunk's 48 tokens the per-pair order read every weight 16 times over)."""
    order = np.argsort(experts, kind="mergesort")
    ends = np.empty(order.shape[0], np.int64)
    runs = 0
    for i in range(order.shape[0]):
        if i == order.shape[0] - 1 or experts[order[i + 1]] != experts[order[i]]:
            ends[runs] = i + 1
            runs += 1
    return order, ends[:runs]


@numba.njit(cache=True, nogil=True)
def _run_products(rows: np.ndarray, row_scales: np.ndarray, expert: int, w_t: np.ndarray, w_scale_t: np.ndarray,
                  shared_w_t: np.ndarray, shared_w_scale_t: np.ndarray, out: np.ndarray) -> None:
    """`block_scaled_rows` of one expert's rows (-1: the shared expert), each rounded to bf16."""
    if expert < 0:
        block_scaled_rows(rows, row_scales, shared_w_t, shared_w_scale_t, out)
    else:
        block_scaled_rows(rows, row_scales, w_t[expert], w_scale_t[expert], out)
    for r in range(out.shape[0]):
        round_to_bf16(out[r])


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
    with a limit above 0, up clamped to [-limit, limit] and gate to at most limit (a NaN stays).
    Each expert multiplies its pairs' rows together; a row's products do not depend on the rows
    beside it, so every pair gets the bits it gets alone."""
    inter = gate.shape[1]
    order, ends = _runs_by_expert(experts)
    rows = np.empty((order.shape[0], q.shape[1]), np.float32)
    row_scales = np.empty((order.shape[0], q_scale.shape[1]), np.float32)
    for i in range(order.shape[0]):
        rows[i] = q[tokens[order[i]]]
        row_scales[i] = q_scale[tokens[order[i]]]
    both = np.empty((order.shape[0], 2 * inter), np.float32)
    bound = np.float32(limit)
    start = 0
    for end in ends:
        _run_products(rows[start:end], row_scales[start:end], experts[order[start]], w_t, w_scale_t,
                      shared_w_t, shared_w_scale_t, both[start:end])
        start = end
    for r in range(order.shape[0]):
        i = order[r]
        for j in range(inter):
            g, u = both[r, j], both[r, inter + j]
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
    by w2 (each expert's pairs together, as in `experts_gate_up`), the product rounded to bf16 and
    added into y. False (y unfinished) where a hidden activation holds a NaN or infinity: the
    general quantizer takes those."""
    n, inter = silu.shape
    order, ends = _runs_by_expert(experts)
    hidden = np.empty((n, inter), np.float32)
    for r in range(n):
        i, weight = order[r], weights[order[r]]
        for j in range(inter):
            hidden[r, j] = weight * (silu[i, j] * up[i, j])
        round_to_bf16(hidden[r])
    values = np.empty((n, inter), np.float32)
    scales = np.empty((n, inter // 32), np.float32)
    if not fp8_quantize_rows(hidden, values, scales):
        return False
    out = np.empty((n, y.shape[1]), np.float32)
    start = 0
    for end in ends:
        _run_products(values[start:end], scales[start:end], experts[order[start]], w_t, w_scale_t,
                      shared_w_t, shared_w_scale_t, out[start:end])
        start = end
    place = np.empty(n, np.int64)  # where each pair's output sits in the order by expert
    for r in range(n):
        place[order[r]] = r
    for i in range(n):
        row, product = y[tokens[i]], out[place[i]]
        for j in range(y.shape[1]):
            row[j] = row[j] + product[j]
    return True
