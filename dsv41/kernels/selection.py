"""Top-k selection of index entries and of the candidate pool's blocks.

Scores are bf16, so equal scores are common at long context, and where a tie straddles the k-th
place the choice decides which entries are attended. Two policies:

- `official_topk` (default numerics): torch's own top-k over a row shaped and valued exactly as the
  official code's, so ties fall as they fall there (torch's CPU top-k is deterministic for a given
  row, but which of equal scores it keeps depends on the row's width and order).
- `topk_entries` (shape-stable numerics, and rows that are not laid out as the official code lays
  them out): higher score first; among equal scores the higher id (the newer entry or block) wins;
  -0 equals +0. It is one top-k over unique 64-bit keys (ordered score bits, then the id), so it
  costs a top-k, not a sort, and gives the same set on every backend and for every row width.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from dsv41.kernels import cpu_loops, cpu_topk
from dsv41.model import numerics


def _ordered(scores: torch.Tensor) -> torch.Tensor:
    bits = scores.float().contiguous().view(torch.int32).long()
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def topk_entries(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the k best entries along the last dim, in ascending id order."""
    n = scores.size(-1)
    ids = torch.arange(n, device=scores.device)
    keys = _ordered(scores) * 2**32 + ids
    return keys.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values


def official_topk(scores: torch.Tensor, k: int, by_value: bool = False) -> torch.Tensor:
    """Ids of the k best entries along the last dim, ascending, chosen by the same torch call as the
    official code (`by_value`: the candidate-pool call, which asks for sorted values); in stable
    numerics by the fixed policy of `topk_entries`."""
    if numerics.is_stable():
        return topk_entries(scores, k)
    return scores.topk(k, dim=-1, sorted=by_value).indices.sort(dim=-1).values


def sparse_pick_serves(scores: torch.Tensor, total: int, k: int) -> bool:
    """Whether `cpu_topk.sparse_row_pick` makes the official pick of k from a row `total` wide:
    bf16 CPU scores outside stable numerics, a row where torch selects by partial sort (k * 64 <=
    total), and a machine whose torch picks as the loop does on random rows full of ties."""
    return (not numerics.is_stable() and scores.dtype == torch.bfloat16 and cpu_loops.serves(scores)
            and k > 0 and k * 64 <= total and _sparse_pick_matches_torch())


def official_pick(scores: torch.Tensor, positions: torch.Tensor | None, total: int, k: int) -> torch.Tensor:
    """`official_topk` of k from the row `total` wide that holds scores [n] at positions [n]
    (ascending entry ids, -1 unused; None: scores is the row's start) and -inf elsewhere: ids [k],
    ascending. Where `sparse_pick_serves`, the loop ranks the scored places alone; otherwise the
    row is built."""
    if sparse_pick_serves(scores, total, k):
        picked = _loop_pick(scores, positions, k)
        if picked is not None:
            return picked
    if positions is None:
        positions = torch.arange(scores.size(-1))
    return official_topk(full_width(scores.unsqueeze(0), positions.unsqueeze(0), total), k)[0]


def full_width(scores: torch.Tensor, positions: torch.Tensor, total: int) -> torch.Tensor:
    """The official rows [b, total] of scores [b, n] at positions [b, n] (entry ids, -1 unused):
    -inf at every other entry."""
    rows = torch.full((scores.size(0), total + 1), -torch.inf, dtype=scores.dtype)
    return rows.scatter(-1, torch.where(positions >= 0, positions, total).long(), scores)[:, :total]


def _loop_pick(scores: torch.Tensor, positions: torch.Tensor | None, k: int) -> torch.Tensor | None:
    """`cpu_topk.sparse_row_pick` of bf16 scores [n]; None where it hands the row back."""
    out = np.empty(k, np.int64)
    dense = positions is None
    where = np.empty(0, np.int64) if dense else positions.long().numpy()
    ranked = cpu_topk.sparse_row_pick(scores.view(torch.int16).numpy(), where, dense, k, out)
    return torch.from_numpy(out) if ranked else None


@functools.cache
def _sparse_pick_matches_torch() -> bool:
    """Whether the loop's picks are torch's on this machine: rows of a few score levels (ties at the
    k-th place in nearly every row), scored everywhere or at a few places, at two k."""
    generator = torch.Generator().manual_seed(0)
    for width, scored, k in ((4096, 4096, 64), (40000, 40000, 512), (70000, 3000, 512), (33000, 600, 512)):
        positions = torch.randperm(width, generator=generator)[:scored].sort().values
        scores = (torch.randint(0, 9, (scored,), generator=generator).float() / 4 - 1).bfloat16()
        row = torch.full((1, width), -torch.inf, dtype=torch.bfloat16)
        row[0, positions] = scores
        want = official_topk(row, k)[0]
        for picked in (_loop_pick(scores, positions, k), _loop_pick(row[0], None, k)):
            if picked is None or not torch.equal(picked, want):
                return False
    return True


def untied_topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From one top-k call: the ids of each row's k best entries, ascending, and whether the row's
    k-th and (k+1)-th best scores are equal and finite (a bool per row): the case where which
    entries are kept depends on the tie policy. Where no tie straddles the k-th place the k best are
    one set, which every policy and every top-k call names; a tied row's ids are the pick of
    `official_topk`'s own call on that row (torch ranks each row of a batch as it ranks it alone),
    for callers whose official row is another to replace. A rank of the k-th best value against the row
    (one comparison pass) stands in for a second top-k of k + 1."""
    if scores.size(-1) <= k:
        every = torch.arange(scores.size(-1)).expand(scores.shape).contiguous()
        return every, torch.zeros(scores.shape[:-1], dtype=torch.bool)
    best = scores.topk(k, dim=-1, sorted=False)
    kth = best.values.amin(dim=-1, keepdim=True)
    outside = _count_equal(scores, kth) > _count_equal(best.values, kth)
    return best.indices.sort(dim=-1).values, outside & kth.squeeze(-1).isfinite()


def _count_equal(scores: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """How many of each row's scores [..., n] equal value [..., 1]. bf16 rows compare their bits
    (a third of the time of comparing values: 0.7 against 2.2 ms at 1M scores): equal bf16 values
    have equal bits, but for the two zeros, counted both where the value is zero."""
    if scores.dtype != torch.bfloat16:
        return (scores == value).sum(dim=-1)
    bits, target = scores.view(torch.int16), value.view(torch.int16)
    count = (bits == target).sum(dim=-1)
    zero = (value == 0).squeeze(-1)
    if bool(zero.any()):
        count = count + torch.where(zero, (bits == (target ^ -32768)).sum(dim=-1), 0)  # the sign bit flipped
    return count
