"""Prefill in three modes, then decode and verify, over one sequence's caches.

- `full`: every prompt token through all layers (the reference's behaviour, chunked).
- `ced` (default): every prompt token through the encoder only; the decoder's global KV is
  projected from the encoder output by the first decoder layer's compressor (CED); then bounded
  replay of the last W tokens through the decoder, each position seeing SWA positions
  [max(s, i-W+1), i] from the replay start s, to rebuild the decoder's SWA rings.
- `exact`: like `ced`, but the decoder runs on the staircase of positions that the last W tokens'
  SWA state really depends on, so the result equals `full`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from dsv41.config import Part
from dsv41.model import mhc
from dsv41.model.attention import SharedAttention, SharedBatch
from dsv41.model.cache import (
    DecodeCache,
    checkpoint,
    encoder_rings,
    import_blocks,
    restore,
    restore_encoder_rings,
    truncate,
)
from dsv41.model.pages import PagePools, PoolFull
from dsv41.model.rope import table_for
from dsv41.model.transformer import Transformer
from dsv41.model.vision import ImageSpan, span_mask
from dsv41.storage.blockfmt import BlockLayout

PREFILL_MODES = ("ced", "exact", "full")


@dataclass
class Counters:
    encoder_layer_tokens: int = 0
    decoder_layer_tokens: int = 0
    replayed_layer_tokens: int = 0  # layer-tokens spent rebuilding SWA state (decoder and encoder replay)
    # index scores computed, by layer kind (inside a prefill chunk this includes not-yet-visible entries)
    indexer_scored: dict[str, int] = field(default_factory=dict)
    pages_in_use: int = 0  # global KV pages the sequence holds (main KV and index keys, every group)


@dataclass
class Sequence:
    cache: DecodeCache
    counters: Counters = field(default_factory=Counters)
    snapshots: dict[int, bytes] = field(default_factory=dict)  # encoder SWA rings by position, to pool
    saved: Any = None  # the checkpoint taken before the last verification step (see `speculative.rewind`)

    def count_pages(self) -> None:
        self.counters.pages_in_use = self.cache.pages_in_use()


@dataclass
class PromptChunk:
    """Positions start..end-1 of a prompt through the encoder layers: the work a prefill asks for
    (`encode_prompt_steps`), run by `encode_chunks` alone or with other prompts' chunks."""

    seq: Sequence
    tokens: torch.Tensor  # [1, n]: the whole prompt
    start: int
    end: int
    keep_from: int  # the streams of positions from here on are returned (the decoder replay's input)
    replay: bool = False  # a cached prefix's tail: SWA positions from `start` only, no entry written
    rows_for: Callable[[int, int], dict | None] | None = None  # prefetched Engram rows of (start, end)
    spans: list[ImageSpan] | None = None

    @property
    def size(self) -> int:
        return self.end - self.start


@dataclass
class Replay:
    """A `ced` prefill's decoder half for `InferenceCore.decoder_replays`: the encoder output streams
    x of positions n - x.size(1).., every decoder layer's start, the prompt length and its spans."""

    seq: Sequence
    x: torch.Tensor
    pre_mix: torch.Tensor
    starts: list[int]
    n: int
    spans: list[ImageSpan] | None = None


class PrefetchedRows(Mapping):
    """Engram rows by table index, fetched when the first Engram layer asks (so the fetch overlaps
    the layers before it); when `fetch` gives None they are looked up here from the row ids."""

    def __init__(self, fetch: Callable[[], dict | None], row_ids: torch.Tensor, model: Transformer):
        self._fetch, self._row_ids, self._model = fetch, row_ids, model
        self._rows: dict | None = None

    def _get(self) -> dict:
        if self._rows is None:
            self._rows = self._fetch() or {
                layer.engram.table_index: layer.engram.embed(self._row_ids[:, :, layer.engram.table_index])
                for layer in self._model.layers if layer.engram is not None}
        return self._rows

    def __getitem__(self, index: int) -> torch.Tensor:
        return self._get()[index]

    def __iter__(self):
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


class ConcatenatedRows(Mapping):
    """The looked-up Engram rows of a batch, concatenated along the sequence axis when first asked."""

    def __init__(self, parts: list[Mapping]):
        self._parts, self._rows = parts, {}

    def __getitem__(self, index: int) -> torch.Tensor:
        if index not in self._rows:
            self._rows[index] = torch.cat([part[index] for part in self._parts], dim=1)
        return self._rows[index]

    def __iter__(self):
        return iter(self._parts[0])

    def __len__(self) -> int:
        return len(self._parts[0])


def _shared(parts: list[SharedAttention], sizes: list[int]) -> SharedAttention | SharedBatch:
    return parts[0] if len(parts) == 1 else SharedBatch(parts, sizes)


def image_mask(spans: list[ImageSpan] | None, start: int, length: int) -> torch.Tensor | None:
    """[1, length] True at the positions start.. inside an image span; None without spans (text)."""
    return span_mask(spans, start, length) if spans else None


def _batch_mask(spans: list | None, starts: list[int], sizes: list[int]) -> torch.Tensor | None:
    """The image mask of a batch's concatenated tokens; None when no sequence has spans."""
    if not spans or not any(spans):
        return None
    return torch.cat([span_mask(s or [], start, size) for s, start, size in zip(spans, starts, sizes, strict=True)],
                     dim=1)


class InferenceCore:
    def __init__(self, model: Transformer, chunk_size: int = 512, pools: PagePools | None = None):
        if chunk_size < 1:
            raise ValueError(f"chunk size must be at least 1, got {chunk_size}")
        self.model, self.chunk_size = model, chunk_size
        plan = model.plan
        self.encoder = [layer for layer in model.layers if layer.spec.part is Part.ENCODER]
        self.encoder_ids = [layer.spec.layer_id for layer in self.encoder]
        self.decoder = [layer for layer in model.layers if layer.spec.part is Part.DECODER]
        self.decoder_ids = [layer.spec.layer_id for layer in self.decoder]
        self.window = model.config.text_config.sliding_window
        self.pools = pools or PagePools()  # global KV pages of every sequence this core makes
        assert self.decoder[0].spec.layer_id == plan.decoder_start

    @torch.inference_mode()
    def prefill(self, ids: list[int], mode: str = "ced", capacity: int | None = None,
                packed: bool = False, spans: list[ImageSpan] | None = None) -> tuple[Sequence, torch.Tensor]:
        """Process a prompt; returns the sequence state and the logits [vocab] at its last token.
        `spans` (dsv41.model.vision.encode_images) are the prompt's image spans at their positions."""
        if mode not in PREFILL_MODES:
            raise ValueError(f"unknown prefill mode {mode!r}; use one of {PREFILL_MODES}")
        seq, _ = self.new_sequence(ids, capacity, packed)
        tokens = torch.tensor([ids])
        if mode == "full":
            return seq, self._prefill_full(seq, tokens, spans)
        return seq, self._prefill_ced(seq, tokens, exact=mode == "exact", spans=spans)

    @torch.inference_mode()
    def prefill_from_prefix(self, ids: list[int], blocks: list[bytes], layout: BlockLayout,
                            capacity: int | None = None, snapshot: bytes | None = None,
                            snapshot_at: int | None = None,
                            spans: list[ImageSpan] | None = None) -> tuple[Sequence, torch.Tensor]:
        """`ced` prefill of ids whose first len(blocks) blocks have stored global KV: the blocks
        are loaded into a packed cache and never rewritten. The encoder's SWA state at the prefix
        end comes from `snapshot` when the decoder replay needs no encoder output of the prefix,
        else from encoder replay. `snapshot_at`: also keep the encoder rings at that position."""
        seq, cached = self.new_sequence(ids, capacity, True, blocks, layout, spans=spans)
        x, pre_mix, starts = self.encode_prompt(seq, torch.tensor([ids]), False, cached, None, snapshot, snapshot_at,
                                                spans)
        return seq, self.decoder_replay(seq, x, pre_mix, starts, len(ids), spans=spans)

    def new_sequence(self, ids: list[int], capacity: int | None = None, packed: bool = False,
                     blocks: list[bytes] = (), layout: BlockLayout | None = None,
                     layers: set[int] | None = None, spans: list[ImageSpan] | None = None) -> tuple[Sequence, int]:
        """A sequence with room for the prompt (+1024 by default), its first len(blocks) blocks of
        global KV loaded from stored payloads; returns it and the number of cached tokens.
        `layers` limits the caches to the layers a part of the model runs (a component); `spans` mark
        the loaded prefix's image positions dead for Engram's look-back."""
        if not ids:
            raise ValueError("the prompt must hold at least one token")
        limit = self.model.config.text_config.max_position_embeddings
        capacity = min(capacity or len(ids) + 1024, limit)
        if len(ids) > capacity:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds the context limit of {capacity} tokens")
        cached = len(blocks) * layout.block_tokens if blocks else 0
        if blocks and cached >= len(ids):
            raise ValueError(f"a prefix of {cached} tokens needs a longer prompt than {len(ids)} tokens")
        seq = Sequence(DecodeCache.allocate(self.model.config, 1, capacity, packed=packed or bool(blocks),
                                            layers=layers, pools=self.pools))
        try:
            seq.cache.reserve(len(ids))  # a full page pool fails here, before any work
            if blocks:
                import_blocks(seq.cache, blocks, layout)
        except BaseException:
            seq.cache.release()
            raise
        if blocks:
            seq.cache.ids[:, :cached] = torch.tensor(ids[:cached])
            if spans:
                seq.cache.live[:, :cached] = ~span_mask(spans, 0, cached)
        return seq, cached

    def _chunks(self, first: int, n: int, cut: int | None = None):
        """Chunks of positions first..n-1, one of them ending at `cut` (a snapshot position)."""
        start = first
        while start < n:
            end = min(n, start + self.chunk_size)
            if cut is not None and start < cut < end:
                end = cut
            yield start, end
            start = end

    def _prefill_full(self, seq: Sequence, tokens: torch.Tensor, spans: list[ImageSpan] | None = None) -> torch.Tensor:
        for start, end in self._chunks(0, tokens.size(1)):
            logits = self.step(seq, tokens[0, start:end].tolist(), spans)
        return logits[-1]

    def _prefill_ced(self, seq: Sequence, tokens: torch.Tensor, exact: bool, cached: int = 0,
                     spans: list[ImageSpan] | None = None) -> torch.Tensor:
        x, pre_mix, starts = self.encode_prompt(seq, tokens, exact, cached, spans=spans)
        return self.decoder_replay(seq, x, pre_mix, starts, tokens.size(1), spans=spans)

    def encode_prompt(self, seq: Sequence, tokens: torch.Tensor, exact: bool, cached: int = 0, rows_for=None,
                      snapshot: bytes | None = None, snapshot_at: int | None = None,
                      spans: list[ImageSpan] | None = None):
        """`encode_prompt_steps` run to the end, one chunk at a time (see there)."""
        steps = self.encode_prompt_steps(seq, tokens, exact, cached, rows_for, snapshot, snapshot_at, spans)
        result = None
        while True:
            try:
                chunk = steps.send(result)
            except StopIteration as done:
                return done.value
            result = self.encode_chunks([chunk])[0]

    def encode_prompt_steps(self, seq: Sequence, tokens: torch.Tensor, exact: bool, cached: int = 0,
                            rows_for=None, snapshot: bytes | None = None, snapshot_at: int | None = None,
                            spans: list[ImageSpan] | None = None):
        """The encoder half of a `ced`/`exact` prefill: the encoder over tokens from `cached` on,
        CED-projecting the decoder's global KV. With a cached prefix (global KV loaded, no SWA
        state), its last W tokens are first replayed through the encoder to rebuild the encoder's
        SWA rings; their encoder outputs also feed the decoder replay when the new suffix is
        shorter than W. Returns the encoder output streams from the first decoder start on and
        every decoder layer's start. `rows_for(start, end)` supplies prefetched Engram rows (None:
        look them up here). A pooled `snapshot` of the encoder rings at `cached` replaces the encoder
        replay when the decoder replay starts inside the new tokens (the result is then exact); the
        rings at `snapshot_at` are kept in `seq.snapshots`. A generator: it yields each chunk of work
        as a `PromptChunk` and takes back what `encode_chunks` returned for it (so a scheduler can
        run decode steps of other sequences between chunks, and chunks of several prompts as one
        batch), and returns (x, pre_mix, starts). `spans`: the prompt's image spans (embeddings,
        bias_vl routing, dead for Engram), wherever a chunk or the replay meets them."""
        n = tokens.size(1)
        starts = self._decoder_starts(n, exact)
        kept = []
        if cached and snapshot is not None and starts[0] >= cached:
            restore_encoder_rings(seq.cache, self.encoder_ids, snapshot)
        elif cached:
            replay_from = max(0, cached - self.window)
            kept.append((yield PromptChunk(seq, tokens, replay_from, cached, starts[0], True, rows_for, spans)))
            seq.counters.replayed_layer_tokens += (cached - replay_from) * len(self.encoder)
        for start, end in self._chunks(cached, n, snapshot_at):
            kept.append((yield PromptChunk(seq, tokens, start, end, starts[0], False, rows_for, spans)))
            if end == snapshot_at:
                seq.snapshots[end] = encoder_rings(seq.cache, self.encoder_ids)
        x = torch.cat([k[0] for k in kept if k is not None], dim=1)
        pre_mix = torch.cat([k[1] for k in kept if k is not None], dim=1)
        seq.cache.length = n
        seq.count_pages()
        return x, pre_mix, starts

    def decoder_replay(self, seq: Sequence, x: torch.Tensor, pre_mix: torch.Tensor, starts: list[int],
                       n: int, targets: list | None = None, spans: list[ImageSpan] | None = None) -> torch.Tensor:
        """The decoder half: each decoder layer from its start to n-1 on the encoder output
        streams x (positions n - x.size(1) ..), rebuilding its SWA ring; logits [vocab] at n-1.
        `targets` collects DSpark's input of the positions each target layer runs (see
        `replay_hidden`).
        `spans` mark image positions for the MoE gates (only their positions are used)."""
        shared = SharedAttention(cache=seq.cache, emit_entries=False, scored=seq.counters.indexer_scored)
        for layer, start in zip(self.decoder, starts, strict=True):
            drop = start - (n - x.size(1))
            x, pre_mix = x[:, drop:], pre_mix[:, drop:]
            shared.start = shared.window_floor = start
            mask = image_mask(spans, start, n - start)
            x, pre_mix = self.model.run_layer(layer, x, pre_mix, shared, targets=targets, image_mask=mask)
            seq.counters.decoder_layer_tokens += n - start
            seq.counters.replayed_layer_tokens += n - start
        seq.cache.length = n
        seq.count_pages()
        return self.model.finish(x[:, -1:], pre_mix[:, -1:])[1][0, -1]

    def decoder_replays(self, replays: list[Replay]) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
        """`decoder_replay` of several sequences as one batch (the per-token work once over all
        their positions, attention per sequence); each must start every decoder layer at one
        position (`ced`). Returns each one's logits [vocab] at its last position and its DSpark
        input per target layer (for `replay_hidden`)."""
        return self.decode_batch(replays)[0]

    @torch.inference_mode()
    def decode_batch(self, replays: list[Replay], seqs: list[Sequence] = (), x: torch.Tensor | None = None,
                     pre_mix: torch.Tensor | None = None, starts: list[int] = (), sizes: list[int] = (),
                     spans: list | None = None):
        """`ced` decoder replays (`decoder_replays`) and a batched step's decoder half of other
        sequences (`decode_streams_batch`: their streams x, pre_mix concatenated) as one pass, so that
        a prefill's replay shares the per-token work of the step it runs beside; every sequence gets
        the bits it gets alone. Returns (each replay's (logits [vocab], DSpark input per target
        layer)), (the steps' logits [k_i, vocab] and DSpark inputs [k_i, 3 * dim])."""
        if any(len(set(r.starts)) != 1 for r in replays) or len(
                {id(r.seq) for r in replays} | {id(seq) for seq in seqs}) != len(replays) + len(seqs):
            raise ValueError("batched decoder replays take one per sequence, each starting every layer at once")
        for seq, start, size in zip(seqs, starts, sizes, strict=True):  # pages first: a full pool changes nothing
            self.model.check_span(start, size, seq.cache)
            seq.cache.reserve(start + size, self.decoder_ids)
        parts = [SharedAttention(start=start, cache=seq.cache, scored=seq.counters.indexer_scored)
                 for seq, start in zip(seqs, starts, strict=True)]
        xs, pre_mixes = ([] if x is None else [x]), ([] if pre_mix is None else [pre_mix])
        replay_sizes = []
        for r in replays:
            start, drop = r.starts[0], r.starts[0] - (r.n - r.x.size(1))
            xs.append(r.x[:, drop:])
            pre_mixes.append(r.pre_mix[:, drop:])
            replay_sizes.append(r.n - start)
            parts.append(SharedAttention(start=start, cache=r.seq.cache, emit_entries=False, window_floor=start,
                                         scored=r.seq.counters.indexer_scored))
        all_sizes, targets = list(sizes) + replay_sizes, []
        shared = _shared(parts, all_sizes)
        x, pre_mix = torch.cat(xs, dim=1), torch.cat(pre_mixes, dim=1)
        mask = _batch_mask(list(spans or [None] * len(seqs)) + [r.spans for r in replays],
                           list(starts) + [r.starts[0] for r in replays], all_sizes)
        for layer in self.decoder:
            x, pre_mix = self.model.run_layer(layer, x, pre_mix, shared, image_mask=mask, targets=targets)
        stepped = sum(sizes)
        replayed = []
        for i, (r, own, own_mix) in enumerate(zip(replays, x[:, stepped:].split(replay_sizes, dim=1),
                                                  pre_mix[:, stepped:].split(replay_sizes, dim=1), strict=True)):
            r.seq.counters.decoder_layer_tokens += replay_sizes[i] * len(self.decoder)
            r.seq.counters.replayed_layer_tokens += replay_sizes[i] * len(self.decoder)
            r.seq.cache.length = r.n
            r.seq.count_pages()
            logits = self.model.finish(own[:, -1:], own_mix[:, -1:])[1][0, -1]
            replayed.append((logits, [t[:, stepped:].split(replay_sizes, dim=1)[i] for t in targets]))
        if not seqs:
            return replayed, ([], [])
        for seq, start, size in zip(seqs, starts, sizes, strict=True):
            seq.counters.decoder_layer_tokens += size * len(self.decoder)
            seq.cache.length = start + size
            seq.count_pages()
        logits = self.model.finish(x[:, :stepped], pre_mix[:, :stepped], list(sizes) if len(seqs) > 1 else None)[1][0]
        hidden = torch.cat(targets, dim=-1)[0]
        return replayed, (list(logits.split(list(sizes))), list(hidden[:stepped].split(list(sizes))))

    @staticmethod
    def replay_hidden(targets: list[torch.Tensor]) -> torch.Tensor:
        """DSpark's input [r, n_targets * dim] of the last r positions every target layer ran in a
        decoder replay (an `exact` replay starts each layer at its own position)."""
        r = min(t.size(1) for t in targets)
        return torch.cat([t[0, t.size(1) - r :] for t in targets], dim=-1)

    def encode_chunks(self, chunks: list[PromptChunk]) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """Run prompt chunks (each of another sequence) through the encoder layers as one batch: the
        per-token work once over all their tokens, attention per sequence. Returns each chunk's
        streams from its keep_from on (None when it ends before). A replay runs alone."""
        return self.encode_batch(chunks)[0]

    @torch.inference_mode()
    def encode_batch(self, chunks: list[PromptChunk], seqs: list[Sequence] = (), tokens: list[list[int]] = (),
                     fetch_rows: list | None = None, spans: list | None = None):
        """Prompt chunks (`encode_chunks`) and a step's new tokens of other sequences
        (`encode_tokens_batch`) through the encoder layers as one pass, so that a prefill shares the
        per-token work (projections, mHC, MoE) of the decode step it runs beside; attention runs per
        sequence, a one-token step as in a batch of steps alone, and every sequence gets the bits it
        gets alone. Returns (each chunk's streams from its keep_from on or None, the steps' streams
        concatenated or None without steps)."""
        if len({id(chunk.seq) for chunk in chunks} | {id(seq) for seq in seqs}) != len(chunks) + len(seqs) or (
                len(chunks) + len(seqs) > 1 and any(chunk.replay for chunk in chunks)):
            raise ValueError("a batch of prompt chunks takes one chunk per sequence, and a replay alone")
        for seq, ids in zip(seqs, tokens, strict=True):  # pages first: a full pool changes nothing
            self._check_step(seq, ids)
            seq.cache.reserve(seq.cache.length + len(ids), self.encoder_ids)
        spans = list(spans or [None] * len(seqs)) + [chunk.spans for chunk in chunks]
        starts = [seq.cache.length for seq in seqs] + [chunk.start for chunk in chunks]
        sizes = [len(ids) for ids in tokens] + [chunk.size for chunk in chunks]
        fetches = list(fetch_rows or [None] * len(seqs)) + [
            None if chunk.rows_for is None else functools.partial(chunk.rows_for, chunk.start, chunk.end)
            for chunk in chunks]
        ids = [torch.tensor([t]) for t in tokens] + [chunk.tokens[:, chunk.start : chunk.end] for chunk in chunks]
        caches = [seq.cache for seq in seqs] + [chunk.seq.cache for chunk in chunks]
        parts, xs, pre_mixes, rows = [], [], [], []
        for i, (own_ids, start, size, cache, fetch, own) in enumerate(zip(ids, starts, sizes, caches, fetches, spans,
                                                                          strict=True)):
            x, pre_mix, row_ids, _ = self.model.begin(own_ids, start, cache, image_mask(own, start, size), own)
            xs.append(x)
            pre_mixes.append(pre_mix)
            rows.append(PrefetchedRows(fetch, row_ids, self.model) if fetch is not None else row_ids)
            replay = i >= len(seqs) and chunks[i - len(seqs)].replay
            scored = (seqs[i] if i < len(seqs) else chunks[i - len(seqs)].seq).counters.indexer_scored
            parts.append(SharedAttention(start=start, cache=cache, emit_entries=not replay,
                                         window_floor=start if replay else 0, scored=scored))
        shared, rows = _shared(parts, sizes), rows[0] if len(rows) == 1 else self._batch_rows(rows)
        x, pre_mix = torch.cat(xs, dim=1), torch.cat(pre_mixes, dim=1)
        mask = _batch_mask(spans, starts, sizes)
        live = None if mask is None else ~mask
        for layer in self.encoder:
            x, pre_mix = self.model.run_layer(layer, x, pre_mix, shared, rows, live, mask)
        stepped = sum(sizes[: len(seqs)])
        for seq, own_ids in zip(seqs, tokens, strict=True):
            seq.counters.encoder_layer_tokens += len(own_ids) * len(self.encoder)
            seq.cache.length += len(own_ids)
            seq.count_pages()
        steps_out = (x[:, :stepped], pre_mix[:, :stepped]) if seqs else None
        return self._finish_chunks(chunks, parts[len(seqs):], x[:, stepped:], pre_mix[:, stepped:]), steps_out

    def _finish_chunks(self, chunks: list[PromptChunk], parts: list[SharedAttention], x: torch.Tensor,
                       pre_mix: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """After the encoder layers: the decoder's global KV CED-projected from each chunk's output,
        and each chunk's streams from its keep_from on."""
        if not chunks:
            return []
        first_decoder, sizes = self.decoder[0], [chunk.size for chunk in chunks]
        x20 = None if chunks[0].replay else first_decoder.attn_norm(mhc.collapse(x, pre_mix))
        out = []
        for chunk, part, own, own_mix, own_x20 in zip(chunks, parts, x.split(sizes, dim=1),
                                                      pre_mix.split(sizes, dim=1),
                                                      [None] * len(chunks) if x20 is None else x20.split(sizes, dim=1),
                                                      strict=True):
            chunk.seq.counters.encoder_layer_tokens += chunk.size * len(self.encoder)
            if not chunk.replay:  # CED: the decoder's global KV, projected from the encoder output
                table = table_for(self.model.config.text_config, first_decoder.spec.rope, chunk.seq.cache.capacity)
                first_decoder.attn.project_entries(own_x20, table, part)
            cut = max(0, chunk.keep_from - chunk.start)
            out.append(None if chunk.end <= chunk.keep_from else (own[:, cut:], own_mix[:, cut:]))
        return out

    def _decoder_starts(self, n: int, exact: bool) -> list[int]:
        """First position each decoder layer runs on. Bounded replay: the last W tokens everywhere.
        Exact: the last layer needs exact inputs on the last W positions (its SWA ring); a layer's
        output at p is exact when its inputs are exact on [p-W+1, p], so each layer below runs
        W-1 positions further back than the one above (layer 20+j from n - W - (19-j)(W-1))."""
        w, depth = self.window, len(self.decoder)
        if not exact:
            return [max(0, n - w)] * depth
        return [max(0, n - w - (depth - 1 - j) * (w - 1)) for j in range(depth)]

    @torch.inference_mode()
    def step(self, seq: Sequence, tokens: list[int], spans: list[ImageSpan] | None = None) -> torch.Tensor:
        """Run 1..k new tokens through all layers (decode, verification of drafted tokens, or a
        chunk of a `full` prefill, with the prompt's image `spans`); returns their logits [k, vocab]."""
        return self.step_batch([seq], [tokens], [spans] if spans else None)[0]

    @torch.inference_mode()
    def step_batch(self, seqs: list[Sequence], tokens: list[list[int]],
                   spans: list | None = None) -> list[torch.Tensor]:
        """One step over several sequences of any lengths, 1..k tokens each: the per-token work
        (mHC, norms, MoE, head) runs once over all their tokens, attention per sequence. Returns
        each sequence's logits [k_i, vocab]."""
        starts = [seq.cache.length for seq in seqs]
        for seq, ids in zip(seqs, tokens, strict=True):  # both halves' pages first: a full pool changes nothing
            self._check_step(seq, ids)
            seq.cache.reserve(seq.cache.length + len(ids))
        x, pre_mix = self.encode_tokens_batch(seqs, tokens, spans=spans)
        return self.decode_streams_batch(seqs, x, pre_mix, starts, [len(t) for t in tokens], spans)[0]

    def encode_tokens(self, seq: Sequence, tokens: list[int], fetch_rows=None,
                      spans: list[ImageSpan] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder half of a step: new tokens at the next positions through layers 0..19;
        advances the cache length. `fetch_rows()` supplies prefetched Engram rows."""
        return self.encode_tokens_batch([seq], [tokens], [fetch_rows], [spans] if spans else None)

    def encode_tokens_batch(self, seqs: list[Sequence], tokens: list[list[int]], fetch_rows: list | None = None,
                            spans: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`encode_tokens` for several sequences: their streams concatenated along the sequence axis.
        `spans[i]`: sequence i's image spans (None: text only)."""
        return self.encode_batch([], seqs, tokens, fetch_rows, spans)[1]

    def _check_step(self, seq: Sequence, ids: list[int]) -> None:
        if not ids:
            raise ValueError("a step needs at least one token")
        self.model.check_span(seq.cache.length, len(ids), seq.cache)

    def _batch_rows(self, rows: list):
        """Engram rows of the batch: row ids concatenated, or lazily concatenated looked-up rows."""
        if rows[0] is None or all(isinstance(r, torch.Tensor) for r in rows):
            return None if rows[0] is None else torch.cat(rows, dim=1)
        return ConcatenatedRows([r if isinstance(r, Mapping) else PrefetchedRows(lambda: None, r, self.model)
                                 for r in rows])

    def decode_streams(self, seq: Sequence, x: torch.Tensor, pre_mix: torch.Tensor,
                       start: int, spans: list[ImageSpan] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder half of a step: encoder output streams of positions start.. through layers
        20..39 and the head; returns logits [k, vocab] and DSpark's input [k, 3 * dim]. `spans`: image
        positions among them (a chunk of a `full` prefill), for the MoE gates."""
        logits, hidden = self.decode_streams_batch([seq], x, pre_mix, [start], [x.size(1)], [spans] if spans else None)
        return logits[0], hidden[0]

    def decode_streams_batch(self, seqs: list[Sequence], x: torch.Tensor, pre_mix: torch.Tensor, starts: list[int],
                             sizes: list[int],
                             spans: list | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """`decode_streams` for several sequences whose streams are concatenated (sizes[i] each)."""
        return self.decode_batch([], seqs, x, pre_mix, starts, sizes, spans)[1]

    @staticmethod
    @torch.inference_mode()
    def checkpoint(seq: Sequence):
        """Save what the next step can overwrite, to roll rejected draft tokens back."""
        return checkpoint(seq.cache)

    @staticmethod
    @torch.inference_mode()
    def rollback(seq: Sequence, saved) -> None:
        restore(seq.cache, saved)
        seq.count_pages()

    @staticmethod
    @torch.inference_mode()
    def truncate(seq: Sequence, saved, length: int) -> None:
        """Keep only the first `length` positions of the step taken after checkpoint `saved` (the
        accepted part of a verification step), without running anything again: every cache then
        holds what a step of only those positions leaves (bit for bit in shape-stable numerics).
        The hidden rows and logits of the kept positions are the step's own rows."""
        truncate(seq.cache, saved, length)
        seq.count_pages()

    @torch.inference_mode()
    def warm_up(self, tokens: int = 64) -> None:
        """Prefill and step a throwaway sequence, then drop it. The first calls of each layer build
        what later calls reuse (dequantized weights, stacked experts, RoPE tables, the allocator's
        blocks): on the default model about 0.4 s that would otherwise land on the first request's
        time to first token. It steps one token, then as many as a DSpark verification takes:
        with a cold cache of compiled loops (a fresh install) the first `dsv41 run` otherwise
        compiled the verification's loops in its first rounds, and DSpark, timing them, drafted
        little (11.9 against 24.2 tokens/s). Pools or contexts too small for it are left alone."""
        verify = self.model.config.text_config.dspark_block_size + 1  # a DSpark verification's tokens
        tokens = min(tokens, self.model.config.text_config.max_position_embeddings - 1 - verify)
        if tokens < 1:
            return
        try:
            seq, logits = self.prefill([1] * tokens, capacity=tokens + 1 + verify, packed=True)
        except PoolFull:
            return
        try:
            self.step(seq, [int(logits.argmax())])
            self.step(seq, [int(logits.argmax())] * verify)
        except PoolFull:
            pass
        finally:
            self.release(seq)

    @staticmethod
    def release(seq: Sequence) -> None:
        """The sequence has ended: its global KV pages go back to the pool."""
        seq.cache.release()
        seq.count_pages()

    @property
    def pages_in_use(self) -> int:
        """Global KV pages held by all live sequences of this core."""
        return self.pools.pages_in_use
