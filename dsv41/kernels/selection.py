"""Top-k selection with a fixed tie policy, shared by every path (index entries and the candidate
pool's blocks).

Scores are bf16, so equal scores are common at long context. The policy: higher score first;
among equal scores the higher id (the newer entry or block) wins; -0 equals +0. That is also what
the official implementation chose at the one tie in its golden data (two candidate blocks, decode
step 14). It is one top-k over unique 64-bit keys (ordered score bits, then the id), so it costs a
top-k, not a sort, and gives the same set on every backend and for every row width.
"""

from __future__ import annotations

import torch


def _ordered(scores: torch.Tensor) -> torch.Tensor:
    bits = scores.float().contiguous().view(torch.int32).long()
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def topk_entries(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the k best entries along the last dim, in ascending id order."""
    n = scores.size(-1)
    ids = torch.arange(n, device=scores.device)
    keys = _ordered(scores) * 2**32 + ids
    return keys.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
