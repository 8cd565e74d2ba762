"""Compiled loops (numba) for the online softmax of one decode token's sparse attention on the
CPU, with the bits of `torch_ops._chunks_at_once`.

A decode token attends over its SWA ring slots and its Top-k entries, in chunks of 64 keys. The
operator version takes about sixty small operators for the softmax's bookkeeping around its
GEMMs (masking, maxima, running maxima, rescaling chunk after chunk, the final division): about
0.6 ms a layer on `mini`, a quarter of a 4K decode step. Here torch keeps what only it computes
with its bits (the GEMMs, the exponentials, each chunk's probability sum) and three loops do the
rest (`decode_logits` before the exponentials, `split_probabilities` and `decode_outputs` after
them), each float32 operation as the operators do it, in the same order (no fused multiply-add:
numba without `fastmath` neither contracts nor reorders).

The loops take a sequence's chunks in two parts, its ring slots (W of them, whole chunks) and its
entries (K, whole chunks), each part's products computed by torch on keys as they lie.
"""

from __future__ import annotations

import numba
import numpy as np

from dsv41.kernels.cpu_loops import round_to_bf16

CHUNK = 64  # keys per online-softmax step (torch_ops.ATTENTION_CHUNK)


@numba.njit(cache=True, nogil=True)
def decode_logits(window_dots: np.ndarray, entry_dots: np.ndarray, slots: np.ndarray, topk: np.ndarray,
                  scale: float, prob_args: np.ndarray, rescale_args: np.ndarray, last_running: np.ndarray) -> bool:
    """The online softmax's inputs to exp, from the chunks' dot products.

    window_dots [n, W/64, h, 64] and entry_dots [n, K/64, h, 64] (torch's GEMMs); slots [n, W] and
    topk [n, K], -1 where unused (masked). Writes each chunk's logits (dot x scale) minus the
    running maximum after it into prob_args [chunks, n * h * 64 (+ gap)], (the running maximum
    before the chunk - after it) into rescale_args [chunks, n * h (+ gap)], the last running
    maximum into last_running [n, h]; a running maximum starts at -1e30. False (outputs
    unfinished) where a used logit is not finite: the operators then take the call, NaN and all."""
    n, window_chunks, heads, _ = window_dots.shape
    chunks = window_chunks + entry_dots.shape[1]
    scale32 = np.float32(scale)
    floor = np.float32(-1e30)
    minus_inf = np.float32(-np.inf)
    logits = np.empty(CHUNK, np.float32)
    for s in range(n):
        for h in range(heads):
            row = s * heads + h
            running = floor
            for c in range(chunks):
                if c < window_chunks:
                    dots, used = window_dots[s, c, h], slots[s, c * CHUNK : (c + 1) * CHUNK]
                else:
                    e = c - window_chunks
                    dots, used = entry_dots[s, e, h], topk[s, e * CHUNK : (e + 1) * CHUNK]
                top = minus_inf
                for j in range(CHUNK):
                    if used[j] >= 0:
                        value = dots[j] * scale32
                        if not np.isfinite(value):
                            return False
                        logits[j] = value
                        top = max(top, value)
                    else:
                        logits[j] = minus_inf
                before = running
                running = max(running, max(top, floor))
                rescale_args[c, row] = before - running
                base = row * CHUNK
                for j in range(CHUNK):
                    prob_args[c, base + j] = logits[j] - running
            last_running[s, h] = running
    return True


@numba.njit(cache=True, nogil=True)
def split_probabilities(probs: np.ndarray, window_probs: np.ndarray, entry_probs: np.ndarray) -> None:
    """probs [chunks, n, h, 64] rounded to bf16 values (what the P.V GEMMs multiply) and laid out
    per sequence for them: window_probs [n, W/64, h, 64], entry_probs [n, K/64, h, 64]."""
    window_chunks = window_probs.shape[1]
    for c in range(probs.shape[0]):
        for s in range(probs.shape[1]):
            for h in range(probs.shape[2]):
                target = window_probs[s, c, h] if c < window_chunks else entry_probs[s, c - window_chunks, h]
                target[:] = probs[c, s, h]
                round_to_bf16(target)


@numba.njit(cache=True, nogil=True)
def decode_outputs(window_pv: np.ndarray, entry_pv: np.ndarray, rescale: np.ndarray, sums: np.ndarray,
                   sink_term: np.ndarray, topk: np.ndarray, cut: bool, out: np.ndarray) -> bool:
    """The online softmax's output: window_pv [n, W/64, h, d] and entry_pv [n, K/64, h, d] (each
    chunk's P.V GEMM), rescale [chunks, n, h] and sums [chunks, n, h] (torch's exp and sums),
    sink_term [n, h] (exp(sink - last running maximum)). From zeros, chunk after chunk: output =
    output x rescale + P.V, denominator = denominator x rescale + sum (each a multiply, then an
    add); then the sink term added to the denominator, and out [n, h, d] float32 gets output /
    denominator rounded to bf16.

    False (out unfinished) where a sequence with unused entry slots (topk [n, K], -1, or every
    sequence where `cut`: the table was cut from a wider one, whose cut slots were unused) has an
    output before the division that is zero or not finite. Only there can such a slot change a bit: the
    operators' gather reads the ring's first row for it, the entry GEMM here the entry table's
    row, both times a probability of 0; a finite row adds a zero of either sign, which leaves every
    nonzero sum as it is."""
    n, window_chunks, heads, dim = window_pv.shape
    chunks = rescale.shape[0]
    acc = np.empty(dim, np.float32)
    for s in range(n):
        unused = cut
        for j in range(topk.shape[1]):
            unused |= topk[s, j] < 0
        for h in range(heads):
            denom = np.float32(0.0)
            acc[:] = 0.0
            for c in range(chunks):
                pv = window_pv[s, c, h] if c < window_chunks else entry_pv[s, c - window_chunks, h]
                factor = rescale[c, s, h]
                denom = denom * factor + sums[c, s, h]
                for i in range(dim):
                    acc[i] = acc[i] * factor + pv[i]
            denom = denom + sink_term[s, h]
            for i in range(dim):
                if unused and (acc[i] == 0.0 or not np.isfinite(acc[i])):
                    return False
                acc[i] = acc[i] / denom
            round_to_bf16(acc)
            out[s, h] = acc
    return True
