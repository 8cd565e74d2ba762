"""Optional recording of per-layer intermediates, for tests and parity reports."""

from __future__ import annotations

import torch


class Trace(dict[str, torch.Tensor]):
    """Intermediates keyed 'layer{i}.{name}' (or a bare name for model-level tensors)."""

    def put(self, layer: int | None, name: str, value: torch.Tensor) -> None:
        self[name if layer is None else f"layer{layer}.{name}"] = value.detach().clone()
