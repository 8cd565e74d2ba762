"""Global KV in fixed-size pages shared by every sequence of a process.

A group's main-KV entries and index keys live in pages of `PAGE_ENTRIES` entries (256 token
positions of a ratio-2 group, 128 of a ratio-1 group) taken from a pool as the sequence grows and
given back when it ends, so memory follows the tokens held rather than each sequence's capacity.
A sequence keeps a page table; kernels read the pool's rows through it (entry id -> pool row),
the way paged attention reads a block table. The SWA rings stay per sequence: they are bounded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv41.kernels import dispatch
from dsv41.kernels.layouts import EntryFormat, quantize_dequantize, unpack_rows

PAGE_ENTRIES = 128


def to_stored(values: torch.Tensor, fmt: EntryFormat, packed: bool) -> torch.Tensor:
    """Unquantized rows in a store's form: packed bytes, or the bf16 values those bytes decode to."""
    return (dispatch.pack_rows if packed else quantize_dequantize)(values, fmt)


def from_stored(rows: torch.Tensor, fmt: EntryFormat, packed: bool) -> torch.Tensor:
    """Stored rows (either form) as values."""
    return unpack_rows(rows, fmt) if packed else rows


class PoolFull(RuntimeError):
    """No free page is left under the pool's page limit."""


class PagePool:
    """Pages of one kind of entry (its format, packed bytes or bf16 values)."""

    def __init__(self, fmt: EntryFormat, packed: bool, page_entries: int = PAGE_ENTRIES,
                 max_pages: int | None = None):
        self.fmt, self.packed, self.page_entries, self.max_pages = fmt, packed, page_entries, max_pages
        self.width, self.dtype = (fmt.entry_bytes, torch.uint8) if packed else (fmt.dim, torch.bfloat16)
        self.storage = torch.zeros(0, page_entries, self.width, dtype=self.dtype)
        self._free: list[int] = []

    @property
    def pages_in_use(self) -> int:
        return self.storage.size(0) - len(self._free)

    @property
    def rows(self) -> torch.Tensor:
        """Every page's entries as one [1, pages * page_entries, width] view (what kernels index)."""
        return self.storage.view(1, -1, self.width)

    def read_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Stored rows at pool rows `rows` (any shape, no -1) -> [*rows.shape, width]. One
        `index_select`: indexing the pool with a tensor took 10-20x as long on the CPU (32K index
        keys from a 600K-row pool: 3.0 against 0.2 ms)."""
        return torch.index_select(self.rows[0], 0, rows.reshape(-1)).view(*rows.shape, self.width)

    def write_rows(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Stored rows values [n, width] at distinct pool rows `rows` [n] (`index_copy_`)."""
        self.rows[0].index_copy_(0, rows, values.to(self.dtype))

    def take(self, count: int) -> list[int]:
        if self.max_pages is not None and self.pages_in_use + count > self.max_pages:
            raise PoolFull(f"{self.fmt.name} page pool is full: {self.pages_in_use} of {self.max_pages} pages "
                           f"in use, {count} more asked for")
        missing = count - len(self._free)
        if missing > 0:  # grow by at least doubling, so taking pages one by one stays cheap
            have = self.storage.size(0)
            grow = max(missing, have)
            if self.max_pages is not None:
                grow = max(missing, min(grow, self.max_pages - have))
            more = torch.zeros(grow, self.page_entries, self.width, dtype=self.dtype)
            self.storage = torch.cat([self.storage, more])
            self._free.extend(range(have + grow - 1, have - 1, -1))
        return [self._free.pop() for _ in range(count)]

    def give(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


@dataclass
class PagePools:
    """The pools of one process, one per entry format and storage form, made when first asked."""

    page_entries: int = PAGE_ENTRIES
    max_pages: int | None = None  # per pool; None: grow as needed
    pools: dict[tuple[str, bool], PagePool] = field(default_factory=dict)

    def pool(self, fmt: EntryFormat, packed: bool) -> PagePool:
        key = (fmt.name, packed)
        if key not in self.pools:
            self.pools[key] = PagePool(fmt, packed, self.page_entries, self.max_pages)
        return self.pools[key]

    @property
    def pages_in_use(self) -> int:
        return sum(p.pages_in_use for p in self.pools.values())


class PagedEntries:
    """One sequence's entries of one kind, by entry id, in pages of a pool."""

    def __init__(self, pool: PagePool, capacity: int):
        self.pool, self.capacity = pool, capacity
        self.pages: list[int] = []
        self._table = torch.empty(0, dtype=torch.long)  # self.pages as a tensor, rebuilt when they change

    @property
    def fmt(self) -> EntryFormat:
        return self.pool.fmt

    @property
    def packed(self) -> bool:
        return self.pool.packed

    def reserve(self, entries: int) -> None:
        """Hold pages for the first `entries` entries (all or nothing: a full pool takes none)."""
        if entries > self.capacity:
            raise ValueError(f"{entries} {self.fmt.name} entries exceed the sequence's room for {self.capacity}")
        needed = -(-entries // self.pool.page_entries) - len(self.pages)
        if needed > 0:
            self.pages += self.pool.take(needed)
            self._table = torch.tensor(self.pages, dtype=torch.long)

    def physical(self, ids: torch.Tensor) -> torch.Tensor:
        """Pool rows of entry ids (any shape); -1 (unused) stays -1."""
        size = self.pool.page_entries
        safe = ids.long().clamp(min=0)
        return torch.where(ids >= 0, self._table[safe // size] * size + safe % size, -1)

    @staticmethod
    def physical_of(stores: list[PagedEntries], ids: torch.Tensor) -> torch.Tensor:
        """`physical` of several sequences' stores in one pool at once: ids [len(stores), k], row i
        holding ids of stores[i] (-1 stays -1)."""
        size = stores[0].pool.page_entries
        tables = torch.nn.utils.rnn.pad_sequence([store._table for store in stores], batch_first=True)
        if tables.size(1) == 0:
            return torch.full_like(ids, -1, dtype=torch.long)
        safe = ids.long().clamp(min=0)
        return torch.where(ids >= 0, tables.gather(1, safe // size) * size + safe % size, -1)

    @staticmethod
    def physical_of_first(stores: list[PagedEntries], width: int) -> torch.Tensor:
        """`physical_of` ids 0..width-1 in every row, from the page tables alone ([len(stores),
        width]; a row past its store's pages reads what the padding names: callers mask it). One
        broadcast instead of a page lookup per id: 0.3 against 4.3 ms for 512K ids."""
        size = stores[0].pool.page_entries
        tables = torch.nn.utils.rnn.pad_sequence([store._table for store in stores], batch_first=True)
        return (tables.unsqueeze(-1) * size + torch.arange(size)).flatten(1)[:, :width]

    @staticmethod
    def write_each(stores: list[PagedEntries], entries: list[int], values: torch.Tensor) -> None:
        """Row i of values [n, dim] (unquantized) as entry entries[i] of stores[i], all stores in one
        pool: the rows are quantized in one call, as `write` would quantize each."""
        for store, entry in zip(stores, entries, strict=True):
            store.reserve(entry + 1)
        pool = stores[0].pool
        rows = PagedEntries.physical_of(stores, torch.tensor(entries).unsqueeze(1))[:, 0]
        pool.write_rows(rows, to_stored(values.unsqueeze(0), pool.fmt, pool.packed)[0])

    def _span(self, rows: slice) -> torch.Tensor:
        """Pool rows of entries rows.start..rows.stop-1 (all within the pages held), from the page
        table alone: each page's rows by one broadcast, as `physical_of_first`."""
        start, size = rows.start or 0, self.pool.page_entries
        first, last = start // size, -(-rows.stop // size)
        if rows.stop > len(self.pages) * size:
            raise IndexError(f"entries up to {rows.stop} asked of {len(self.pages) * size} held")
        span = (self._table[first:last].unsqueeze(-1) * size + torch.arange(size)).flatten()
        return span[start - first * size : rows.stop - first * size]

    def write(self, rows: slice, values: torch.Tensor) -> None:
        """Quantize unquantized entries rows.start.. into the pages (both forms hold the same values)."""
        self.reserve(rows.stop)
        self.pool.write_rows(self._span(rows), to_stored(values, self.fmt, self.packed)[0])

    def raw(self, rows: slice) -> torch.Tensor:
        """Stored rows [n, width] as kept (bytes when packed)."""
        return self.pool.read_rows(self._span(rows))

    def put_raw(self, start: int, rows: torch.Tensor) -> None:
        """Store rows [n, width] already in this store's form at entries start.."""
        self.reserve(start + rows.size(0))
        self.pool.write_rows(self._span(slice(start, start + rows.size(0))), rows)

    def read(self, rows: slice) -> torch.Tensor:
        """Values [1, n, dim] of entries in `rows`."""
        return self.values(self.raw(rows).unsqueeze(0))

    def gather(self, idx: torch.Tensor) -> torch.Tensor:
        """Values [1, k, dim] by entry id idx [1, k] (-1 reads some finite row; callers mask it)."""
        return self.values(self.pool.read_rows(self.physical(idx).clamp(min=0)))

    def values(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows as stored in this store's pool (of any sequence) as values."""
        return from_stored(rows, self.fmt, self.packed)

    def keep(self, entries: int) -> None:
        """Give back the pages past the first `entries` entries (a rollback or a release)."""
        keep = -(-entries // self.pool.page_entries)
        if keep < len(self.pages):
            self.pool.give(self.pages[keep:])
            del self.pages[keep:]
            self._table = self._table[:keep]

    @property
    def nbytes(self) -> int:
        return len(self.pages) * self.pool.page_entries * self.pool.width * self.pool.storage.element_size()
