"""Torch twins of the Triton kernels: the same signatures and the reference's op sequence, so on
CPU they reproduce the fake-quantized reference bit for bit."""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from dsv41.kernels import codecs, cpu_attention, cpu_decode, cpu_index, cpu_loops
from dsv41.kernels.layouts import index_k_format, main_kv_format, pack_rows, swa_format, unpack_rows
from dsv41.kernels.selection import official_topk
from dsv41.model import mhc, numerics
from dsv41.model.quant import mxfp4_qdq

__all__ = ["index_scores", "mhc_update", "pack_rows", "select_candidate_blocks", "sparse_attention",
           "sparse_attention_decode"]

ATTENTION_CHUNK = 64  # indices per online-softmax step, as the reference kernel walks them
QUERY_BLOCK_BYTES = 2 << 20  # gathered fp32 keys per pass of sparse_attention (16 queries at 512 channels)
INDEX_CHUNK = 4096  # index keys unpacked and scored per pass (1 MB of bf16 keys at 128 channels)


def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor, scale: float
) -> torch.Tensor:
    """One softmax over gathered entries plus a per-head sink; K = V.

    q [b, m, h, d] bf16, kv [b, n, d] bf16 (or its fp32 copy), sink [h] fp32 (added to the denominator unscaled),
    idx [b, m, k] with -1 for unused slots. Online softmax over chunks of 64 indices with the
    probabilities rounded to bf16 before P·V, as the reference kernel does. Output bf16.

    The table is padded with unused slots to whole chunks: a batch's table is as wide as its
    widest row, and a last chunk of 6 keys summed 6 wide gave other bits than the same 6 among 8,
    so a sequence's result changed with the sequences beside it.
    """
    kv = kv.float()  # once for the table, not once per query that gathers a row (no copy when fp32)
    if q.size(1) > 1 and idx.size(-1) and numerics.opt_in("DSV41_FAST_ATTENTION", "prefill attention over shared keys"):
        return torch.stack([_shared_keys_attention(q[i], kv[i if kv.size(0) > 1 else 0], sink, idx[i], scale)
                            for i in range(q.size(0))])
    return _gathered_keys_attention(q, kv, sink, idx, scale)


def _gathered_keys_attention(q, kv, sink, idx, scale: float) -> torch.Tensor:
    """The reference order: each query multiplies its own gathered keys (kv fp32)."""
    if idx.size(-1) % ATTENTION_CHUNK:  # whole chunks: a sum over a short last chunk has other bits
        idx = F.pad(idx, (0, -idx.size(-1) % ATTENTION_CHUNK), value=-1)
    if _compiled_passes_serve(q, idx):
        return _compiled_passes(q, kv, sink, idx, scale)
    return _operator_passes(q, kv, sink, idx, scale)


def _operator_passes(q, kv, sink, idx, scale: float) -> torch.Tensor:
    """The operators' walk, a block of queries per pass (idx in whole chunks)."""
    b, m, h, d = q.shape
    block = query_block(d)
    if m > block:  # each query's result is its own: blocks of queries keep the gathered keys in cache
        return torch.cat([_operator_passes(q[:, s : s + block], kv, sink, idx[:, s : s + block], scale)
                          for s in range(0, m, block)], dim=1)
    if (not numerics.is_stable() and 0 < b * m * idx.size(-1) * h <= CHUNKS_AT_ONCE_LIMIT
            and _chunks_at_once_keep_bits(h, d, torch.get_num_threads())):
        return _chunks_at_once(q, kv, sink, idx, scale)
    return _chunk_by_chunk(q, kv, sink, idx, scale)


PASS_KEYS_BYTES = 1 << 20  # a pass's gathered fp32 keys up to which they are gathered at once, not per query
COMPILED_PASS_QUERIES = 8  # the fewest queries (of all sequences) a pass of _compiled_passes takes (`mini`: 1-8 best)
PASS_QUERIES_MOST = 32  # the most, where their keys fit PASS_KEYS_BYTES (`small`: 32, 0.87-0.92x the time of 8)


def _pass_queries(b: int, h: int, d: int, width: int) -> int:
    """Queries per pass of `_compiled_passes`, of each of b sequences: as many as PASS_KEYS_BYTES of
    gathered keys hold (tables `width` slots of d channels), within COMPILED_PASS_QUERIES and
    PASS_QUERIES_MOST, and within CHUNKS_AT_ONCE_LIMIT scores. Short tables (`small`'s 128 slots)
    then pay a pass's fixed cost a quarter as often; long ones (`mini`'s 640 slots of 512
    channels, 1.3 MB a query) keep eight, where sixteen were 5 % slower at 2K tokens."""
    fitting = PASS_KEYS_BYTES // (width * d * 4)
    wanted = min(PASS_QUERIES_MOST, max(COMPILED_PASS_QUERIES, fitting))
    return max(1, min(wanted, CHUNKS_AT_ONCE_LIMIT // (h * width)) // b)


def _compiled_passes_serve(q: torch.Tensor, idx: torch.Tensor) -> bool:
    """Whether `_compiled_passes` stands in for the operators: a prefill (several queries) where
    `_chunks_at_once` may run on one query of every sequence (`_compiled_decode_serves`' terms)."""
    b, m, h, d = q.shape
    return (m > 1 and not numerics.is_stable() and cpu_loops.serves(q)
            and 0 < b * h * idx.size(-1) <= CHUNKS_AT_ONCE_LIMIT
            and _chunks_at_once_keep_bits(h, d, torch.get_num_threads()))


def _compiled_passes(q, kv, sink, idx, scale: float) -> torch.Tensor:
    """`sparse_attention` of a prefill in passes of a few queries through `_compiled_chunks`: the
    operators' bits, a dozen calls a pass instead of about fifteen a chunk of 64 keys. A pass's keys
    are gathered at once where they take at most PASS_KEYS_BYTES (1 MB for 32 queries on `small`:
    two calls a pass instead of 64); larger ones are gathered one query at a time just
    before each of its two GEMMs (`KeysByQuery`), into a table that stays in the L2 (1.3 MB a query
    on `mini`). A pass the loops hand back is computed by the operators."""
    b, m, h, d = q.shape
    step = _pass_queries(b, h, d, idx.size(-1))
    widths = _pass_widths(kv, idx, step)
    rows, picked = flat_rows(kv, idx)
    qf = q.float()
    outs = []
    for s, k in zip(range(0, m, step), widths, strict=True):
        ids = idx[:, s : s + step, :k]
        n = ids.size(1)
        flat = ids.reshape(b * n, k)
        named = picked[:, s : s + n, :k].reshape(b * n, k)  # each query's rows in the table
        keys = (rows.index_select(0, named.flatten()).view(b * n, k, d) if named.numel() * d * 4 <= PASS_KEYS_BYTES
                else KeysByQuery(rows, named))
        out = _compiled_chunks(qf[:, s : s + n].reshape(b * n, h, d), qf.new_empty(b * n, 0, d), flat[:, :0], keys,
                               flat, sink, scale, cut=k < idx.size(-1))
        outs.append(out.view(b, n, h, d) if out is not None
                    else _operator_passes(q[:, s : s + n], kv, sink, idx[:, s : s + n], scale))
    return torch.cat(outs, dim=1)


def _pass_widths(kv: torch.Tensor, idx: torch.Tensor, step: int) -> list[int]:
    """Each pass's table width for `_compiled_passes`: its queries' slots (idx [b, m, k], whole
    chunks) up to the last chunk any of them uses. A chunk of unused slots changes no bit: its
    logits are masked, its probabilities 0 and its rescaling exp(0) = 1, so it adds 0 to each
    denominator and a zero of either sign to each output, which leaves every nonzero sum as it
    is (a zero output is handed back to the operators, as beside unused slots in a decode step:
    `cut`); a non-finite key read for an unused slot (kv's row 0, 0 x inf) would add a NaN, so a
    table whose first row is not finite keeps its full width. A prefill's early queries see fewer
    entries than the table holds: at 2K tokens on `mini` a pass reads 8 % fewer chunks."""
    b, m, k = idx.shape
    if not bool(kv[:, 0].isfinite().all()):
        return [k] * len(range(0, m, step))
    last = torch.where(idx >= 0, torch.arange(k, dtype=idx.dtype), -1).amax(dim=(0, 2))  # [m]
    if m % step:
        last = F.pad(last, (0, step - m % step), value=-1)
    used = (last.view(-1, step).amax(dim=1) + ATTENTION_CHUNK) // ATTENTION_CHUNK  # chunks up to the last used
    return [ATTENTION_CHUNK * max(1, c) for c in used.tolist()]


def _chunk_by_chunk(q, kv, sink, idx, scale: float) -> torch.Tensor:
    """The reference kernel's walk: one chunk of 64 indices after another (idx in whole chunks)."""
    b, m, h, d = q.shape
    qf = q.float()
    out = torch.zeros(b, m, h, d, dtype=torch.float32)
    denom = torch.zeros(b, m, h, dtype=torch.float32)
    running_max = torch.full((b, m, h), -1e30, dtype=torch.float32)
    for start in range(0, idx.size(-1), ATTENTION_CHUNK):
        chunk = idx[:, :, start : start + ATTENTION_CHUNK]
        valid = chunk != -1
        # unused slots read row 0: finite, and weighted by p = 0
        keys = gather_rows(kv, chunk.flatten(1)).view(*chunk.shape, d)
        logits = torch.where(valid.unsqueeze(2), numerics.einsum("bmhd,bmkd->bmhk", qf, keys), -torch.inf) * scale
        previous = running_max
        running_max = torch.maximum(previous, logits.amax(dim=-1))
        rescale = numerics.elementwise(torch.exp, previous - running_max)
        probs = numerics.elementwise(torch.exp, logits - running_max.unsqueeze(-1))
        denom = denom * rescale + numerics.wide(probs).sum(dim=-1).float()
        pv = numerics.einsum("bmhk,bmkd->bmhd", probs.to(torch.bfloat16).float(), keys)
        out = out * rescale.unsqueeze(-1) + pv
    denom = denom + numerics.elementwise(torch.exp, sink.float() - running_max)
    return (out / denom.unsqueeze(-1)).to(torch.bfloat16)


# Logits of a pass that _chunks_at_once handles: below torch's grain size (32768) an elementwise op
# runs on one thread, so no thread's share starts inside a chunk and changes which elements take
# vector code (the bits of exp can depend on it).
CHUNKS_AT_ONCE_LIMIT = 32768


def _chunks_at_once(q, kv, sink, idx, scale: float) -> torch.Tensor:
    """`_chunk_by_chunk` with the same bits in a fixed number of operator calls: every chunk's
    products in one batched GEMM (each chunk one matrix of it, the shape it has alone), the running
    maxima as a cumulative maximum, each chunk's exponentials as a run of its own
    (`numerics.elementwise_runs`); only the rescaled sums stay a loop over the chunks, a few
    small calls each. A decode step's attention was 20 calls per chunk of 64 keys."""
    b, m, h, d = q.shape
    n, chunks = b * m, idx.size(-1) // ATTENTION_CHUNK
    keys = gather_rows(kv, idx.flatten(1)).view(n * chunks, ATTENTION_CHUNK, d)
    dots = _chunk_dots(q.float().reshape(n, h, d), keys)
    valid = (idx != -1).view(n, chunks, 1, ATTENTION_CHUNK)
    logits = (torch.where(valid, dots, -torch.inf) * scale).transpose(0, 1).contiguous()  # [chunks, n, h, 64]
    floor = numerics.scalar(-1e30)
    running = torch.cummax(torch.maximum(logits.amax(dim=-1), floor), dim=0).values  # after each chunk
    before = torch.cat([floor.expand(1, n, h), running[:-1]])
    rescale = numerics.elementwise_runs(torch.exp, before - running, n * h)
    probs = numerics.elementwise_runs(torch.exp, logits - running.unsqueeze(-1), n * h * ATTENTION_CHUNK)
    sums = numerics.wide(probs).sum(dim=-1).float()
    pv = _chunk_pv(probs.to(torch.bfloat16).float().transpose(0, 1), keys)
    out = torch.zeros(n, h, d, dtype=torch.float32)
    denom = torch.zeros(n, h, dtype=torch.float32)
    for c in range(chunks):
        denom = denom * rescale[c] + sums[c]
        out = out * rescale[c].unsqueeze(-1) + pv[:, c]
    denom = denom + numerics.elementwise(torch.exp, sink.float() - running[-1])
    return (out / denom.unsqueeze(-1)).to(torch.bfloat16).view(b, m, h, d)


def _chunk_dots(qf: torch.Tensor, keys: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """qf [n, h, d] . keys [n * chunks, 64, d] -> [n, chunks, h, 64] (into `out` when given, a
    contiguous tensor of that shape), one matrix per chunk."""
    n, h, d = qf.shape
    chunks = keys.size(0) // n
    flat_out = None if out is None else out.view(n * chunks, h, -1)
    return torch.bmm(qf.unsqueeze(1).expand(n, chunks, h, d).reshape(-1, h, d), keys.transpose(1, 2),
                     out=flat_out).view(n, chunks, h, -1)


def _chunk_pv(probs: torch.Tensor, keys: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """probs [n, chunks, h, 64] @ keys [n * chunks, 64, d] -> [n, chunks, h, d] (into `out` when
    given, a contiguous tensor of that shape), one matrix per chunk."""
    n, chunks, h, k = probs.shape
    flat_out = None if out is None else out.view(n * chunks, h, -1)
    return torch.bmm(probs.reshape(n * chunks, h, k), keys, out=flat_out).view(n, chunks, h, -1)


@functools.cache
def _chunks_at_once_keep_bits(h: int, d: int, threads: int) -> bool:
    """Whether `_chunks_at_once` gives `_chunk_by_chunk`'s bits on this machine: its two batched
    GEMMs must give every chunk the fp32 bits of that chunk's own product, at every batch size it
    runs (each chunk is a matrix of the shape it has alone, but how a batched GEMM is split over
    threads is the BLAS's choice: MKL restricted to AVX2 on 2 threads sums some otherwise).
    Checked once per shape on random values; the bf16 output would hide most last-bit differences."""
    generator = torch.Generator().manual_seed(0)
    most = CHUNKS_AT_ONCE_LIMIT // (h * ATTENTION_CHUNK)  # matrices in the largest batched GEMM
    with torch.inference_mode():
        for n in sorted({1, 2, max(1, most // 10)}):
            for chunks in range(1, min(most // n, 12) + 1):
                q = torch.randn(n, 1, h, d, generator=generator, dtype=torch.float32).bfloat16().float()
                keys = torch.randn(n, 1, chunks, ATTENTION_CHUNK, d, generator=generator, dtype=torch.float32)
                probs = torch.rand(n, 1, chunks, h, ATTENTION_CHUNK, generator=generator, dtype=torch.float32)
                probs = probs.bfloat16().float()
                flat = keys.view(n * chunks, ATTENTION_CHUNK, d)
                for c in range(chunks):
                    alone_dots = numerics.einsum("bmhd,bmkd->bmhk", q, keys[:, :, c])[:, 0]
                    alone_pv = numerics.einsum("bmhk,bmkd->bmhd", probs[:, :, c], keys[:, :, c])[:, 0]
                    if not (torch.equal(_chunk_dots(q[:, 0], flat)[:, c], alone_dots)
                            and torch.equal(_chunk_pv(probs[:, 0], flat)[:, c], alone_pv)):
                        return False
    return True


SHARED_QUERY_BLOCK = 64  # queries whose keys are multiplied as one table by _shared_keys_attention
# A block whose queries read more distinct keys than this many times one query's indices takes
# `_in_place_attention`: the shared GEMMs grow with the distinct keys, its work with the indices
# (measured on `mini`, 2 threads: 64 queries over 4K entries cost 16 ms shared at 6.7 times, 10 ms in
# place; over 1K entries, 1.9 times, 5 ms shared).
SHARED_KEYS_LIMIT = 3.5
DOTS_QUERY_BLOCK = 4  # queries whose gathered keys one bmm multiplies (best of 1-64 on `mini`)


def _shared_keys_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """`sparse_attention` of one sequence (q [m, h, d], kv [n, d] fp32, idx [m, k]) in large GEMMs:
    each block of SHARED_QUERY_BLOCK queries multiplies every key any of them reads, once, instead
    of each query its own gathered keys (neighbouring queries share their window and often their
    Top-k entries, so a key is read once per block rather than once per query).

    The softmax is the reference's online softmax over each query's own chunks of 64 indices (the
    same running maxima, bf16-rounded probabilities and denominators); only the sums differ in order:
    a GEMM's dot products, and each chunk's rescaling applied to its probabilities before one P·V
    product rather than to the running output. So results agree with the reference to fp32
    rounding before the final bf16 rounding (docs/performance.md: about 1 output in 10^4 moves by
    one bf16 step). Opt-in (DSV41_FAST_ATTENTION=1), inference only."""
    m, h, d = q.shape
    if idx.size(-1) % ATTENTION_CHUNK:
        idx = F.pad(idx, (0, -idx.size(-1) % ATTENTION_CHUNK), value=-1)
    k = idx.size(-1)
    chunks = k // ATTENTION_CHUNK
    in_place = cpu_loops.serves(q, kv)  # the compiled loop reads CPU tensors; elsewhere the reference order
    out = []
    for s in range(0, m, SHARED_QUERY_BLOCK):
        block = idx[s : s + SHARED_QUERY_BLOCK]
        n = block.size(0)
        shared, where = distinct_ids(block, kv.size(0))
        if shared.numel() > SHARED_KEYS_LIMIT * k:
            out.append(_in_place_attention(q[s : s + n], kv, sink, block, scale) if in_place else
                       _gathered_keys_attention(q[None, s : s + n], kv[None], sink, block[None], scale)[0])
            continue
        keys = kv.index_select(0, shared)
        qf = q[s : s + SHARED_QUERY_BLOCK].float().reshape(n * h, d)
        where = where.clamp(min=0).unsqueeze(1).expand(n, h, k)  # unused slots: masked, weight 0
        every = (qf @ keys.t()).view(n, h, -1)
        logits = torch.where((block >= 0).unsqueeze(1), every.gather(2, where), -torch.inf) * scale
        weights, denom, last_max = _online_softmax_weights(logits.view(n, h, chunks, ATTENTION_CHUNK))
        p = torch.zeros(n, h, shared.numel(), device=q.device)
        p.scatter_add_(2, where, weights.view(n, h, k))  # a key read twice counts twice
        pv = (p.view(n * h, -1) @ keys).view(n, h, d)
        denom = denom + torch.exp(sink.float() - last_max)
        out.append((pv / denom.unsqueeze(-1)).to(torch.bfloat16))
    return torch.cat(out)


def _in_place_attention(q: torch.Tensor, kv: torch.Tensor, sink: torch.Tensor, idx: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """`_shared_keys_attention` of a block whose queries share few keys (q [n, h, d], kv [n_keys, d]
    fp32, idx [n, k] in whole chunks): each query's logits from its own gathered keys in the
    reference's products (so the reference's logits), the same softmax weights, and each query's
    weighted sum of its keys by a compiled loop that reads them in place (`cpu_attention`) instead of
    a second gathered pass."""
    n, h, d = q.shape
    qf = q.float()
    dots = torch.cat([torch.bmm(qf[s : s + DOTS_QUERY_BLOCK], gather_rows(kv[None], idx[None, s : s + DOTS_QUERY_BLOCK])
                                .view(-1, idx.size(-1), d).transpose(1, 2))
                      for s in range(0, n, DOTS_QUERY_BLOCK)])
    logits = torch.where((idx >= 0).unsqueeze(1), dots, -torch.inf) * scale
    weights, denom, last_max = _online_softmax_weights(logits.view(n, h, -1, ATTENTION_CHUNK))
    pv = torch.empty(n, h, d)
    cpu_attention.over_queries(cpu_attention.weighted_rows, n, weights.view(n, h, -1).numpy(),
                               kv.contiguous().numpy(), idx.long().contiguous().numpy(), pv.numpy())
    denom = denom + torch.exp(sink.float() - last_max)
    return (pv / denom.unsqueeze(-1)).to(torch.bfloat16)


def _online_softmax_weights(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The reference's online softmax over logits [n, h, chunks, 64] (chunk by chunk: the running
    maximum, the bf16-rounded probabilities, the denominator rescaled and added to), as each key's
    weight in the final output: its probability times the rescalings of every later chunk.
    Returns (weights like logits, the denominator without the sink, the last running maximum)."""
    n, h, chunks, _ = logits.shape
    floor = numerics.scalar(-1e30)
    running = torch.cummax(torch.maximum(logits.amax(dim=-1), floor), dim=-1).values  # after each chunk
    before = torch.cat([floor.expand(n, h, 1), running[..., :-1]], dim=-1)
    rescale = torch.exp(before - running)
    probs = torch.exp(logits - running.unsqueeze(-1))
    sums = probs.sum(dim=-1)
    denom = torch.zeros(n, h, device=logits.device)
    later = torch.ones(n, h, chunks, device=logits.device)  # product of the rescalings after each chunk
    for c in range(chunks):
        denom = denom * rescale[..., c] + sums[..., c]
    for c in range(chunks - 2, -1, -1):
        later[..., c] = later[..., c + 1] * rescale[..., c + 1]
    return probs.to(torch.bfloat16).float() * later.unsqueeze(-1), denom, running[..., -1]


def distinct_ids(ids: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For ids in [-1, n) (-1 unused): the distinct used ids in increasing order, and each id's
    place among them (-1 stays -1), as torch.unique(return_inverse=True) would give them, by
    marking the ids in a table of n + 1 rows instead of sorting them (several times faster)."""
    marked = torch.zeros(n + 1, dtype=torch.bool, device=ids.device)
    marked[ids.flatten() + 1] = True
    marked[0] = False
    place = marked.cumsum(0) - 1
    return marked.nonzero().squeeze(1) - 1, torch.where(ids >= 0, place[ids + 1], -1)


def query_block(dim: int) -> int:
    """Queries per pass of sparse_attention: as many as keep one pass's gathered keys within
    QUERY_BLOCK_BYTES (measured best: 16 at 512 channels on `mini`, 64-128 at 64 on `small`)."""
    return max(1, QUERY_BLOCK_BYTES // (ATTENTION_CHUNK * dim * 4))


def candidate_entries(
    scores: torch.Tensor, visible: torch.Tensor | int, n_blocks: int, block_size: int
) -> torch.Tensor:
    """The hierarchical pool: per query, the `n_blocks` blocks of `block_size` entries with the best
    block-max score, the block holding its newest visible entry always kept. scores [..., n] with
    invisible entries at -inf; visible broadcasts against scores' leading dims. Returns the pool's
    entry ids [..., min(n_blocks, blocks) * block_size] in ascending order, -1 for slots past the
    last entry or in chosen blocks that score -inf; its size does not grow with n."""
    width = scores.size(-1)
    padded = F.pad(scores, (0, -width % block_size), value=-torch.inf)
    block_scores = padded.unflatten(-1, (-1, block_size)).amax(dim=-1)
    total = block_scores.size(-1)
    newest = (visible - 1) // block_size
    block_scores = block_scores.masked_fill(torch.arange(total) == newest, torch.inf)
    best = official_topk(block_scores, min(n_blocks, total), by_value=True)
    chosen = (block_scores.gather(-1, best) > -torch.inf).repeat_interleave(block_size, dim=-1)
    ids = (best.unsqueeze(-1) * block_size + torch.arange(block_size)).flatten(-2)
    return torch.where(chosen & (ids < width), ids, -1)


def pool_mask(ids: torch.Tensor, width: int) -> torch.Tensor:
    """A pool's entry ids [..., p] (-1 unused) as a bool mask [..., width]."""
    slots = torch.zeros(*ids.shape[:-1], width + 1, dtype=torch.bool)
    return slots.scatter_(-1, torch.where(ids >= 0, ids, width).long(), True)[..., :width]


def select_candidate_blocks(
    scores: torch.Tensor, visible: torch.Tensor | int, n_blocks: int, block_size: int
) -> torch.Tensor:
    """`candidate_entries` as a bool mask shaped like scores (how the official code records it)."""
    return pool_mask(candidate_entries(scores, visible, n_blocks, block_size), scores.size(-1))



def gather_rows(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """rows [b, n, ...] picked by ids [b, k] (-1 reads row 0; callers mask it) -> [b, k, ...]; rows
    [1, n, ...] (a page pool), or expanded from it, serve every sequence. One index_select over the
    flattened rows: advanced indexing by (batch, id) pairs takes about 10x longer on the CPU."""
    flat, picked = flat_rows(rows, ids)
    return flat.index_select(0, picked.flatten()).view(*ids.shape, *rows.shape[2:])


def flat_rows(rows: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`gather_rows`' operands: rows [b, n, ...] as one table [R, ...] and ids [b, ...] as row
    numbers in it (int64; -1 reads its sequence's row 0)."""
    if rows.size(0) not in (1, ids.size(0)):
        raise ValueError(f"rows of {rows.size(0)} sequences cannot serve ids of {ids.size(0)}")
    if rows.stride(0) == 0:  # one pool expanded over the batch: flattening would copy it per sequence
        rows = rows[:1]
    picked = ids.long().clamp(min=0)
    if rows.size(0) > 1:
        sequence = torch.arange(ids.size(0), device=ids.device).view(-1, *[1] * (ids.dim() - 1))
        picked = picked + sequence * rows.size(1)
    return rows.flatten(0, 1), picked


def sparse_attention_decode(q, ring, slots, main, topk, sink, scale: float, tables: dict | None = None,
                            key: object = None) -> torch.Tensor:
    """q [b, h, d] bf16; ring [b, W, swa bytes] with slots [b, W] (-1 unused); main [b, n, main bytes]
    with topk [b, k] entry ids (-1 unused); sink [h] fp32 -> out [b, h, d] bf16. `tables`: the
    step's dequantized Top-k entries by `key`, for the layers that read the same ones (a group's
    Reuse layers after its Full layer): the first unpacks them, the others take its table."""
    d = q.size(-1)
    # whole chunks of entry slots, as sparse_attention pads its table (the ring's W slots are whole
    # chunks): a table the official width cut short (fewer entries than Top-k visible, and every
    # layer that reads all of a short context's entries) then takes the compiled loops too
    if topk.size(1) % ATTENTION_CHUNK:
        topk = F.pad(topk, (0, -topk.size(1) % ATTENTION_CHUNK), value=-1)
    # unpacked straight to fp32, what sparse_attention computes in: a code times its scale is exact
    # in bf16 and fp32 alike, so this skips rounding to bf16 and converting back (same values)
    entries = None if tables is None else tables.get(key)
    if entries is None:
        entries = unpack_rows(gather_rows(main, topk), main_kv_format(d), torch.float32)
        if tables is not None:
            tables[key] = entries
    if _compiled_decode_serves(q, slots, topk):
        out = _compiled_decode(q, ring, slots, entries, topk, sink, scale)
        if out is not None:
            return out
    window = unpack_rows(ring, swa_format(d), torch.float32)
    kv = torch.cat([window, entries], dim=1)
    local = torch.arange(topk.size(1), device=q.device) + ring.size(1)
    idx = torch.cat([slots.int(), torch.where(topk >= 0, local, -1).int()], dim=1)
    return sparse_attention(q.unsqueeze(1), kv, sink, idx.unsqueeze(1), scale).squeeze(1)


def _compiled_decode_serves(q: torch.Tensor, slots: torch.Tensor, topk: torch.Tensor) -> bool:
    """Whether `_compiled_decode` stands in for `_chunks_at_once`: where that path runs (CPU,
    official numerics, a batch within its limit, GEMMs that give each chunk its own product's
    bits), with the ring slots and the entries each in whole chunks."""
    b, h, d = q.shape
    width = slots.size(1) + topk.size(1)
    return (not numerics.is_stable() and cpu_loops.serves(q) and slots.size(1) % ATTENTION_CHUNK == 0
            and topk.size(1) % ATTENTION_CHUNK == 0 and 0 < b * h * width <= CHUNKS_AT_ONCE_LIMIT
            and _chunks_at_once_keep_bits(h, d, torch.get_num_threads()))


def _compiled_decode(q, ring, slots, entries, topk, sink, scale: float) -> torch.Tensor | None:
    """`sparse_attention` of one decode token per sequence (q [b, h, d] bf16) over its ring slots
    (ring [b, W, bytes], slots [b, W]) and Top-k entries (entries [b, K, d] fp32, topk [b, K]), with
    `_chunks_at_once`' bits and a third of its operator calls: the same GEMMs, on the ring's rows
    in slot order and on the entries where they lie (no gathered table of both). None where a loop
    cannot vouch for the bits (the operators then take the call)."""
    d = q.size(-1)
    window = unpack_rows(gather_rows(ring, slots), swa_format(d), torch.float32)  # the rows the operators gather
    return _compiled_chunks(q.float(), window, slots, entries, topk, sink, scale)


def _compiled_chunks(qf, window, slots, entries, topk, sink, scale: float, cut: bool = False) -> torch.Tensor | None:
    """`_chunks_at_once` for n queries of h heads (qf [n, h, d] fp32) over two key tables in whole
    chunks, window [n, W, d] with slots [n, W] and entries [n, K, d] (or `KeysByQuery`) with topk
    [n, K] (fp32 keys, -1 marks an unused slot; `cut`: the entries were cut from a wider table at unused chunks): the
    GEMMs, exponentials and sums by torch, the softmax's bookkeeping in compiled loops
    (`cpu_decode`). bf16 [n, h, d], or None where a loop cannot vouch for the bits."""
    n, h, d = qf.shape
    w, k = slots.size(1), topk.size(1)
    window_chunks, chunks = w // ATTENTION_CHUNK, (w + k) // ATTENTION_CHUNK
    window_keys = window.reshape(-1, ATTENTION_CHUNK, d)
    slots_np, topk_np = slots.long().contiguous().numpy(), topk.long().contiguous().numpy()
    run = n * h * ATTENTION_CHUNK
    f32 = torch.float32  # not the default dtype, which a caller may have set to bf16
    prob_args = torch.empty(chunks, run + 1, dtype=f32)  # each chunk's run a gap apart, as the operators'
    rescale_args = torch.empty(chunks, n * h + 1, dtype=f32)
    last_running = torch.empty(n, h, dtype=f32)
    window_dots = _chunk_dots(qf, window_keys) if w else torch.empty(n, 0, h, ATTENTION_CHUNK, dtype=f32)
    entry_dots = _entry_dots(qf, entries) if k else torch.empty(n, 0, h, ATTENTION_CHUNK, dtype=f32)
    if not cpu_decode.decode_logits(window_dots.numpy(), entry_dots.numpy(), slots_np, topk_np,
                                    scale, prob_args.numpy(), rescale_args.numpy(), last_running.numpy()):
        return None
    # each chunk's exponentials as a run of its own, as numerics.elementwise_runs lays them out
    probs = torch.exp(prob_args[:, :run]).view(chunks, n, h, ATTENTION_CHUNK)
    rescale = torch.exp(rescale_args[:, : n * h]).view(chunks, n, h)
    sums = probs.sum(dim=-1)
    sink_term = torch.exp(sink.float() - last_running)
    window_probs = torch.empty(n, window_chunks, h, ATTENTION_CHUNK, dtype=f32)
    entry_probs = torch.empty(n, chunks - window_chunks, h, ATTENTION_CHUNK, dtype=f32)
    cpu_decode.split_probabilities(probs.numpy(), window_probs.numpy(), entry_probs.numpy())
    window_pv = _chunk_pv(window_probs, window_keys) if w else torch.empty(n, 0, h, d, dtype=f32)
    entry_pv = _entry_pv(entry_probs, entries) if k else torch.empty(n, 0, h, d, dtype=f32)
    out = torch.empty(n, h, d, dtype=f32)
    if not cpu_decode.decode_outputs(window_pv.numpy(), entry_pv.numpy(), rescale.numpy(),
                                     sums.numpy(), sink_term.numpy(), topk_np, cut, out.numpy()):
        return None
    return out.to(torch.bfloat16)


@dataclass(frozen=True)
class KeysByQuery:
    """Each query's entry keys as row numbers into one table (rows [R, d] fp32, ids [n, K] int64,
    `flat_rows`), gathered one query at a time just before a GEMM reads them: a prefill pass's
    queries' keys together (10.5 MB for eight on `mini`) leave the L2 before their second GEMM."""

    rows: torch.Tensor
    ids: torch.Tensor

    def each_query(self) -> Iterator[tuple[int, torch.Tensor]]:
        """(query, its keys [K / 64, 64, d]) in turn, in one reused table."""
        table = self.rows.new_empty(self.ids.size(1), self.rows.size(-1))
        for i in range(self.ids.size(0)):
            torch.index_select(self.rows, 0, self.ids[i], out=table)
            yield i, table.view(-1, ATTENTION_CHUNK, table.size(-1))


def _entry_dots(qf: torch.Tensor, entries: torch.Tensor | KeysByQuery) -> torch.Tensor:
    """`_chunk_dots` of queries qf [n, h, d] with their entries -> [n, K / 64, h, 64]."""
    n, h, d = qf.shape
    if isinstance(entries, torch.Tensor):
        return _chunk_dots(qf, entries.reshape(-1, ATTENTION_CHUNK, d))
    out = qf.new_empty(n, entries.ids.size(1) // ATTENTION_CHUNK, h, ATTENTION_CHUNK)
    for i, keys in entries.each_query():
        _chunk_dots(qf[i : i + 1], keys, out[i : i + 1])
    return out


def _entry_pv(probs: torch.Tensor, entries: torch.Tensor | KeysByQuery) -> torch.Tensor:
    """`_chunk_pv` of probabilities [n, K / 64, h, 64] with their queries' entries -> [n, K / 64, h, d]."""
    n, chunks, h, _ = probs.shape
    if isinstance(entries, torch.Tensor):
        return _chunk_pv(probs, entries.reshape(-1, ATTENTION_CHUNK, entries.size(-1)))
    out = probs.new_empty(n, chunks, h, entries.rows.size(-1))
    for i, keys in entries.each_query():
        _chunk_pv(probs[i : i + 1], keys, out[i : i + 1])
    return out


def index_scores(q, weights, keys, entry_ids=None) -> torch.Tensor:
    """q [b, hi, di] bf16 (MXFP4 values), weights [b, hi] bf16, keys [b, n_keys, 68-byte entries];
    bf16 scores [b, n] for every key, or for entry_ids [b, n] (a candidate pool).

    On the CPU a compiled loop scores the packed keys where they lie (`cpu_index`, the same bits;
    keys it cannot vouch for go through the operators below)."""
    if _packed_loop_serves(q, weights, keys):
        return _packed_index_scores(q, weights, keys, entry_ids)
    return _operator_index_scores(q, weights, keys, entry_ids)


def _operator_index_scores(q, weights, keys, entry_ids=None) -> torch.Tensor:
    """`index_scores` by torch operators: the reference's bf16 product, ReLU, weights and head sum.

    Keys are unpacked and scored INDEX_CHUNK at a time: each key's score depends on that key alone,
    and a chunk's temporaries stay in cache, where a whole long context's would be fresh pages
    every step (4x faster at 128K keys; tests/test_numerics_constants.py compares the bits)."""
    n = keys.size(1) if entry_ids is None else entry_ids.size(1)
    parts = []
    for start in range(0, max(n, 1), INDEX_CHUNK):
        part = slice(start, start + INDEX_CHUNK)
        rows = keys[:, part] if entry_ids is None else gather_rows(keys, entry_ids[:, part])
        k = unpack_rows(rows, index_k_format(q.size(-1)))
        dots = numerics.dots(q, k)
        parts.append(numerics.wide(dots.relu() * weights.unsqueeze(-1)).sum(dim=1).to(dots.dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def weighted_head_sums(dots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Index scores [b, s, t] from bf16 dot products dots [b, s, heads, t] and head weights
    [b, s, heads]: ReLU, times the weight, summed over the heads, every step in bf16 as the
    reference computes it. On the CPU a compiled loop makes one pass over the products
    (`cpu_index.weighted_head_sums`, the same bits) where a probe finds torch summing the heads in
    its order; from HEAD_SUMS_SPLIT products the rows are split over torch's threads."""
    if (numerics.is_stable() or dots.dtype != torch.bfloat16 or weights.dtype != torch.bfloat16
            or not cpu_loops.serves(dots, weights) or not _head_sums_keep_bits(dots.size(2))):
        return _operator_head_sums(dots, weights)
    scores = _loop_head_sums(dots, weights, split=dots.numel() >= HEAD_SUMS_SPLIT)
    return scores if scores is not None else _operator_head_sums(dots, weights)


def _loop_head_sums(dots: torch.Tensor, weights: torch.Tensor, split: bool) -> torch.Tensor | None:
    """`cpu_index.weighted_head_sums` over every row (`split`: the rows over torch's threads), read
    where the products lie (a view where the GEMM's were padded); None where it handed them back."""
    b, s, h, t = dots.shape
    rows = dots.reshape(b * s, h, t).view(torch.int16).numpy().view(np.uint16)
    out = np.empty((b * s, t), np.uint16)
    arrays = (rows, weights.reshape(b * s, h).float().contiguous().numpy(), out)
    if split:
        done = all(cpu_attention.over_queries(cpu_index.weighted_head_sums, b * s, *arrays))
    else:
        done = cpu_index.weighted_head_sums(*arrays, 0, b * s)
    return torch.from_numpy(out).view(torch.bfloat16).view(b, s, t) if done else None


HEAD_SUMS_SPLIT = 1 << 18  # products from which `weighted_head_sums` splits its rows over threads


def _operator_head_sums(dots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return numerics.wide(dots.relu() * weights.unsqueeze(-1)).sum(dim=2).to(dots.dtype)


@functools.cache
def _head_sums_keep_bits(heads: int) -> bool:
    """Whether `cpu_index.weighted_head_sums` gives the operators' bits on this machine for this
    many heads: random products (negative ones and zeros of both signs among them) and terms of
    2^25, -2^25 and ones on random heads, whose sums differ between one order of the heads and
    another, over key counts around the vector widths. Checked once per head count."""
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for b, s, t in ((1, 1, 1), (1, 3, 100), (2, 5, 1027), (1, 2, 4096 + 9)):
            dots = (torch.randn(b, s, heads, t, generator=generator) * 4).bfloat16()
            dots[..., ::7] = 0.0
            dots[..., 3::11] = -0.0
            weights = (torch.randn(b, s, heads, generator=generator) * 8).bfloat16()
            order = torch.ones(b, s, heads, t, dtype=torch.bfloat16)
            spread = torch.ones(b * s, heads)
            for row in range(b * s):
                chosen = torch.randperm(heads, generator=generator)[:2]
                spread[row, chosen[0]], spread[row, chosen[-1]] = 2.0**25, -(2.0**25)
            for d, w in ((dots, weights), (order, spread.view(b, s, heads).bfloat16())):
                got = _loop_head_sums(d, w, split=False)
                if got is None or not torch.equal(got.view(torch.int16), _operator_head_sums(d, w).view(torch.int16)):
                    return False
    return True


def _packed_loop_serves(q, weights, keys) -> bool:
    """Whether `cpu_index.packed_index_scores` stands in for the operators: CPU tensors outside
    autograd and stable mode, MXFP4 keys of whole 32-channel blocks, and a machine where a probe
    finds torch summing the heads in the order the loop does."""
    return (not numerics.is_stable() and keys.dtype == torch.uint8 and q.size(-1) % cpu_index.SCALE_BLOCK == 0
            and keys.size(-1) == index_k_format(q.size(-1)).entry_bytes and cpu_loops.serves(q, weights, keys)
            and _packed_loop_keeps_bits(q.size(-2), q.size(-1)))


def _packed_index_scores(q, weights, keys, entry_ids=None) -> torch.Tensor:
    """`index_scores` by the compiled loop; the keys whose exactness it cannot show (rare: scale
    bytes far apart, values near float32's subnormals) are scored again by the operators."""
    if keys.stride(0) == 0:  # one pool expanded over the batch
        keys = keys[:1]
    ids = (torch.arange(keys.size(1)).expand(q.size(0), -1) if entry_ids is None else entry_ids).long().contiguous()
    scores, unsure = _loop_scores(q, weights, keys, ids)
    if unsure.numpy().any():
        for i in unsure.any(dim=1).nonzero().flatten().tolist():
            where = unsure[i].nonzero().flatten()
            own = keys[min(i, keys.size(0) - 1)].unsqueeze(0)
            scores[i, where] = _operator_index_scores(q[i : i + 1], weights[i : i + 1], own, ids[i : i + 1, where])[0]
    return scores


INDEX_SPLIT_KEYS = 16384  # keys from which the loop's range is split over torch's threads


def _loop_scores(q, weights, keys, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """The loop's bf16 scores [b, n] of keys ids [b, n] (int64) and which of them it could not
    vouch for (uint8 [b, n], their scores unset). From INDEX_SPLIT_KEYS keys the range is split
    over torch's threads; below, handing work to another thread (60 us on a 2-core VM) would cost
    more than it saves (64 keys take 4 us)."""
    b, n = ids.shape
    q32, w32 = q.float().contiguous().numpy(), weights.float().contiguous().numpy()
    bounds = np.empty((b, 3), np.int64)
    cpu_index.scale_bounds(q32, w32, q.size(-1) // cpu_index.SCALE_BLOCK, bounds)
    # numpy's allocations: torch's zero fill of a large array is a parallel operator, and one fewer
    # leaves its OpenMP worker less often spinning on the core the loop's second thread needs
    out, unsure = np.empty((b, n), np.uint16), np.zeros((b, n), np.uint8)
    pairs = codecs.scaled_code_table(True, False, cpu_index.SCALE_BLOCK, torch.float32).numpy()
    arrays = (q32, w32, bounds, keys.contiguous().numpy(), ids.numpy(), pairs, out, unsure)
    if n >= INDEX_SPLIT_KEYS:
        cpu_attention.over_queries(cpu_index.packed_index_scores, n, *arrays)
    else:
        cpu_index.packed_index_scores(*arrays, 0, n)
    return torch.from_numpy(out).view(torch.bfloat16), torch.from_numpy(unsure)


@functools.cache
def _packed_loop_keeps_bits(heads: int, dim: int) -> bool:
    """Whether the loop gives the operators' bits on this machine for `heads` x `dim` queries: the
    dot products are exact by construction, but the head sum's order and the bf16 roundings are
    torch's. Random queries, weights and keys (some of them far apart in scale) decide it once,
    with `_order_revealing` rows, whose sums differ between one order of the heads and another."""
    generator = torch.Generator().manual_seed(0)
    fmt = index_k_format(dim)
    scale = torch.exp2(torch.randint(-6, 6, (1, 2048, 1), generator=generator).float())
    keys = pack_rows(torch.randn(1, 2048, dim, generator=generator) * scale, fmt)
    q = mxfp4_qdq(torch.randn(2, heads, dim, generator=generator)).bfloat16()
    spread = torch.exp2(torch.randint(-12, 13, (2, heads), generator=generator).float())  # terms far apart
    weights = (torch.randn(2, heads, generator=generator) * spread).bfloat16()
    ids = torch.randint(-1, 2048, (2, 3000), generator=generator)
    with torch.inference_mode():
        scores, unsure = _loop_scores(q, weights, keys, ids.long().clamp(min=-1))
        sure = unsure == 0
        expected = _operator_index_scores(q, weights, keys, ids)
        if not (bool(sure.float().mean() > 0.5) and torch.equal(scores[sure], expected[sure])):
            return False
        q, weights, keys = _order_revealing(heads, dim, generator)
        ids = torch.arange(keys.size(1)).expand(q.size(0), -1).contiguous()
        scores, unsure = _loop_scores(q, weights, keys[:1], ids)
        return not bool(unsure.any()) and torch.equal(scores, _operator_index_scores(q, weights, keys))


def _order_revealing(heads: int, dim: int,
                     generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries, weights and keys whose head terms are 2^25, -2^25 and a few ones on random heads
    (every dot product exactly 1: one query channel against a key of ones): whether the ones
    survive depends on which terms are added first, so another summation order of the heads gives
    other scores."""
    rows = 32
    q = torch.zeros(rows, heads, dim, dtype=torch.bfloat16)
    q[:, :, 0] = 1.0
    key = torch.zeros(1, 1, dim)
    key[..., :: cpu_index.SCALE_BLOCK] = 1.0
    weights = torch.zeros(rows, heads)
    for row in range(rows):
        chosen = torch.randperm(heads, generator=generator)[: min(heads, 6)]
        weights[row, chosen[2:]] = 1.0
        weights[row, chosen[0]], weights[row, chosen[1 % len(chosen)]] = 2.0**25, -(2.0**25)
    return q, weights.bfloat16(), pack_rows(key, index_k_format(dim)).expand(rows, -1, -1)


def mhc_update(x, f, post, comb, mix, fn, scale, base, iters: int, hc_eps: float, norm_eps: float,
               rows: list[int] | None = None):
    """x [..., 4, d] bf16 stream, f [..., d] bf16 sub-layer output, post [..., 4], comb [..., 4, 4],
    mix [..., 4]; fn/scale/base: the next sub-layer's predictor; rows: as `mhc.predict` takes them.
    Returns (new stream, its collapse by mix, pre, post, comb of the next sub-layer)."""
    y = mhc.expand(f, x, post, comb)
    pre_n, post_n, comb_n = mhc.predict(y, fn, scale, base, x.size(-2), iters, hc_eps, norm_eps, rows)
    return y, mhc.collapse(y, mix), pre_n, post_n, comb_n
