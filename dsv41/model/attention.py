"""CSA2 attention over whole sequences (SPEC.md §3): an SWA branch in every layer plus, in layers
with a compress ratio, Top-k entries of a layer-shared global KV chosen by an indexer.

Full layers own a global KV group (compressor + index keys) and score it; Reindex layers rescore
their group's keys with their own query, restricted to the candidate pool; Reuse layers attend with
the Top-k of their group's latest Full/Reindex layer for the same query position.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from dsv41.config import LayerSpec, Mode, TextConfig
from dsv41.kernels import cpu_projections, dispatch
from dsv41.kernels.selection import (
    full_width,
    official_pick,
    official_topk,
    sparse_pick_serves,
    topk_entries,
    untied_topk,
)
from dsv41.kernels.torch_ops import candidate_entries, distinct_ids, pool_mask, sparse_attention, weighted_head_sums
from dsv41.model import numerics
from dsv41.model.cache import DecodeCache, GroupCache
from dsv41.model.layers import Linear, LinearsBeside, RMSNorm, Storage, norm_sum_width
from dsv41.model.pages import PagedEntries
from dsv41.model.quant import fp8_qdq, loop_serves, main_kv_qdq, mxfp4_qdq
from dsv41.model.rope import rotate, rotation_keeps_bits
from dsv41.model.trace import Trace


@dataclass
class SharedAttention:
    """What source layers hand to their consumers within one forward, keyed by source layer id,
    plus where this forward sits: positions start..start+s-1, and the decode cache if any."""

    start: int = 0
    cache: DecodeCache | None = None
    window_floor: int = 0  # SWA positions below this are not attended (bounded replay starts here)
    emit_entries: bool = True  # False when the group's entries already exist (CED projected them)
    rows_start: dict[int, int] = field(default_factory=dict)  # position of row 0 of topk[layer]
    main_kv: dict[int, torch.Tensor] = field(default_factory=dict)  # [b, n_entries, head_dim]
    index_k: dict[int, torch.Tensor] = field(default_factory=dict)  # [b, n_entries, index_head_dim]
    topk: dict[int, torch.Tensor] = field(default_factory=dict)  # [b, s, k] entry ids, -1 = unused
    # a decode step's dequantized Top-k entries by (KV owner, Top-k producer), kept on the batch's first part
    decode_tables: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # and those entries' pool rows (the batch's Top-k ids through its page tables), by the same key
    decode_pool_rows: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    candidates: torch.Tensor | None = None  # [b, s, pool size] entry ids of the candidate pool, -1 unused
    candidate_source: int = -1
    scored: dict[str, int] | None = None  # index entries scored, by layer kind, when counted
    trace: Trace | None = None
    # training only (a model in train mode): attend every visible entry (the indexer's dense
    # warm-up), and collect each indexer layer's (index scores [b, s, n], attention probabilities
    # over the entries [b, s, heads, n] (detached), attended mask [b, s, n]) for its KL term
    dense_index: bool = False
    index_targets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None

    @property
    def split_sizes(self) -> list[int] | None:
        """One sequence's forward: nothing to split (`SharedBatch.split_sizes`)."""
        return None


@dataclass
class SharedBatch:
    """Several sequences' tokens concatenated along the sequence axis for one batched step: the
    per-token work (mHC, norms, MoE) runs once over all of them, attention per sequence with its
    own positions and caches (`parts[i]` holds sizes[i] tokens)."""

    parts: list[SharedAttention]
    sizes: list[int]
    trace: Trace | None = None

    @property
    def capacity(self) -> int:
        return max(part.cache.capacity for part in self.parts)

    @functools.cached_property
    def positions(self) -> torch.Tensor:
        """Every token's position, in the batch's order (the parts' starts hold through a forward)."""
        return torch.cat([torch.arange(p.start, p.start + n) for p, n in zip(self.parts, self.sizes, strict=True)])

    @property
    def split_sizes(self) -> list[int] | None:
        """The sequences' token counts: the per-token work whose bits depend on the batch's shape
        (fp32 GEMMs, gates) runs per sequence, as alone. One token each included: MKL's fp32 GEMM
        on AVX2 sums a row in one order alone, another beside one or two rows, a third beside more."""
        return self.sizes if len(self.sizes) > 1 else None

    @functools.cached_property
    def decode_tokens(self) -> list[int]:
        """The parts that step one token on a packed cache (attention runs them through the
        packed-cache kernel as a batch of their own) when the batch also holds other work; else [].
        Found once per forward: every layer asks."""
        if self.one_decode_token_each:
            return []
        steps = [i for i, (part, size) in enumerate(zip(self.parts, self.sizes, strict=True))
                 if size == 1 and part.start > 0 and part.cache.packed]
        steps = [i for i in steps if self.parts[i].cache.pools is self.parts[steps[0]].cache.pools]
        return steps if len(steps) < len(self.parts) else []

    @property
    def one_decode_token_each(self) -> bool:
        """Every sequence steps one token on a packed cache, all pages in the same pools: the case
        attention runs batched (`Attention.forward` given the batch)."""
        caches = [part.cache for part in self.parts]
        return (all(size == 1 for size in self.sizes) and all(part.start > 0 for part in self.parts)
                and all(c.packed and c.pools is caches[0].pools for c in caches))


# Index table layout. Attention walks a row's indices in chunks of 64 and rounds each chunk's
# probabilities to bf16 against the running max, so where a row's valid indices sit decides which
# chunk they fall in and changes the result in the last bits once a row holds more than 64 of them.
# By default the tables are laid out as the official code lays them out, so that outputs match it:
# a forward from position 0 lists each row's valid window positions first in a table
# min(s, W) wide, followed by min(k, entries) entry columns; a one-token decode step lists the
# whole ring oldest slot first, the slots not yet written (-1) in front, followed by its
# min(k, entries) entries. In shape-stable numerics every table has a fixed width (W window
# columns, k entry columns) with each row's valid indices first, so a query's attention does not
# depend on the length of the forward it came in: chunked prefill, replay, verification and the
# oracle then agree exactly.


def window_indices(seq_len: int, window: int) -> torch.Tensor:
    """[seq, window] positions each query sees in the SWA branch: p-window+1..p, then -1."""
    end = torch.arange(seq_len).unsqueeze(1)
    idx = (end - window + 1).clamp(min=0) + torch.arange(window)
    return torch.where(idx > end, -1, idx)


def ring_indices(position: int, window: int) -> torch.Tensor:
    """[1, window] ring slots a decode query at `position` sees, oldest first; slots not yet written
    are -1, in front as the official code has them (after the valid ones in stable numerics)."""
    return ring_slots(torch.tensor([position]), window)


def ring_slots(positions: torch.Tensor, window: int) -> torch.Tensor:
    """`ring_indices` of several decode queries at once: positions [B] -> [B, window]."""
    if not numerics.is_stable() and bool((positions >= window - 1).all()):
        # a full ring's slots depend on the position modulo the window alone: made once each
        return torch.cat([_full_ring_slots(int(p) % window, window) for p in positions])
    positions = positions.unsqueeze(1)
    idx = (positions % window + 1 + torch.arange(window)) % window
    idx = torch.where(idx > positions, -1, idx)
    return valid_first(idx) if numerics.is_stable() else idx


@functools.lru_cache(maxsize=4096)
def _full_ring_slots(phase: int, window: int) -> torch.Tensor:
    """The ring slots [1, window] of a decode query at a position p >= window - 1 with p % window
    == phase, oldest first (shared: callers read it only)."""
    with torch.inference_mode(False):  # usable where autograd records too
        return ((phase + 1 + torch.arange(window)) % window).unsqueeze(0)


def official_width(idx: torch.Tensor) -> torch.Tensor:
    """A valid-first index table cut to the columns some row uses (the official code's tables are
    that wide); unchanged in stable numerics, whose tables keep a fixed width."""
    if numerics.is_stable():
        return idx
    return idx[..., : int((idx >= 0).sum(-1).max())] if idx.numel() else idx


def visible_entries(seq_len: int, ratio: int, start: int = 0) -> torch.Tensor:
    """[seq, 1] number of complete compressed groups query p (start..start+seq-1) can see:
    floor((p+1)/ratio)."""
    return (torch.arange(start + 1, start + seq_len + 1) // ratio).unsqueeze(-1)


def valid_first(idx: torch.Tensor) -> torch.Tensor:
    """Each row's valid indices (>= 0) ahead of its unused ones, their order kept."""
    return idx.gather(-1, torch.sort((idx < 0).to(torch.uint8), dim=-1, stable=True).indices)


class Compressor(nn.Module):
    """Builds a Full layer's global KV latents (before RoPE): ratio 1 is a plain projection; ratio
    m > 1 pools each complete, non-overlapping group of m tokens with a per-channel softmax gate.
    A partial group waits in the cache's fp32 state until its last token arrives."""

    def __init__(self, t: TextConfig, ratio: int, device=None):
        super().__init__()
        self.ratio = ratio
        storage = Storage.FP32 if ratio > 1 else Storage.BF16
        self.wkv = Linear(t.hidden_size, t.head_dim, storage, device)
        self.wgate = Linear(t.hidden_size, t.head_dim, Storage.FP32, device) if ratio > 1 else None
        self.norm = RMSNorm(t.head_dim, t.rms_norm_eps, device)

    def forward(self, x: torch.Tensor, start: int, state: GroupCache | None) -> torch.Tensor | None:
        """x [b, s, dim] at positions start.. -> new latents [b, n_new, head_dim], or None."""
        if self.ratio == 1:
            return self.norm(self.wkv(x))
        m = self.ratio
        xf = x.float()
        kv, gate = self.wkv(xf), self.wgate(xf)
        if state is not None:  # kept so that a truncated step can rebuild the partial group
            state.step_rows = (start, kv, gate)
        if start == 0:
            complete = x.size(1) - x.size(1) % m
            if state is not None and complete < x.size(1):
                state.kv_state[:, : x.size(1) - complete] = kv[:, complete:]
                state.score_state[:, : x.size(1) - complete] = gate[:, complete:]
            if complete == 0:
                return None
            kv = kv[:, :complete].unflatten(1, (-1, m))
            gate = gate[:, :complete].unflatten(1, (-1, m))
            pooled = (kv * numerics.elementwise(torch.softmax, gate, dim=2)).sum(dim=2)
        elif x.size(1) == 1:
            state.kv_state[:, start % m] = kv[:, 0]
            state.score_state[:, start % m] = gate[:, 0]
            if (start + 1) % m:
                return None
            weights = numerics.elementwise(torch.softmax, state.score_state, dim=1)
            pooled = (state.kv_state * weights).sum(dim=1, keepdim=True)
        else:
            pooled = self._extend(kv, gate, start, state)
            if pooled is None:
                return None
        return self.norm(pooled.to(x.dtype))

    def _extend(self, kv, gate, start: int, state: GroupCache) -> torch.Tensor | None:
        """Several tokens after position 0: the pending part of a group (in the state) goes first."""
        m, pending = self.ratio, start % self.ratio
        kv = torch.cat([state.kv_state[:, :pending], kv], dim=1)
        gate = torch.cat([state.score_state[:, :pending], gate], dim=1)
        n = kv.size(1)
        complete = n - n % m
        if n % m:
            state.kv_state[:, : n % m] = kv[:, complete:]
            state.score_state[:, : n % m] = gate[:, complete:]
        if complete == 0:
            return None
        groups, weights = kv[:, :complete].unflatten(1, (-1, m)), gate[:, :complete].unflatten(1, (-1, m))
        return (groups * numerics.elementwise(torch.softmax, weights, dim=2)).sum(dim=2)


class Indexer(nn.Module):
    """Scores global entries for each query: ReLU-ed per-head dot products of MXFP4 queries and
    keys, combined by per-token head weights. Full layers also own the index keys."""

    def __init__(self, t: TextConfig, owns_keys: bool, device=None):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = t.index_n_heads, t.index_head_dim, t.index_topk
        self.wq_b = Linear(t.q_lora_rank, self.n_heads * self.head_dim, Storage.FP8, device)
        self.weights_proj = Linear(t.hidden_size, self.n_heads, Storage.BF16, device)
        self.wk = Linear(t.head_dim, self.head_dim, Storage.BF16, device) if owns_keys else None
        self.k_norm = RMSNorm(self.head_dim, t.rms_norm_eps, device) if owns_keys else None

    def keys(self, latent: torch.Tensor, table: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """Index keys (before MXFP4) from the pre-RoPE latent, rotated at each group's first position.
        In training the input is cut from the graph: the indexer learns from its KL term alone.
        `sizes`: the entries of each sequence of a batch along the latent's second axis (the bf16
        projection then runs per sequence, as alone)."""
        if self.training:
            latent = latent.detach()
        return rotate(self.k_norm(self.wk(latent, rows=sizes)), table)

    def query(self, x: torch.Tensor, qr: torch.Tensor, table: torch.Tensor,
              sizes: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """MXFP4 index queries [b, s, heads, d] and per-head weights [b, s, heads] (bf16); in
        training the inputs are cut from the graph, as for the keys. `sizes`: as for `keys`, the
        tokens of each sequence of a batch along s."""
        if self.training:
            x, qr = x.detach(), qr.detach()
        q = self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim))
        weights = self.weights_proj(x, rows=sizes) * (self.head_dim**-0.5 * self.n_heads**-0.5)
        return mxfp4_qdq(rotate(q, table)), weights

    @staticmethod
    def scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """[b, s, n_entries] bf16 scores, every step in bf16 as the reference computes them. The
        products are `numerics.dots` of every (token, head) row with the keys: einsum's own path for
        these bf16 operands took 21 ms against 0.75 ms for 4 tokens over 64K keys (a DSpark
        verification or a prompt chunk on a long cache), with the same bits."""
        b, s, h, d = q.shape
        dots = numerics.dots(q.reshape(b, s * h, d), keys).view(b, s, h, keys.size(1))
        return weighted_head_sums(dots, weights)


class Attention(nn.Module):
    def __init__(self, t: TextConfig, spec: LayerSpec, device=None):
        super().__init__()
        self.spec = spec
        self.n_heads, self.head_dim, self.rope_dim = t.num_attention_heads, t.head_dim, t.qk_rope_head_dim
        self.window, self.n_groups, self.o_rank = t.sliding_window, t.o_groups, t.o_lora_rank
        self.candidate_blocks, self.candidate_size = t.candidate_topk_blocks, t.candidate_block_size
        eps = t.rms_norm_eps
        self.attn_sink = nn.Parameter(torch.empty(self.n_heads, dtype=torch.float32, device=device),
                                      requires_grad=False)
        self.wq_a = Linear(t.hidden_size, t.q_lora_rank, Storage.FP8, device)
        self.q_norm = RMSNorm(t.q_lora_rank, eps, device)
        self.wq_b = Linear(t.q_lora_rank, self.n_heads * self.head_dim, Storage.FP8, device)
        self.wkv = Linear(t.hidden_size, self.head_dim, Storage.FP8, device)
        self.q_and_kv = LinearsBeside(self.wq_a, self.wkv)
        self.kv_norm = RMSNorm(self.head_dim, eps, device)
        group_in = self.n_heads * self.head_dim // self.n_groups
        self.wo_a = Linear(group_in, self.n_groups * self.o_rank, Storage.BF16, device)
        self.wo_b = Linear(self.n_groups * self.o_rank, t.hidden_size, Storage.FP8, device)
        self.compressor = Compressor(t, spec.ratio, device) if spec.mode is Mode.FULL else None
        owns_index = spec.mode in (Mode.FULL, Mode.REINDEX)
        self.indexer = Indexer(t, spec.mode is Mode.FULL, device) if owns_index else None

    def forward(self, x: torch.Tensor, table: torch.Tensor, shared: SharedAttention | SharedBatch) -> torch.Tensor:
        """x [b, s, dim] after attn_norm at positions shared.start..; `table` holds RoPE rows from
        position 0 on. Without a cache only start 0; with one, any start and length (a one-token
        step on a packed cache reads it through the packed-cache kernels). A `SharedBatch` (x [1,
        sum of sizes, dim]) runs the projections once over all its tokens and attends in one call:
        one decode token per sequence through the packed-cache kernel, other batches over the keys
        each sequence's own state gives (`_attend_batch`)."""
        b, s, _ = x.shape
        rows = table[shared.positions] if isinstance(shared, SharedBatch) else table[shared.start : shared.start + s]
        qr, q, kv = self._inputs_by_loop(x, rows) or self._inputs(x, rows)
        if isinstance(shared, SharedBatch) and shared.one_decode_token_each:
            o = self._decode_packed(x, qr, q[0], kv, table, shared.parts).unsqueeze(0)
        elif isinstance(shared, SharedBatch) and self.training:
            pieces = [piece.split(shared.sizes, dim=1) for piece in (x, qr, q, kv)]
            o = torch.cat([self._attend_training(*piece, table, part)
                           for *piece, part in zip(*pieces, shared.parts, strict=True)], dim=1)
        elif isinstance(shared, SharedBatch) and shared.decode_tokens:
            o = self._attend_mixed(x, qr, q, kv, table, rows, shared)
        elif isinstance(shared, SharedBatch):
            o = self._attend_batch(x, qr, q, kv, table, rows, shared)
        else:
            o = self._attend_one(x, qr, q, kv, table, shared)
        o = rotate(o, rows, inverse=True).view(b, s, self.n_groups, -1)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_rank, -1)
        # one token of each sequence: every one's one-row GEMM in one loop call, as alone
        one_row_each = b * s == 1 or (b == 1 and bool(shared.split_sizes) and max(shared.split_sizes) == 1)
        by_rows = self.wo_a.one_row_products(o.view(b * s, self.n_groups, -1), self.n_groups) if one_row_each else None
        if by_rows is not None:
            o = by_rows.view(b, s, self.n_groups, -1)
        elif shared.split_sizes:  # each sequence through its own bf16 GEMM: its sums can change with the row count
            o = torch.cat([numerics.grouped_projection(piece, wo_a) for piece in o.split(shared.split_sizes, dim=1)],
                          dim=1)
        else:
            o = numerics.grouped_projection(o, wo_a)
        return self.wo_b(o.flatten(2))

    def _inputs(self, x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The normed low-rank query qr [b, s, q_rank], the rotated query heads q [b, s, heads,
        head_dim] and the rotated KV rows kv [b, s, head_dim] of input rows x [b, s, dim]."""
        q_low, kv = self.q_and_kv(x)
        qr = self.q_norm(q_low)
        q = rotate(self.wq_b(qr).unflatten(-1, (self.n_heads, self.head_dim)), rows)
        return qr, q, rotate(self.kv_norm(kv), rows)

    def _inputs_by_loop(self, x: torch.Tensor, rows: torch.Tensor) -> tuple | None:
        """`_inputs` in one compiled loop (`cpu_projections.attention_inputs`, about forty operator
        calls fewer a layer); None where it does not serve or a value needs the operators."""
        b, s, dim = x.shape
        if not self._inputs_loop_serves(x, rows):
            return None
        flat = x.reshape(-1, dim).contiguous().view(torch.int16)
        qr = x.new_empty(b, s, self.wq_a.out_features)
        q = x.new_empty(b, s, self.n_heads, self.head_dim)
        kv = x.new_empty(b, s, self.head_dim)
        wa_t, wa_scale_t = self.q_and_kv.joined_loop_layout()
        wb_t, wb_scale_t = self.wq_b.loop_layout()
        norms = self.q_norm, self.kv_norm
        weights = [norm.weight.view(torch.int16).numpy() for norm in norms]  # bf16 bits: numpy has no bf16
        widths = [norm_sum_width(norm.weight.size(0)) for norm in norms]
        outputs = [t.view(torch.int16).view(b * s, -1).numpy() for t in (qr, q, kv)]
        if not cpu_projections.attention_inputs(
                flat.numpy(), wa_t.numpy(), wa_scale_t.numpy(), *weights, self.q_norm.eps, *widths, wb_t.numpy(),
                wb_scale_t.numpy(), torch.view_as_real(rows.contiguous()).numpy(), self.n_heads, *outputs):
            return None
        return qr, q, kv

    def _inputs_loop_serves(self, x: torch.Tensor, rows: torch.Tensor) -> bool:
        """Whether `_inputs_by_loop` gives `_inputs`' bits: bf16 CPU rows of a decode-sized step,
        where the operators multiply every projection by the compiled loop too (`loop_serves`),
        both norms' sums and the rotation's complex products are reproduced here, and the norms
        share their eps."""
        flat = x.view(-1, x.size(-1)) if x.is_contiguous() else x.reshape(-1, x.size(-1))
        q_rank, kv_dim = self.wq_a.out_features, self.head_dim
        return (x.dtype == torch.bfloat16 and self.wq_a.scale is not None and self.wkv.scale is not None
                and self.wq_b.scale is not None and rows.dtype == torch.complex64 and rows.size(0) == x.size(1)
                and self.q_norm.eps == self.kv_norm.eps
                and not numerics.opt_in("DSV41_FAST_GEMM", "one GEMM per quantized linear")
                and loop_serves(flat, q_rank + kv_dim) and loop_serves(flat, q_rank) and loop_serves(flat, kv_dim)
                and loop_serves(flat.new_empty(flat.size(0), q_rank), self.n_heads * self.head_dim)
                and norm_sum_width(q_rank) is not None and norm_sum_width(kv_dim) is not None
                and rotation_keeps_bits(rows.size(-1)))

    def _attend_one(self, x, qr, q, kv, table, shared: SharedAttention) -> torch.Tensor:
        """One sequence's attention over its projected tokens: [b, s, heads, head_dim]."""
        if shared.start > 0 and x.size(1) == 1 and shared.cache.packed:
            return self._decode_packed(x, qr, q[:, 0], kv, table, [shared]).unsqueeze(1)
        if self.training:
            return self._attend_training(x, qr, q, kv, table, shared)
        return self._attend(x, qr, q, kv, table, shared)

    def _attend(self, x, qr, q, kv, table, shared: SharedAttention) -> torch.Tensor:
        """Attention over values in hand (a forward from position 0, or a bf16 decode cache)."""
        values, idx = self._keys_and_table(x, qr, kv, table, shared)
        return sparse_attention(q, values, self.attn_sink, idx, self.head_dim**-0.5)

    def _attend_mixed(self, x, qr, q, kv, table, rows, batch: SharedBatch) -> torch.Tensor:
        """A batch of one-token decode steps beside other work (prompt chunks, replays, longer
        steps): the decode tokens attend as they do in a batch of their own (the packed-cache
        kernel), the others as they would without them, so each sequence gets the bits it gets
        alone; the outputs go back in the batch's order."""
        decoding = batch.decode_tokens
        offsets = [0, *itertools.accumulate(batch.sizes)][:-1]
        mine = torch.tensor([offsets[i] for i in decoding])
        others = sorted(set(range(len(batch.parts))) - set(decoding))
        rest = torch.cat([torch.arange(offsets[i], offsets[i] + batch.sizes[i]) for i in others])
        stepped = self._decode_packed(x[:, mine], qr[:, mine], q[0, mine], kv[:, mine], table,
                                      [batch.parts[i] for i in decoding])
        x, qr, q, kv, rows = x[:, rest], qr[:, rest], q[:, rest], kv[:, rest], rows[rest]
        if len(others) == 1:
            rest_out = self._attend_one(x, qr, q, kv, table, batch.parts[others[0]])
        else:
            rest_out = self._attend_batch(x, qr, q, kv, table, rows, SharedBatch(
                [batch.parts[i] for i in others], [batch.sizes[i] for i in others], batch.trace))
        o = rest_out.new_empty(1, sum(batch.sizes), *rest_out.shape[2:])
        o[:, mine], o[:, rest] = stepped, rest_out
        return o

    def _attend_batch(self, x, qr, q, kv, table, rows, batch: SharedBatch) -> torch.Tensor:
        """Several sequences' tokens, any number each (x [1, sum of sizes, dim]): each sequence's
        keys and index table come from its own state, then one attention call covers them all
        (the keys side by side, each table shifted to its keys and padded with unused slots). The
        index queries of every token are computed once (their head weights per sequence)."""
        query = self.indexer.query(x, qr, rows, batch.split_sizes) if self.indexer is not None else None
        windows = self._extended_windows(kv, batch)
        emitted = self.spec.mode is Mode.FULL and self._emits_as_batch(batch.parts)
        if emitted:
            self._emit_batch_entries(x, table, batch.parts, batch.sizes)
        pieces, first = [], 0  # each sequence's window keys and table, and its chosen entry ids
        for part, size, window in zip(batch.parts, batch.sizes, windows, strict=True):
            mine = slice(first, first + size)
            own_query = None if query is None else (query[0][:, mine], query[1][:, mine])
            own_window = None if window is None else (window[0], window[1][:, mine], window[2][:, mine])
            values, idx = self._window(kv[:, mine], part, own_window)
            chosen = self._chosen_entries(x[:, mine], qr[:, mine], table, part, own_query, emitted,
                                          values.size(1)) if self.spec.ratio else None
            pieces.append((values, idx, chosen))
            first += size
        joined = [(values, idx) for values, idx, _ in pieces]
        if self.spec.ratio:
            gathered = self._gather_entries([chosen for _, _, chosen in pieces], batch.parts)
            joined = [self._with_entries(values, idx, *entries) for (values, idx), entries in zip(joined, gathered,
                                                                                                  strict=True)]
        # one attention call per table width: padding a table would lengthen its last chunk of
        # indices, and a chunk's sums in default numerics depend on its length (not in stable ones)
        by_width: dict[int, list[int]] = {}
        for i, (_, idx) in enumerate(joined):
            by_width.setdefault(0 if numerics.is_stable() else idx.size(-1), []).append(i)
        if len(by_width) == 1:
            return self._attend_joined(q, joined)
        queries, out = q.split(batch.sizes, dim=1), [None] * len(joined)
        for members in by_width.values():
            got = self._attend_joined(torch.cat([queries[i] for i in members], dim=1), [joined[i] for i in members])
            for i, rows in zip(members, got.split([batch.sizes[i] for i in members], dim=1), strict=True):
                out[i] = rows
        return torch.cat(out, dim=1)

    def _attend_joined(self, q, joined: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """One attention call over several sequences' keys [1, n_i, dim] side by side, each table
        shifted to its keys and padded with unused slots to the widest (q: their rows in order)."""
        keys, tables, offset = [], [], 0
        for values, idx in joined:
            keys.append(values)
            tables.append(torch.where(idx >= 0, idx + offset, -1))
            offset += values.size(1)
        width = max(idx.size(-1) for idx in tables)
        idx = torch.cat([F.pad(idx, (0, width - idx.size(-1)), value=-1) for idx in tables], dim=1)
        return sparse_attention(q, keys[0] if len(keys) == 1 else _fp32_rows(keys), self.attn_sink, idx,
                                self.head_dim**-0.5)

    def _extended_windows(self, kv: torch.Tensor, batch: SharedBatch) -> list[tuple | None]:
        """For each sequence of the batch that steps several tokens after position 0 (the window
        extends its ring): its ring's values before this step, and the batch's new rows as values
        (FP8) and in the rings' stored form, each quantized once for the whole batch; None for the
        others, or for all when their rings are not of one form."""
        layer = self.spec.layer_id
        extending = [part.start > 0 and size > 1 for part, size in zip(batch.parts, batch.sizes, strict=True)]
        rings = [part.cache.windows[layer] for part, on in zip(batch.parts, extending, strict=True) if on]
        if not rings or any((ring.packed, ring.fmt) != (rings[0].packed, rings[0].fmt) for ring in rings):
            return [None] * len(batch.parts)
        history = rings[0].values(torch.cat([ring.data for ring in rings])).split(1)
        new_values, new_stored = fp8_qdq(kv), rings[0].stored(kv)
        history_of = iter(history)
        return [(next(history_of), new_values, new_stored) if on else None for on in extending]

    def _keys_and_table(self, x, qr, kv, table, shared: SharedAttention, query=None, window=None,
                        emitted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys this forward attends over [b, n, head_dim] (window rows, then the chosen global
        entries) and each query's slots in them [b, s, width] (-1 unused); `query`: the indexer's
        queries of x, `window`: the `_extended_windows` entry of x, when the caller has them;
        `emitted`: a Full layer's new entries of x are already written."""
        kv, idx = self._window(kv, shared, window)
        if not self.spec.ratio:
            return kv, idx
        chosen = self._chosen_entries(x, qr, table, shared, query, emitted, kv.size(1))
        return self._with_entries(kv, idx, *self._entries(chosen, shared))

    def _chosen_entries(self, x, qr, table, shared: SharedAttention, query, emitted: bool,
                        window_keys: int) -> torch.Tensor:
        """`_global_branch`'s entry ids [b, s, k]; traced as the official code records them, after
        the `window_keys` window keys."""
        chosen = self._global_branch(x, qr, table, shared, query, produce=not emitted)
        if shared.trace is not None:
            _record(shared, self.spec.layer_id, "compress_topk_idxs",
                    torch.where(chosen >= 0, chosen + window_keys, -1))
        return chosen

    @staticmethod
    def _with_entries(kv, idx, entries, local_idx) -> tuple[torch.Tensor, torch.Tensor]:
        """Window keys and table extended by the chosen entries (local_idx: each query's positions
        in `entries`, -1 unused). The keys come back as the fp32 table the attention multiplies
        (bf16 values widen exactly), each part widened as it is copied in: joining them in bf16
        and widening the whole took two more passes over a table that a prompt chunk on a long
        cache makes of tens of thousands of entries."""
        local_idx = official_width(local_idx)
        idx = torch.cat([idx, torch.where(local_idx >= 0, local_idx + kv.size(1), -1)], dim=-1)
        return _fp32_rows([kv, entries]), idx

    def _gather_entries(self, chosen: list[torch.Tensor], parts: list[SharedAttention]) -> list[tuple]:
        """`_entries` of several sequences after position 0: the entries each one picked, read from
        the shared page pool and unpacked in one call; (values [1, n_i, head_dim], local ids) each."""
        stores = [part.main_kv[self.spec.kv_owner] for part in parts]
        if not all(isinstance(store, PagedEntries) and store.pool is stores[0].pool for store in stores) \
                or any(ids.size(0) != 1 for ids in chosen):
            return [self._entries(ids, part) for ids, part in zip(chosen, parts, strict=True)]
        unique, local = zip(*(_compacted(ids) for ids in chosen), strict=True)
        width = max(entries.numel() for entries in unique)
        ids = torch.stack([F.pad(entries, (0, width - entries.numel()), value=-1) for entries in unique])
        rows = stores[0].pool.read_rows(PagedEntries.physical_of(stores, ids).clamp(min=0))
        values = stores[0].values(rows)
        return [(values[i : i + 1, : entries.numel()], own) for i, (entries, own) in enumerate(zip(unique, local,
                                                                                                   strict=True))]

    def _attend_training(self, x, qr, q, kv, table, shared: SharedAttention) -> torch.Tensor:
        """Training (from position 0, no cache): the entries inference picks (every visible one in
        the dense warm-up) in one differentiable softmax with the sink over dense masked logits; the
        probabilities are not rounded to bf16. An indexer layer hands its KL inputs to the loss."""
        b, s, spec = x.size(0), x.size(1), self.spec
        keys = fp8_qdq(kv)
        offset = torch.arange(s).unsqueeze(1) - torch.arange(s)
        allowed = ((offset >= 0) & (offset < self.window)).expand(b, s, s)
        index_scores = None
        if spec.ratio:
            if spec.mode is Mode.FULL:
                self._emit_entries(x, table, shared)
            entries = shared.main_kv[spec.kv_owner]
            n = entries.size(1)
            visible = (torch.arange(n) < visible_entries(s, spec.ratio)).expand(b, s, n)
            if self.indexer is not None:
                index_scores = self._scores(x, qr, table, shared, n).masked_fill(~visible, -torch.inf)
                if not shared.dense_index:
                    shared.topk[spec.layer_id] = self._select(x, qr, table, shared, index_scores.detach())
                    shared.rows_start[spec.layer_id] = 0
            chosen = visible if shared.dense_index else pool_mask(shared.topk[spec.topk_producer], n)
            keys, allowed = torch.cat([keys, entries], dim=1), torch.cat([allowed, chosen], dim=-1)
        logits = numerics.einsum("bshd,btd->bsht", q, keys) * self.head_dim**-0.5
        logits = logits.masked_fill(~allowed.unsqueeze(2), -torch.inf)
        sink = self.attn_sink.view(1, 1, -1, 1).expand(b, s, -1, 1)
        probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
        if index_scores is not None and shared.index_targets is not None:
            shared.index_targets.append((index_scores, probs[..., s:].detach(), chosen))
        return numerics.einsum("bsht,btd->bshd", probs, keys)

    def _decode_packed(self, x, qr, q, kv, table, parts: list[SharedAttention]) -> torch.Tensor:
        """One decode token of each sequence read straight from packed bytes, the i-th token of
        x/qr/kv being parts[i]'s (q [B, heads, dim]): the SWA rings and the Top-k main-KV entries
        are gathered and dequantized inside one attention kernel call; the entries of every
        sequence sit in one page pool, which the kernel reads in place. The new ring rows are
        packed and the index queries computed once for the batch (both are per-row work); each
        sequence's rings, compressor and index selection then use its own state. Returns [B, heads, dim]."""
        layer, b = self.spec.layer_id, len(parts)
        key = (self.spec.kv_owner, self.spec.topk_producer)
        rings = [part.cache.windows[layer] for part in parts]
        packed = dispatch.pack_rows(kv, rings[0].fmt)
        starts = torch.tensor([part.start for part in parts])
        for i, (ring, part) in enumerate(zip(rings, parts, strict=True)):
            ring.data[:, part.start % self.window] = packed[:, i]
        slots = ring_slots(starts, self.window)
        if not self.spec.ratio:
            entry_idx = torch.empty(b, 0, dtype=torch.int32)
            main = torch.empty(b, 0, self.head_dim // 2 + self.head_dim // 16, dtype=torch.uint8)
        else:
            each = [1] * b if b > 1 else None
            query = self.indexer.query(x, qr, table[starts], each) if self.indexer is not None else None
            producer_idx = self._decode_entries(x, qr, table, parts, query)
            for i, part in enumerate(parts):
                if part.trace is not None:
                    mine = producer_idx[i : i + 1]
                    slots_of_mine = torch.where(mine >= 0, mine + self.window, -1).unsqueeze(1)
                    _record(part, layer, "compress_topk_idxs", slots_of_mine)
            stores = [part.cache.groups[self.spec.kv_owner].main_kv for part in parts]
            main = stores[0].pool.rows.expand(b, -1, -1)
            # the layers reading the same entries of the same stores (a group's Reuse layers) map
            # them to pool rows once a step, as they dequantize them once (`decode_tables`)
            entry_idx = parts[0].decode_pool_rows.get(key)
            if entry_idx is None:
                entry_idx = official_width(PagedEntries.physical_of(stores, producer_idx).int())
                parts[0].decode_pool_rows[key] = entry_idx
        ring = rings[0].data if b == 1 else torch.cat([ring.data for ring in rings])
        return dispatch.sparse_attention_decode(q, ring, slots, main, entry_idx, self.attn_sink, self.head_dim**-0.5,
                                                parts[0].decode_tables, key)

    def _window(self, kv: torch.Tensor, shared: SharedAttention, prepared=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The SWA keys this forward attends over (FP8) and each query's slots in them; kv are the
        unquantized post-RoPE rows of this forward (`prepared`: see `_window_extend`)."""
        b, s, start = kv.size(0), kv.size(1), shared.start
        cache = shared.cache
        if start == 0:
            if cache is not None:
                kept = torch.arange(max(0, s - self.window), s)
                cache.windows[self.spec.layer_id].write(kept % self.window, kv[:, kept])
            return fp8_qdq(kv), official_width(window_indices(s, self.window)).int().expand(b, -1, -1)
        ring = cache.windows[self.spec.layer_id]
        if s == 1:
            ring.write(slice(start % self.window, start % self.window + 1), kv)
            return ring.read(), ring_indices(start, self.window).int().expand(b, -1, -1)
        return self._window_extend(kv, ring, shared, prepared)

    def _window_extend(self, kv: torch.Tensor, ring, shared: SharedAttention,
                       prepared=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Several queries after position 0: the ring's history (positions from the window floor
        on) and this forward's rows; each query sees positions max(floor, p-W+1)..p. `prepared`:
        (the ring's values before this step, kv as FP8 values, kv in the ring's stored form) when
        a batch computed them for all its sequences at once."""
        b, s, start, w = kv.size(0), kv.size(1), shared.start, self.window
        first = max(shared.window_floor, start - w)
        history = torch.arange(first, start)
        ring_values, new_values, new_stored = prepared or (ring.read(), fp8_qdq(kv), None)
        values = torch.cat([ring_values[:, history % w], new_values], dim=1)
        kept = torch.arange(max(0, s - w), s)
        if new_stored is None:
            ring.write((start + kept) % w, kv[:, kept])
        else:
            ring.data[:, (start + kept) % w] = new_stored[:, kept]
        positions = (start + torch.arange(s)).unsqueeze(1) - w + 1 + torch.arange(w)
        idx = torch.where(positions >= max(first, 0), positions - first, -1)
        return values, valid_first(idx).int().expand(b, -1, -1)

    def _decode_entries(self, x, qr, table, parts: list[SharedAttention], query) -> torch.Tensor:
        """`_global_branch` of one decode token per sequence on packed caches (x [1, B, dim]):
        entry ids [B, index_topk]. Each sequence's compressor runs on its own state; the selection
        runs for the whole batch (`_select_batch`) unless a row needs the per-sequence path."""
        spec = self.spec
        untraced = all(part.trace is None for part in parts)
        if spec.mode is Mode.FULL and self._emits_as_batch(parts):
            self._emit_batch_entries(x, table, parts, [1] * len(parts))
        elif spec.mode is Mode.FULL:
            for i, part in enumerate(parts):
                self._produce_entries(x[:, i : i + 1], table, part)
        if self.indexer is not None:
            picked = self._select_batch(parts, query) if untraced else None
            for i, part in enumerate(parts):
                if picked is not None:
                    part.topk[spec.layer_id] = picked[i : i + 1]
                else:
                    mine = (query[0][:, i : i + 1], query[1][:, i : i + 1])
                    part.topk[spec.layer_id] = self._select(x[:, i : i + 1], qr[:, i : i + 1], table, part, query=mine)
                part.rows_start[spec.layer_id] = part.start
        producer = spec.topk_producer
        return torch.cat([part.topk[producer][:, part.start - part.rows_start[producer] :] for part in parts])[:, 0]

    def _emit_batch_entries(self, x, table, parts: list[SharedAttention], sizes: list[int]) -> None:
        """`_emit_entries` of a batch after position 0 (x [1, sum of sizes, dim], nothing traced):
        each compressor steps on its own state over its sequence's tokens; the index keys and
        rotation of every entry completed in this step, and their quantization into the pages, run
        once for the batch."""
        layer, ratio = self.spec.layer_id, self.spec.ratio
        latents, groups, entries = [], [], []
        for part, mine in zip(parts, x.split(sizes, dim=1), strict=True):
            group = part.cache.groups[layer]
            latent = self.compressor(mine, part.start, group)
            if latent is not None:
                latents.append(latent)
                groups += [group] * latent.size(1)
                entries += range(part.start // ratio, part.start // ratio + latent.size(1))
                part.cache.index_k_slot = layer
            part.index_k[layer], part.main_kv[layer] = group.index_k, group.main_kv
        if not latents:
            return
        latent = torch.cat(latents, dim=1)
        rows = table[torch.tensor(entries) * ratio]  # an entry sits at its group's start
        sizes = [piece.size(1) for piece in latents] if len(latents) > 1 else None
        PagedEntries.write_each([group.index_k for group in groups], entries, self.indexer.keys(latent, rows, sizes)[0])
        PagedEntries.write_each([group.main_kv for group in groups], entries, rotate(latent, rows)[0])

    @staticmethod
    def _emits_as_batch(parts: list[SharedAttention]) -> bool:
        """Whether a batch's new entries can be written as one (`_emit_batch_entries`): every
        sequence after position 0, compressing its own tokens, untraced, its pages in one pool."""
        return all(part.start > 0 and part.emit_entries and part.trace is None
                   and part.cache.pools is parts[0].cache.pools for part in parts)

    def _select_batch(self, parts: list[SharedAttention], query) -> torch.Tensor | None:
        """`_select` of one decode token per sequence, as one batch: every sequence's entries (a
        candidate consumer: its pool's) scored in one kernel call over the shared page pool, rows
        padded with unused ids, and one top-k: the set `_select` takes wherever a row has no equal
        scores at the k-th place (a row that has takes the official top-k of its own row). None (the
        per-sequence path) where a sequence has no entry yet or a pool holds fewer entries than the
        step picks, and in the official-decode compatibility mode. Returns [B, 1, index_topk] ids,
        -1 unused."""
        spec, k = self.spec, self.indexer.topk
        totals = torch.tensor([(part.start + 1) // spec.ratio for part in parts])
        if int(totals.min()) == 0 or any(part.cache.official_decode_slots for part in parts):
            return None
        wanted = totals.clamp(max=k)
        if spec.candidate_consumer:
            pools = [_compact(part.candidates[:, -1]) for part in parts]
            width = max(pool.size(-1) for pool in pools)
            ids = torch.cat([F.pad(pool, (0, width - pool.size(-1)), value=-1) for pool in pools])
            if bool(((ids >= 0).sum(-1) < wanted).any()):
                return None
        else:
            ids = torch.arange(int(totals.max())).expand(len(parts), -1)
        # unused ids: a candidate pool's padding, or the entries a shorter sequence does not have yet
        partial = spec.candidate_consumer or bool((totals < ids.size(-1)).any())
        if partial and not spec.candidate_consumer:
            ids = torch.where(ids < totals.unsqueeze(1), ids, -1)
        stores = [part.cache.groups[self._key_owner(part)].index_k for part in parts]
        keys = stores[0].pool.rows.expand(len(parts), -1, -1)
        if spec.candidate_consumer:
            rows = PagedEntries.physical_of(stores, ids)
        else:
            rows = PagedEntries.physical_of_first(stores, ids.size(-1))
            rows = torch.where(ids >= 0, rows, -1) if partial else rows
        scores = dispatch.index_scores(query[0][0], query[1][0], keys, rows)
        if partial:
            scores = scores.masked_fill(ids < 0, -torch.inf)
        self._count_scored_rows(scores, ids, parts)
        for i, part in enumerate(parts):
            if spec.candidate_source:
                part.candidates = candidate_entries(scores[i : i + 1, : int(totals[i])].unsqueeze(1), int(totals[i]),
                                                    self.candidate_blocks, self.candidate_size)
                part.candidate_source = spec.layer_id
        if all(sparse_pick_serves(scores, int(total), k) for total in totals):
            # each row's official pick from its scored places (the rows are wider than k * 64)
            picks = [official_pick(scores[i], ids[i], total, k) if spec.candidate_consumer  # a pool's places
                    else official_pick(scores[i, :total], None, total, k)  # entries 0 to total - 1
                    for i, total in enumerate(totals.tolist())]
            return torch.stack(picks).unsqueeze(1).int()
        # ids ascend along each row, unused (-1) ones last: the picked columns, in ascending order,
        # are the picked entries in ascending order with any unused ones after them
        if numerics.is_stable():
            best, tied = topk_entries(scores, min(k, ids.size(-1))), torch.zeros(len(parts), dtype=torch.bool)
        else:
            best, tied = untied_topk(scores, min(k, ids.size(-1)))
        picked = F.pad(ids.gather(-1, best), (0, max(0, k - ids.size(-1))), value=-1)
        for i in tied.nonzero().flatten().tolist():
            # a row of every entry, as wide as the sequence's own, is the official row: the top-k
            # that found the tie (per row, as on that row alone) already made the official pick
            if spec.candidate_consumer or ids.size(-1) != int(totals[i]):
                picked[i] = self._official_pick(scores[i], ids[i], int(totals[i]))
        return picked.unsqueeze(1).int()

    def _official_pick(self, scores: torch.Tensor, ids: torch.Tensor, total: int) -> torch.Tensor:
        """A decode row whose k-th place is tied: the official top-k over the full-width row the
        per-sequence path scores (entries outside ids at -inf), since which tied entry it keeps
        depends on that row. scores, ids [n] -> index_topk ids, ascending, -1 unused."""
        picked = official_pick(scores, ids, total, min(self.indexer.topk, total))
        return F.pad(picked, (0, self.indexer.topk - picked.size(-1)), value=-1)

    def _global_branch(self, x, qr, table, shared: SharedAttention, query=None, produce: bool = True) -> torch.Tensor:
        """The entry ids [b, s, k] of the group's global KV each query attends to (-1 unused);
        `query`: the indexer's queries of x when the caller has them (`Indexer.query`); `produce`:
        False when a Full layer's entries of x are already written."""
        spec = self.spec
        if spec.mode is Mode.FULL and produce:
            self._produce_entries(x, table, shared)
        if self.indexer is not None:
            shared.topk[spec.layer_id] = self._select(x, qr, table, shared, query=query)
            shared.rows_start[spec.layer_id] = shared.start
        # a producer may have run on earlier positions too (the exact prefill's staircase)
        return shared.topk[spec.topk_producer][:, shared.start - shared.rows_start[spec.topk_producer] :]

    def _produce_entries(self, x, table, shared: SharedAttention) -> None:
        """A Full layer's entries of this forward: compressed here, or already in the group."""
        if shared.emit_entries:
            self._emit_entries(x, table, shared)
        else:
            self._use_existing_entries(x, shared)

    def project_entries(self, x: torch.Tensor, table: torch.Tensor, shared: SharedAttention) -> None:
        """Only this Full layer's compressor and index keys over x (after attn_norm): how CED builds
        the decoder's global KV from the encoder output, without running the layer."""
        self._emit_entries(x, table, shared)

    def _use_existing_entries(self, x, shared: SharedAttention) -> None:
        group, total = shared.cache.groups[self.spec.layer_id], (shared.start + x.size(1)) // self.spec.ratio
        if shared.start == 0:
            shared.main_kv[self.spec.layer_id] = group.main_kv.read(slice(0, total))
            shared.index_k[self.spec.layer_id] = group.index_k.read(slice(0, total))
        else:
            shared.main_kv[self.spec.layer_id], shared.index_k[self.spec.layer_id] = group.main_kv, group.index_k

    def _entries(self, entry_idx: torch.Tensor, shared: SharedAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """Main-KV values to attend over and each query's positions in them. A forward from position
        0 has the group's entries in hand; a later step of one sequence gathers only the entries its
        queries picked (each row's entries keep their order), from the cache."""
        source = shared.main_kv[self.spec.kv_owner]
        total = (shared.start + entry_idx.size(1)) // self.spec.ratio
        if isinstance(source, torch.Tensor):  # entries produced in this forward from position 0
            return source[:, :total], entry_idx
        if entry_idx.size(1) > 1 and entry_idx.size(0) > 1:
            return source.read(slice(0, total)), entry_idx
        if entry_idx.size(1) > 1:  # only the entries some query picked: the cost does not grow with the context
            ids, local = _compacted(entry_idx)
            return source.gather(ids.unsqueeze(0)), local
        k = entry_idx.size(-1)
        local = torch.where(entry_idx >= 0, torch.arange(k, dtype=entry_idx.dtype), -1)
        return source.gather(entry_idx[:, 0]), local

    def _emit_entries(self, x, table, shared: SharedAttention) -> None:
        """Compress this forward's tokens into new entries of the group (main KV + index keys)."""
        layer, ratio, start, cache = self.spec.layer_id, self.spec.ratio, shared.start, shared.cache
        group = None if cache is None else cache.groups[layer]
        latent = self.compressor(x, start, group)
        first = start // ratio
        if latent is None:
            raw_keys = x.new_zeros(x.size(0), 0, self.indexer.head_dim)
            raw_main = x.new_zeros(x.size(0), 0, self.head_dim)
        else:
            entry_rows = table[(first + torch.arange(latent.size(1))) * ratio]  # an entry sits at its group's start
            raw_keys, raw_main = self.indexer.keys(latent, entry_rows), rotate(latent, entry_rows)
            if group is not None:
                group.index_k.write(slice(first, first + raw_keys.size(1)), raw_keys)
                group.main_kv.write(slice(first, first + raw_main.size(1)), raw_main)
                cache.index_k_slot = layer
        if start > 0:  # later layers read the group's store; the values in hand are only traced
            shared.index_k[layer], shared.main_kv[layer] = group.index_k, group.main_kv
            if shared.trace is None:
                return
        keys, main = mxfp4_qdq(raw_keys), main_kv_qdq(raw_main)
        if start == 0:
            shared.index_k[layer], shared.main_kv[layer] = keys, main
        _record(shared, layer, "main_kv", main)
        _record(shared, layer, "index_k", keys)

    def _key_owner(self, shared: SharedAttention) -> int:
        """Whose index keys this layer scores: its group's, or in official-decode compatibility a
        Full layer without a new entry reads whatever source refreshed the shared slot last."""
        spec, cache = self.spec, shared.cache
        if (cache is not None and cache.official_decode_slots and spec.mode is Mode.FULL and shared.start > 0
                and (shared.start + 1) % spec.ratio):
            return cache.index_k_slot
        return spec.kv_owner

    def _index_query(self, x, qr, table, start: int, query) -> tuple[torch.Tensor, torch.Tensor]:
        """The indexer's queries of x at positions start..: `query` when the caller has them."""
        return query if query is not None else self.indexer.query(x, qr, table[start : start + x.size(1)])

    def _scores(self, x, qr, table, shared: SharedAttention, total: int, query=None) -> torch.Tensor:
        """Index scores [b, s, total]; a packed decode step scores the packed keys in a kernel, a
        candidate consumer only the entries in the pool."""
        start, s = shared.start, x.size(1)
        q, weights = self._index_query(x, qr, table, start, query)
        owner = self._key_owner(shared)
        if start == 0:
            return self.indexer.scores(q, weights, shared.index_k[owner][:, :total])
        store = shared.cache.groups[owner].index_k
        if not shared.cache.packed or s > 1:
            return self.indexer.scores(q, weights, store.read(slice(0, total)))
        keys = store.pool.rows
        if not self.spec.candidate_consumer:
            rows = store.physical(torch.arange(total).unsqueeze(0))
            return dispatch.index_scores(q[:, 0], weights[:, 0], keys, rows).unsqueeze(1)
        ids = _compact(shared.candidates[:, -1])
        pool_scores = dispatch.index_scores(q[:, 0], weights[:, 0], keys, store.physical(ids))
        return full_width(pool_scores, ids, total).unsqueeze(1)

    def _select_in_pool(self, x, qr, table, shared: SharedAttention, total: int, query=None) -> torch.Tensor | None:
        """A candidate consumer's decode step on a packed cache: only the pool's entries are scored
        and ranked, so its cost does not grow with the context. None when the pool holds fewer
        entries than the step picks: the reference's top-k then also takes entries outside it."""
        ids, k = _compact(shared.candidates[:, -1]), min(self.indexer.topk, total)
        if int((ids >= 0).sum(-1).min()) < k:
            return None
        q, weights = self._index_query(x, qr, table, shared.start, query)
        store = shared.cache.groups[self._key_owner(shared)].index_k
        scores = dispatch.index_scores(q[:, 0], weights[:, 0], store.pool.rows, store.physical(ids))
        if shared.scored is not None:
            self._count_scored(scores, shared)
        scores = scores.masked_fill(ids < 0, -torch.inf)
        if numerics.is_stable():
            picked = ids.gather(-1, topk_entries(scores, k))  # ids ascend: the fixed policy's ties
        elif sparse_pick_serves(scores, total, k):
            picked = torch.stack([official_pick(row, mine, total, k) for row, mine in zip(scores, ids, strict=True)])
        else:
            best, tied = untied_topk(scores, k)
            picked = ids.gather(-1, best)
            for i in tied.nonzero().flatten().tolist():
                # the official top-k runs over the full-width row (entries outside the pool at
                # -inf), and which tied entry it keeps depends on that row
                picked[i] = official_pick(scores[i], ids[i], total, k)
        return F.pad(picked, (0, self.indexer.topk - k), value=-1).unsqueeze(1).int()

    def _count_scored_rows(self, scores: torch.Tensor, ids: torch.Tensor, parts: list[SharedAttention]) -> None:
        """`_count_scored` of a decode batch's rows (scores and ids [B, n], -inf and -1 where unused)
        in one reduction: each sequence's visible entries (its finite scores) or, for Reindex
        layers, its pool's (its ids in use; a decode step's pool is its one row of candidates)."""
        counted = [i for i, part in enumerate(parts) if part.scored is not None]
        if not counted:
            return
        counts = ((ids >= 0) if self.spec.candidate_consumer else torch.isfinite(scores)).sum(-1).tolist()
        key = _scored_kind(self.spec)
        for i in counted:
            parts[i].scored[key] = parts[i].scored.get(key, 0) + counts[i]

    def _count_scored(self, scores: torch.Tensor, shared: SharedAttention) -> None:
        """Entries scored: every visible one for Full layers, the pool's for Reindex layers."""
        if self.spec.candidate_consumer:
            pool = shared.candidates[:, shared.start - shared.rows_start[shared.candidate_source] :]
            n = int((pool >= 0).sum())
        else:
            n = int(torch.isfinite(scores).sum())
        key = _scored_kind(self.spec)
        shared.scored[key] = shared.scored.get(key, 0) + n

    def _select(self, x, qr, table, shared: SharedAttention, scores: torch.Tensor | None = None,
                query=None) -> torch.Tensor:
        """Entry ids [b, s, index_topk] (-1 unused); `scores` or `query` when the caller has them."""
        spec, s, start = self.spec, x.size(1), shared.start
        total = (start + s) // spec.ratio
        if total == 0:
            return torch.empty(x.size(0), s, 0, dtype=torch.int32)
        if spec.candidate_consumer and s == 1 and start > 0 and shared.cache.packed and shared.trace is None:
            picked = self._select_in_pool(x, qr, table, shared, total, query)
            if picked is not None:
                return picked
        if scores is None:
            scores = self._scores(x, qr, table, shared, total, query)
        if shared.scored is not None:
            self._count_scored(scores, shared)
        if s == 1 and start > 0:
            visible = total
        else:
            visible = visible_entries(s, spec.ratio, start)
            scores = scores.masked_fill(torch.arange(total) >= visible, -torch.inf)
        if spec.candidate_source:
            shared.candidates = candidate_entries(scores, visible, self.candidate_blocks, self.candidate_size)
            shared.candidate_source = spec.layer_id
            if shared.trace is not None:
                _record(shared, spec.layer_id, "candidates", pool_mask(shared.candidates, total))
        elif spec.candidate_consumer:
            pool = shared.candidates[:, shared.start - shared.rows_start[shared.candidate_source] :]
            scores = scores.masked_fill(~pool_mask(pool, total), -torch.inf)
        _record(shared, spec.layer_id, "index_score", scores)
        picked = official_topk(scores, min(self.indexer.topk, total))
        picked = torch.where(picked < visible, picked, -1)
        return valid_first(F.pad(picked, (0, self.indexer.topk - picked.size(-1)), value=-1)).int()


def _fp32_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Key tables [b, n_i, d] (bf16 or fp32) joined along the keys into one fp32 table, each part
    widened as it is copied in (`sparse_attention` multiplies fp32 keys)."""
    first = parts[0]
    out = first.new_empty(first.size(0), sum(part.size(1) for part in parts), first.size(2), dtype=torch.float32)
    start = 0
    for part in parts:
        out[:, start : start + part.size(1)] = part
        start += part.size(1)
    return out


def _compacted(entry_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct entry ids a table [1, s, k] picked, ascending, and the table rewritten as
    positions in them (-1 stays -1). Each row's ids ascend, so each row keeps its order."""
    ids, places = distinct_ids(entry_idx, int(entry_idx.max()) + 1 if entry_idx.numel() else 0)
    return ids, places.to(entry_idx.dtype)


def _compact(ids: torch.Tensor) -> torch.Tensor:
    """A pool's entry ids [b, p] with the unused (-1) ones moved last and dropped where every row
    has them: ascending ids, as few columns as the fullest row needs."""
    ids = valid_first(ids)
    return ids[:, : int((ids >= 0).sum(-1).max())]


def _scored_kind(spec: LayerSpec) -> str:
    if spec.mode is Mode.REINDEX:
        return "reindex"
    return "full, pool source" if spec.candidate_source else "full"


def _record(shared: SharedAttention, layer: int, name: str, value: torch.Tensor) -> None:
    if shared.trace is not None:
        shared.trace.put(layer, name, value)
