"""The lightning indexer's training signal: KL from the main attention to the index scores.

For each query, the target is the main attention's probability mass on the global entries it
attended (summed over heads, renormalised over those entries, detached); the prediction is the
softmax of the index scores (already summed over index heads with their per-token weights, as
selection uses them) over the same entries. In the dense warm-up those are all visible entries; in
the sparse phase the selected ones. Only the indexer learns from it: its inputs are detached.
"""

from __future__ import annotations

import torch


def indexer_kl(scores: torch.Tensor, attention: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over queries with at least one attended entry of KL(target || softmax(scores)).

    scores [b, s, n] index scores; attention [b, s, heads, n] probabilities of the main attention on
    the entries; mask [b, s, n] the entries the query attended. 0 when no query has an entry.
    """
    target = attention.sum(dim=2).masked_fill(~mask, 0)
    mass = target.sum(dim=-1, keepdim=True)
    rows = mask.any(dim=-1) & (mass.squeeze(-1) > 0)
    if not bool(rows.any()):
        return scores.sum() * 0
    target = target / mass.clamp_min(torch.finfo(target.dtype).tiny)
    # rows without entries get finite dummy scores: an all -inf row would put NaN in the gradient
    logits = torch.where(mask, scores, -torch.inf).masked_fill(~rows.unsqueeze(-1), 0)
    log_q = torch.log_softmax(logits, dim=-1)
    log_p = torch.log(target.clamp_min(torch.finfo(target.dtype).tiny))
    terms = torch.where(mask & (target > 0), target * (log_p - log_q), 0)
    return terms.sum(dim=-1)[rows].mean()
