"""The decode and prefill benchmarks build every config they name with the Engram map its
tokenizer gives, so `--config small` (whose config counts its trained tokenizer's ids) runs."""

from __future__ import annotations

import pytest
import torch

from benchmarks.decode import benchmark_model


@pytest.mark.parametrize("name", ["small", "mini"])
def test_benchmark_models_build_and_run(name):
    model = benchmark_model(name)
    with torch.inference_mode():
        logits = model(torch.tensor([[5, 6, 7]])).logits
    assert logits.shape[-1] == model.config.text_config.vocab_size and logits.isfinite().all()
