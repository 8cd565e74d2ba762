"""The oracle: every position through every layer, no caches, no shortcuts.

Every fast path of dsv41 (CED prefill, bounded replay, packed caches, kernels, IPC) is tested
against `logits` and `generate` here. Generation re-runs the whole sequence for each new token.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from dsv41.config import ModelConfig, load_config
from dsv41.model.engram import token_map_from_tokenizer
from dsv41.model.random_init import init_random
from dsv41.model.tokenizer import byte_tokenizer
from dsv41.model.trace import Trace
from dsv41.model.transformer import ForwardOutput, Transformer, build_model


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; otherwise softmax(logits / T) truncated to the top-p mass."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


def sample_next(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None) -> torch.Tensor:
    """logits [b, vocab] fp32 -> token ids [b]."""
    if sampling.temperature == 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / max(sampling.temperature, 1e-5), dim=-1, dtype=torch.float32)
    if sampling.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above each token
        sorted_probs = sorted_probs.masked_fill(before >= sampling.top_p, 0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.inference_mode()
def forward(model: Transformer, ids: torch.Tensor, trace: Trace | None = None, spans=None) -> ForwardOutput:
    """All positions of ids [b, s] (s within the context limit), no cache; `spans` are image spans
    (dsv41.model.vision.encode_image) at their positions."""
    return model(ids, trace=trace, spans=spans)


@torch.inference_mode()
def generate(
    model: Transformer, prompt: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
    stop_ids: tuple[int, ...] = (), spans=None,
) -> Iterator[int]:
    """Yield new token ids one by one, re-running the full sequence for each."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    gen = torch.Generator().manual_seed(sampling.seed)
    ids = list(prompt)
    for _ in range(max_new_tokens):
        logits = forward(model, torch.tensor([ids]), spans=spans).logits[:, -1]
        token = int(sample_next(logits, sampling, gen)[0])
        yield token
        if token in stop_ids:
            return
        ids.append(token)


def random_model(config: ModelConfig | str, seed: int = 0, tokenizer: Tokenizer | None = None) -> Transformer:
    """A model with seeded random weights and the Engram map of `tokenizer` (default: the byte stand-in)."""
    if isinstance(config, str):
        config = load_config(config)
    token_map, _ = token_map_from_tokenizer(tokenizer or byte_tokenizer(config.text_config.vocab_size))
    return init_random(build_model(config, token_map), seed)
