"""A `dsv41 train` checkpoint as a served model: its fp32 masters back in a model, and that model
written as a model directory in the release layout (weights quantised to the storage formats)."""

from __future__ import annotations

import tempfile
from pathlib import Path

from tokenizers import Tokenizer

from dsv41.checkpoint import GenerationConfig
from dsv41.config import ModelConfig, config_from_dict
from dsv41.export import ModelDir, export_model
from dsv41.model.engram import token_map_from_tokenizer
from dsv41.model.transformer import Transformer, build_model
from dsv41.training.loop import CHECKPOINT_FORMAT, read_checkpoint
from dsv41.training.master import inference_state, to_training


def load_trained(path: str | Path) -> tuple[Transformer, ModelConfig, Tokenizer, int]:
    """The trainable model (fp32 masters, eval mode), its config and tokenizer, and its step."""
    state = read_checkpoint(path, CHECKPOINT_FORMAT, "dsv41 training")
    config = config_from_dict(state["config"])
    tokenizer = Tokenizer.from_str(state["tokenizer"])
    token_map, _ = token_map_from_tokenizer(tokenizer)
    model = to_training(build_model(config, token_map))
    model.load_state_dict(state["model"])
    return model.eval(), config, tokenizer, int(state["step"])


def export_trained(path: str | Path, out_dir: str | Path, *, generation: GenerationConfig | None = None,
                   max_shard_size: int | str | None = None) -> tuple[ModelDir, int]:
    """Write the checkpoint at `path` as a model directory; returns it and the training step."""
    model, config, tokenizer, step = load_trained(path)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_path = Path(tmp) / "tokenizer.json"
        tokenizer.save(str(tokenizer_path))
        written, _ = export_model(inference_state(model), config, out_dir, tokenizer_path,
                                  generation=generation, max_shard_size=max_shard_size)
    return written, step
