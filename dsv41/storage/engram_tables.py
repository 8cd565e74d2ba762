"""Engram tables on disk, read through a memory map so they never have to fit in RAM.

The file is a safetensors file holding the official tensors `layers.{L}.engram.embed.weight`
(FP8 E4M3 rows) and `.scale` (one E8M0 scale per 32 channels): a release checkpoint shard works
as it is. Only the rows a lookup touches are paged in. The values equal `EngramTable.forward`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from dsv41.model.transformer import Transformer

_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu}


def table_names(layer: int) -> tuple[str, str]:
    return f"layers.{layer}.engram.embed.weight", f"layers.{layer}.engram.embed.scale"


def write_tables(model: Transformer, path: Path) -> None:
    """Write a model's Engram tables in the official row format (for models not loaded from a
    checkpoint, such as the random built-in ones)."""
    tensors = {}
    for layer in model.config.text_config.engram_layer_ids:
        table = model.layers[layer].engram.embed
        weight, scale = table_names(layer)
        tensors[weight], tensors[scale] = table.weight.data.contiguous(), table.scale.data.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))


class EngramTables:
    def __init__(self, path: Path, layer_ids: list[int]):
        self.path, self.layer_ids = Path(path), list(layer_ids)
        header, base = self._header()
        self.weights, self.scales = [], []
        for layer in self.layer_ids:
            weight, scale = table_names(layer)
            self.weights.append(self._map(header, base, weight))
            self.scales.append(self._map(header, base, scale))

    def _header(self) -> tuple[dict, int]:
        with open(self.path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100_000_000:
                raise ValueError(f"{self.path}: not a safetensors file (header of {size} bytes)")
            return json.loads(f.read(size)), 8 + size

    def _map(self, header: dict, base: int, name: str) -> tuple[np.memmap, torch.dtype]:
        if name not in header:
            raise KeyError(f"{self.path} has no tensor {name}")
        entry = header[name]
        if entry["dtype"] not in _DTYPES:
            raise ValueError(f"{self.path}: {name} is {entry['dtype']}, expected one of {sorted(_DTYPES)}")
        rows, cols = entry["shape"]
        begin, _ = entry["data_offsets"]
        data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=base + begin, shape=(rows, cols))
        return data, _DTYPES[entry["dtype"]]

    def lookup(self, table: int, row_ids: torch.Tensor) -> torch.Tensor:
        """Rows of Engram table `table` (index into layer_ids) at row_ids [...] -> bf16 [..., head_dim]."""
        (weight, wtype), (scale, stype) = self.weights[table], self.scales[table]
        flat = row_ids.reshape(-1).numpy()
        w = torch.from_numpy(np.ascontiguousarray(weight[flat])).view(wtype)
        s = torch.from_numpy(np.ascontiguousarray(scale[flat])).view(stype)
        values = w.float().unflatten(-1, (-1, 32)) * s.float().unsqueeze(-1)
        return values.flatten(-2).to(torch.bfloat16).reshape(*row_ids.shape, -1)
