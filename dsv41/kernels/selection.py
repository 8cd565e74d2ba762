"""Top-k entry selection with a fixed tie policy, shared by every path.

Scores are bf16, so equal scores are common at long context. The policy: higher score first;
among equal scores the lower entry id (the older entry) wins; -0 equals +0. It is implemented as
one top-k over unique 64-bit keys (ordered score bits, then the inverted entry id), so it costs
a top-k, not a sort, and gives the same set on every backend.
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
    keys = _ordered(scores) * 2**32 + (2**32 - 1 - ids)
    return keys.topk(k, dim=-1, sorted=False).indices.sort(dim=-1).values
