"""engram: token ids -> Engram rows for the encoder's Engram layers, pushed ahead of need.

The scheduler sends the prompt's ids here as soon as they exist; this component hashes the
n-grams, reads the touched rows from the memory-mapped tables (official FP8 row format, so the
tables never have to fit in RAM) and pushes them to the encoder, which by then is busy with the
prefix lookup and its first layers. The encoder then holds no Engram tables at all.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from dsv41 import messages as m
from dsv41.components.context import ComponentContext
from dsv41.components.runtime import Component, Reply
from dsv41.model.engram import EngramHasher, token_map_from_tokenizer
from dsv41.storage.engram_tables import EngramTables, write_tables


def tables_path(context: ComponentContext) -> Path:
    """The table file: the `tables` option, the checkpoint's weight file that holds them, or one
    written once for random weights."""
    given = context.option("engram", "tables", "")
    if given:
        return Path(str(given)).expanduser()
    if context.checkpoint_dir is not None:
        from dsv41.checkpoint import engram_tables_file, open_model_dir

        return engram_tables_file(open_model_dir(context.checkpoint_dir))
    spec = context.pipeline.model
    path = Path("~/.cache/dsv41/engram").expanduser() / f"{Path(spec.config).stem}-seed{spec.seed}.safetensors"
    if not path.exists():
        partial = path.with_suffix(".partial")
        write_tables(context.build_model(), partial)
        partial.rename(path)
    return path


class EngramComponent(Component):
    name = "engram"
    accepts = frozenset({m.KIND.ENGRAM_PREFETCH})

    def __init__(self, context: ComponentContext):
        super().__init__()
        t = context.config.text_config
        self.lookback, self.vocab_size = t.engram_max_ngram_size - 1, t.vocab_size
        token_map, _ = token_map_from_tokenizer(context.tokenizer)
        self.hasher = EngramHasher.build(t, token_map)
        self.tables = EngramTables(tables_path(context), list(t.engram_layer_ids))
        self.encoder = context.peer("encoder")

    @torch.inference_mode()
    def handle(self, message: m.Message, frames: list[memoryview], reply: Reply) -> None:
        ids = torch.tensor([m.unpack_ids(message.ids, self.vocab_size)])
        first = message.start - message.offset
        if not 0 <= first < ids.size(1) or (message.offset > 0 and first < self.lookback):
            raise m.MessageError(m.ErrorCode.INVALID_REQUEST, f"ids from position {message.offset} do not cover "
                                 f"the look-back of position {message.start}")
        row_ids = self.hasher(ids)[:, first:]  # [1, s, n_tables, n_cols]
        rows = torch.stack([self.tables.lookup(i, row_ids[0, :, i]) for i in range(row_ids.size(2))])
        out = m.Frames()
        self.encoder.send(m.EngramRows(request_id=message.request_id, start=message.start, rows=out.add(rows),
                                       sent_at=time.time()), out)
        self.counters["rows_pushed"] += rows.size(1)

    def close(self) -> None:
        self.encoder.close()
