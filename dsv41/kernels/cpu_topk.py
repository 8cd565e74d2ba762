"""A compiled loop (numba) that gives torch's CPU top-k pick of a row that is mostly -inf without
building the row: a decode step's candidate consumer scores its pool (16K entries at 1M tokens on
`mini`) but the official pick is a top-k over the full-width row (1M wide, the pool's scores at
their entry ids, -inf elsewhere), and which of several equal scores at the k-th place it keeps
depends on that row.

How torch picks. For k * 64 <= n, torch's CPU top-k pairs each value with its index, in row order,
and runs `std::partial_sort` with "greater value first" (NaN first) as the order; the k pairs
partial_sort leaves in front are the pick. libstdc++'s partial_sort is a heap selection: a heap of
the first k pairs, then each later pair, in row order, that is strictly greater than the heap's top
(its least value) replaces the top and is sifted down. The loop below does the same moves on the
same heap layout, so ties fall as they fall there. A -inf pair never enters after the first k, so
only the first k places and the scored ones are visited: the pool's 16K scores instead of 1M.
Below k * 64 torch selects by `std::nth_element` (introselect), which the loop does not follow; its
callers also check the pick against torch's on this machine once (`selection.sparse_pick_serves`).
"""

from __future__ import annotations

import numba
import numpy as np

_NEG_INF_KEY = -0x7F80  # the ordered key of bf16 -inf
_NAN_FLOOR = 0x7F80  # a magnitude above this is a NaN


@numba.njit(cache=True, nogil=True, inline="always")
def _ordered_key(bits: np.int16) -> np.int32:
    """bf16 bits -> an int32 that orders as the value does (both zeros equal)."""
    magnitude = np.int32(bits) & np.int32(0x7FFF)
    return -magnitude if bits < 0 else magnitude


@numba.njit(cache=True, nogil=True)
def _sift(keys: np.ndarray, ids: np.ndarray, hole: int, length: int, key: np.int32, index: np.int64) -> None:
    """libstdc++'s __adjust_heap then __push_heap for the order "greater first": the hole at `hole`
    moves down along the child that is not greater, then `key` moves up from where it stopped."""
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if keys[child] > keys[child - 1]:
            child -= 1
        keys[hole], ids[hole] = keys[child], ids[child]
        hole = child
    if length % 2 == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        keys[hole], ids[hole] = keys[child - 1], ids[child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and keys[parent] > key:
        keys[hole], ids[hole] = keys[parent], ids[parent]
        hole = parent
        parent = (hole - 1) // 2
    keys[hole], ids[hole] = key, index


SKIP_BLOCK = 64  # a dense row's values checked against the heap's top a block at a time


@numba.njit(cache=True, nogil=True)
def _block_top(bits: np.ndarray, first: int, last: int) -> np.int32:
    """The largest ordered key of bits[first:last], or a key above every number's where one is NaN
    (vector code: most of a long row's blocks hold nothing above the heap's top)."""
    top = np.int32(_NEG_INF_KEY)
    nan = False
    for j in range(first, last):
        magnitude = np.int32(bits[j]) & np.int32(0x7FFF)
        nan |= magnitude > _NAN_FLOOR
        top = max(top, -magnitude if bits[j] < 0 else magnitude)
    return np.int32(0x7FFF) if nan else top


@numba.njit(cache=True, nogil=True)
def sparse_row_pick(bits: np.ndarray, positions: np.ndarray, dense: bool, k: int, out: np.ndarray) -> bool:
    """Into out [k] (int64, ascending): the indices torch's CPU top-k (k * 64 <= the row's width)
    picks from a row holding bf16 values (bits, int16 [m]) at positions [m] (ascending, -1 skipped;
    `dense`: bits is the row's start, positions unread) and -inf everywhere else. One pass, in row
    order: the first k places fill the heap, which is built when the first later place arrives;
    a dense row's later places are skipped a block at a time where none is above the heap's top.
    False, with out unset, where a value is NaN or the positions do not ascend: the caller then
    ranks the row itself."""
    keys = np.full(k, _NEG_INF_KEY, np.int32)
    ids = np.arange(k)
    previous, built = -1, False
    m = bits.shape[0]
    j = 0
    while j < m:
        if dense and built and j % SKIP_BLOCK == 0 and _block_top(bits, j, min(j + SKIP_BLOCK, m)) <= keys[0]:
            j += SKIP_BLOCK
            continue
        p = j if dense else positions[j]
        j += 1
        if p < 0:
            continue
        if p <= previous or (np.int32(bits[j - 1]) & np.int32(0x7FFF)) > _NAN_FLOOR:
            return False
        previous = p
        key = _ordered_key(bits[j - 1])
        if p < k:
            keys[p] = key
            continue
        if not built:
            for parent in range((k - 2) // 2, -1, -1):  # libstdc++'s __make_heap
                _sift(keys, ids, parent, k, keys[parent], ids[parent])
            built = True
        if key > keys[0]:
            _sift(keys, ids, 0, k, key, p)
    out[:] = np.sort(ids)  # a heap never built holds the first k places: the same set
    return True
