"""Generation with a decode cache: the prompt once, then one token per step (reference numerics).

This is the cached counterpart of `reference.generate`; the inference core builds CED prefill,
bounded replay and batching on top of the same per-layer decode math.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dsv41.model.cache import DecodeCache
from dsv41.model.reference import Sampling, sample_next
from dsv41.model.transformer import Transformer


@torch.inference_mode()
def cached_generate(
    model: Transformer, prompt: list[int], max_new_tokens: int, sampling: Sampling | None = None,
    packed: bool = False, stop_ids: tuple[int, ...] = (),
) -> Iterator[int]:
    """Yield new token ids; `packed` keeps the caches in their real byte formats."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    sampling = sampling or Sampling()
    cache = DecodeCache.allocate(model.config, 1, len(prompt) + max_new_tokens, packed=packed)
    gen = torch.Generator().manual_seed(sampling.seed)
    logits = model(torch.tensor([prompt]), cache=cache).logits[:, -1]
    for step in range(max_new_tokens):
        token = int(sample_next(logits, sampling, gen)[0])
        yield token
        if token in stop_ids or step == max_new_tokens - 1:
            return
        logits = model(torch.tensor([[token]]), cache=cache).logits[:, -1]
