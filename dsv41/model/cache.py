"""Per-sequence state for incremental decoding.

Laid out as the official implementation keeps it: a W-slot SWA ring per layer (slot = position
mod W), and per global KV group its main KV and index keys by entry id, in fixed-size pages of a
shared pool (`pages.py`), plus the fp32 partial-group state of a ratio-m compressor. Entries are
stored either packed in their real bytes (`packed=True`: 288 B main KV, 68 B index key, 528 B SWA
entry; `dsv41/kernels/layouts.py`) or as the bf16 values the reference's fake quantization
produces. Both read back the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.config import Mode, ModelConfig
from dsv41.kernels.layouts import (
    EntryFormat,
    index_k_format,
    main_kv_format,
    swa_format,
)
from dsv41.kernels.torch_ops import gather_rows
from dsv41.model.pages import PagedEntries, PagePools, from_stored, to_stored


@dataclass
class EntryStore:
    """Rows of one kind of entry, [batch, n, ...]: packed bytes, or the bf16 values they decode to."""

    data: torch.Tensor
    fmt: EntryFormat
    packed: bool

    @classmethod
    def allocate(cls, batch: int, n: int, fmt: EntryFormat, packed: bool) -> EntryStore:
        shape, dtype = (fmt.entry_bytes, torch.uint8) if packed else (fmt.dim, torch.bfloat16)
        return cls(torch.zeros(batch, n, shape, dtype=dtype), fmt, packed)

    def write(self, rows: torch.Tensor | slice, values: torch.Tensor) -> None:
        """Quantize unquantized rows into the store (both forms hold the same values)."""
        self.data[:, rows] = self.stored(values)

    def stored(self, values: torch.Tensor) -> torch.Tensor:
        """Unquantized rows in this store's form (packed bytes, or their bf16 values)."""
        return to_stored(values, self.fmt, self.packed)

    def values(self, data: torch.Tensor) -> torch.Tensor:
        """Stored rows (of this store or another of its form) as values."""
        return from_stored(data, self.fmt, self.packed)

    def read(self, rows: slice | None = None) -> torch.Tensor:
        return self.values(self.data if rows is None else self.data[:, rows])

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """Rows by entry id idx [b, k] (-1 reads row 0; callers mask it) -> values [b, k, dim]."""
        return self.values(gather_rows(self.data, idx))

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass
class GroupCache:
    main_kv: PagedEntries  # up to capacity // m entries
    index_k: PagedEntries
    kv_state: torch.Tensor | None  # [b, m, head_dim] fp32, ratio > 1 only
    score_state: torch.Tensor | None  # [b, m, head_dim] fp32, -inf until written
    # (start, kv, gate) of the compressor's last forward on this group: its fp32 rows [b, s, head_dim]
    # of positions start.., what `truncate` rebuilds the partial group from
    step_rows: tuple[int, torch.Tensor, torch.Tensor] | None = None


def _ratio(group: GroupCache) -> int:
    return group.kv_state.size(1) if group.kv_state is not None else 1


@dataclass
class DecodeCache:
    capacity: int
    windows: dict[int, EntryStore]  # layer -> ring of W entries
    groups: dict[int, GroupCache]  # Full layer -> its group
    ids: torch.Tensor  # [b, capacity] token history (Engram looks back)
    live: torch.Tensor  # [b, capacity] False for image-span tokens
    length: int = 0
    packed: bool = False  # entries in their real bytes, read through the packed-cache kernels
    # Compatibility with the official decode path (SPEC.md §17): the official code shares index keys
    # through one slot that only an emitting source refreshes. When set, a Full layer without a new
    # entry scores against the slot's keys, as the official implementation does.
    official_decode_slots: bool = False
    index_k_slot: int | None = field(default=None)
    pools: PagePools = field(default_factory=PagePools)

    def pages_in_use(self) -> int:
        return sum(len(g.main_kv.pages) + len(g.index_k.pages) for g in self.groups.values())

    def release(self) -> None:
        """Give every page back to the pool (the sequence has ended)."""
        for group in self.groups.values():
            group.main_kv.keep(0)
            group.index_k.keep(0)

    def reserve(self, length: int, layers: set[int] | list[int] | None = None) -> None:
        """Take the pages the first `length` positions need in the groups owned by `layers` (all
        groups when None) before computing them, so that a full pool fails before any state
        changes (pages already taken stay with the sequence until it is released); raises `PoolFull`."""
        for owner, group in self.groups.items():
            if layers is None or owner in layers:
                group.main_kv.reserve(length // _ratio(group))
                group.index_k.reserve(length // _ratio(group))

    def keep_pages_for(self, length: int) -> None:
        """Give back the pages holding no entry of the first `length` positions."""
        for group in self.groups.values():
            group.main_kv.keep(length // _ratio(group))
            group.index_k.keep(length // _ratio(group))

    def global_kv_bytes_held(self) -> int:
        """Bytes of global KV the sequence holds as stored: complete entries of every group, packed
        (890 B a token on `mini`) or as the bf16 rows of an unpacked cache (several times that)."""
        return sum((self.length // _ratio(g)) * sum(_stored_bytes(s.pool.storage) for s in (g.main_kv, g.index_k))
                   for g in self.groups.values())

    def swa_bytes_held(self) -> int:
        """Bytes of the SWA rings' filled slots, as stored (FP8 entries, or bf16 rows unpacked)."""
        return sum(min(self.length, w.data.size(1)) * _stored_bytes(w.data) for w in self.windows.values())

    @classmethod
    def allocate(cls, config: ModelConfig, batch: int, capacity: int, official_decode_slots: bool = False,
                 packed: bool = False, layers: set[int] | None = None, pools: PagePools | None = None) -> DecodeCache:
        """Caches of every backbone layer, or of `layers` only (the part a component runs). Global
        KV pages come from `pools` (shared by a process's sequences) or from pools of its own."""
        if batch != 1:
            raise ValueError(f"a decode cache holds one sequence (batch 1), not {batch}")
        t = config.text_config
        if capacity > t.max_position_embeddings:
            raise ValueError(f"cache capacity {capacity} exceeds the context limit {t.max_position_embeddings}")
        swa, main, index = swa_format(t.head_dim), main_kv_format(t.head_dim), index_k_format(t.index_head_dim)
        specs = [s for s in config.plan.backbone if layers is None or s.layer_id in layers]
        windows = {s.layer_id: EntryStore.allocate(batch, t.sliding_window, swa, packed) for s in specs}
        pools = pools if pools is not None else PagePools()
        groups = {}
        for s in specs:
            if s.mode is not Mode.FULL:
                continue
            n, state = capacity // s.ratio, (batch, s.ratio, t.head_dim)
            groups[s.layer_id] = GroupCache(
                main_kv=PagedEntries(pools.pool(main, packed), n),
                index_k=PagedEntries(pools.pool(index, packed), n),
                kv_state=torch.zeros(state, dtype=torch.float32) if s.ratio > 1 else None,
                score_state=torch.full(state, -torch.inf, dtype=torch.float32) if s.ratio > 1 else None,
            )
        return cls(capacity, windows, groups, torch.zeros(batch, capacity, dtype=torch.long),
                   torch.ones(batch, capacity, dtype=torch.bool), packed=packed,
                   official_decode_slots=official_decode_slots, pools=pools)


@dataclass
class CacheCheckpoint:
    """What a forward can overwrite: the rings, the compressor states, the position counters.
    Entries past the checkpointed length are simply dropped by restoring the length."""

    length: int
    index_k_slot: int | None
    rings: dict[int, torch.Tensor]
    states: dict[int, tuple[torch.Tensor, torch.Tensor]]


def _stored_bytes(rows: torch.Tensor) -> int:
    """Bytes of one stored entry of a store whose rows are [..., entries, width]."""
    return rows.size(-1) * rows.element_size()


def checkpoint(cache: DecodeCache) -> CacheCheckpoint:
    states = {layer: (g.kv_state.clone(), g.score_state.clone()) for layer, g in cache.groups.items()
              if g.kv_state is not None}
    return CacheCheckpoint(cache.length, cache.index_k_slot, {k: w.data.clone() for k, w in cache.windows.items()},
                           states)


def restore(cache: DecodeCache, saved: CacheCheckpoint) -> None:
    """Return the cache to `saved` exactly (rolling back tokens that were verified and rejected)."""
    cache.length, cache.index_k_slot = saved.length, saved.index_k_slot
    cache.keep_pages_for(saved.length)
    for layer, ring in saved.rings.items():
        cache.windows[layer].data.copy_(ring)
    for layer, (kv, score) in saved.states.items():
        cache.groups[layer].kv_state.copy_(kv)
        cache.groups[layer].score_state.copy_(score)


def truncate(cache: DecodeCache, saved: CacheCheckpoint, length: int) -> None:
    """Cut the step run since `saved` (positions saved.length..cache.length-1) back to its first
    `length` positions in place, as if only those had been stepped: the ring slots of the dropped
    positions get the checkpoint's contents back, each compressor's partial group is rebuilt from
    the checkpoint's state and the step's rows of the kept positions, global entries and pages past
    `length` are dropped. Needs the step to be the last one and no longer than the window (so no
    kept position shares a ring slot with a dropped one)."""
    start, end = saved.length, cache.length
    if not start <= length <= end:
        raise ValueError(f"cannot truncate a step of positions {start}..{end - 1} to length {length}")
    window = next(iter(saved.rings.values())).size(1) if saved.rings else end - start
    if end - start > window:
        raise ValueError(f"a step of {end - start} positions is longer than the window of {window}")
    slots = torch.arange(length, end) % max(window, 1)
    for layer, ring in saved.rings.items():
        cache.windows[layer].data[:, slots] = ring[:, slots]
    for layer, (kv, score) in saved.states.items():
        _truncate_partial(cache.groups[layer], kv, score, start, length - start)
    cache.index_k_slot = _slot_after(cache, saved.index_k_slot, start, length)
    cache.length = length
    cache.keep_pages_for(length)


def _truncate_partial(group: GroupCache, kv: torch.Tensor, score: torch.Tensor, start: int, kept: int) -> None:
    """The partial-group state after the first `kept` rows of the group's last step from `start`."""
    group.kv_state.copy_(kv)
    group.score_state.copy_(score)
    if kept == 0:
        return
    first, rows_kv, rows_gate = group.step_rows
    if first != start or rows_kv.size(1) < kept:
        raise ValueError(f"the compressor's last rows ({rows_kv.size(1)} from position {first}) do not hold the "
                         f"{kept} kept positions from {start}: truncate right after the step")
    advance_partial(group, start, rows_kv[:, :kept], rows_gate[:, :kept])


def advance_partial(group: GroupCache, start: int, kv: torch.Tensor, gate: torch.Tensor) -> None:
    """Write compressor rows kv, gate [b, s, head_dim] of positions start.. into the partial-group
    state as `Compressor.forward` does: a one-token step after position 0 its slot, any other
    step the tail of its last group (the pending rows of the state first)."""
    m, pending = _ratio(group), start % _ratio(group)
    if start and kv.size(1) == 1:
        group.kv_state[:, pending], group.score_state[:, pending] = kv[:, 0], gate[:, 0]
        return
    kv = torch.cat([group.kv_state[:, :pending], kv], dim=1)
    gate = torch.cat([group.score_state[:, :pending], gate], dim=1)
    tail = kv.size(1) % m
    if tail:
        group.kv_state[:, :tail] = kv[:, kv.size(1) - tail :]
        group.score_state[:, :tail] = gate[:, gate.size(1) - tail :]


def _slot_after(cache: DecodeCache, saved_slot: int | None, start: int, length: int) -> int | None:
    """The shared index-key slot after stepping positions start..length-1: the last group (layers
    run in id order) that emitted an entry among them, else the slot before the step."""
    emitted = [layer for layer, group in cache.groups.items()
               if length // _ratio(group) > start // _ratio(group)]
    return max(emitted) if emitted else saved_slot


def _groups_in_order(cache: DecodeCache) -> list[tuple[int, GroupCache]]:
    return sorted(cache.groups.items())


def export_blocks(cache: DecodeCache, layout, first: int, count: int) -> list[bytes]:
    """The global KV of blocks first..first+count-1 in the stored block payload format (per group,
    owner layer ascending: main-KV entries, then indexer-K entries). Needs a packed cache."""
    if not cache.windows or not next(iter(cache.windows.values())).packed:
        raise ValueError("exporting blocks needs a packed cache (its bytes are what the store keeps)")
    out = []
    for b in range(first, first + count):
        parts = []
        for (_, group), (ratio, _, _) in zip(_groups_in_order(cache), layout.groups, strict=True):
            n = layout.block_tokens // ratio
            rows = slice(b * n, (b + 1) * n)
            parts += [group.main_kv.raw(rows).numpy().tobytes(), group.index_k.raw(rows).numpy().tobytes()]
        out.append(b"".join(parts))
    return out


def import_blocks(cache: DecodeCache, payloads: list[bytes], layout) -> None:
    """Load stored block payloads (blocks 0..len-1) into a packed cache's global KV groups."""
    from dsv41.storage.blockfmt import split

    for b, payload in enumerate(payloads):
        for (_, group), (main, index) in zip(_groups_in_order(cache), split(layout, memoryview(payload)),
                                             strict=True):
            n = main.nbytes // group.main_kv.fmt.entry_bytes
            group.main_kv.put_raw(b * n, torch.frombuffer(bytearray(main), dtype=torch.uint8).view(n, -1))
            group.index_k.put_raw(b * n, torch.frombuffer(bytearray(index), dtype=torch.uint8).view(n, -1))


def encoder_rings(cache: DecodeCache, layers: list[int]) -> bytes:
    """The SWA rings of `layers` as one snapshot (what the host pool keeps at a block boundary)."""
    return b"".join(cache.windows[layer].data.contiguous().view(torch.uint8).numpy().tobytes() for layer in layers)


def restore_encoder_rings(cache: DecodeCache, layers: list[int], snapshot: bytes) -> None:
    """Put a snapshot from `encoder_rings` back; a snapshot of another size is refused."""
    rings = [cache.windows[layer].data for layer in layers]
    sizes = [ring.numel() * ring.element_size() for ring in rings]
    if len(snapshot) != sum(sizes):
        raise ValueError(f"an SWA snapshot of {len(snapshot)} bytes does not fit rings of {sum(sizes)} bytes")
    offset = 0
    for ring, size in zip(rings, sizes, strict=True):
        raw = torch.frombuffer(bytearray(snapshot[offset : offset + size]), dtype=torch.uint8)
        ring.copy_(raw.view(ring.dtype).view(ring.shape))
        offset += size
