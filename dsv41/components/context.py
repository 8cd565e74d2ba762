"""What every component is given: its pipeline, the resolved endpoints, and how to build the model.

Components of one pipeline build the same weights (the same seed, or the same checkpoint), so the
encoder and decoder processes hold the two halves of one model.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokenizers import Tokenizer

from dsv41 import messages as m
from dsv41.components.limits import pipeline_limits
from dsv41.components.runtime import Peer
from dsv41.config import ModelConfig
from dsv41.model.transformer import Transformer
from dsv41.pipelines.schema import Pipeline

COMPONENTS = ("kvstore", "tokenizer", "decoder", "encoder", "engram", "dspark")  # dependency order


@dataclass
class ComponentContext:
    pipeline: Pipeline
    endpoints: dict[str, str]
    runtime_dir: Path

    @property
    def keys_dir(self) -> Path | None:
        keys = self.pipeline.security.keys_dir
        return Path(keys).expanduser() if keys else None

    def option(self, component: str, key: str, default):
        return self.pipeline.components[component].options.get(key, default)

    def peer(self, name: str, timeout_s: float | None = None, routing_id: bytes | None = None) -> Peer:
        return Peer(self.endpoints[name], name, self.keys_dir,
                    timeout_s=timeout_s or self.pipeline.generation.request_timeout_s, limits=self.limits,
                    routing_id=routing_id)

    @cached_property
    def limits(self) -> m.Limits:
        """The largest legitimate message of each kind for this model and pipeline."""
        return pipeline_limits(self.config, self.pipeline)

    @cached_property
    def checkpoint_dir(self) -> Path | None:
        """The model directory of `model.checkpoint` (a path or a built-in model's name), if any."""
        from dsv41.checkpoint import resolve_model_dir

        checkpoint = self.pipeline.model.checkpoint
        return resolve_model_dir(checkpoint) if checkpoint else None

    @cached_property
    def config(self) -> ModelConfig:
        from dsv41.checkpoint import load_any_config, load_named_config

        if self.checkpoint_dir is not None:
            return load_any_config(self.checkpoint_dir / "config.json")[0]
        return load_named_config(self.pipeline.model.config)

    @cached_property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer.json (in the checkpoint or beside the config), else the byte stand-in."""
        from dsv41.model.tokenizer import load_tokenizer

        return load_tokenizer(self.checkpoint_dir or self.pipeline.model.config, self.config.text_config.vocab_size)

    @property
    def weights_revision(self) -> str:
        """What identifies the weights in prefix-cache keys."""
        spec = self.pipeline.model
        if self.checkpoint_dir is not None:
            files = sorted(self.checkpoint_dir.glob("*.safetensors"))
            return "checkpoint:" + ",".join(f"{f.name}:{f.stat().st_size}:{int(f.stat().st_mtime)}" for f in files)
        return f"random:{spec.config}:{spec.seed}"

    def build_model(self) -> Transformer:
        """The checkpoint's model, else the config's with seeded random weights. A checkpoint's
        model draws no random values first: loading writes every parameter or fails, so they
        would only cost start-up time (about 0.7 s per component on the default model)."""
        spec = self.pipeline.model
        if self.checkpoint_dir is None:
            from dsv41.model.reference import random_model

            return random_model(self.config, spec.seed, self.tokenizer)
        from dsv41.checkpoint import load_weights, weight_files
        from dsv41.model.engram import token_map_from_tokenizer
        from dsv41.model.transformer import build_model

        model = build_model(self.config, token_map_from_tokenizer(self.tokenizer)[0])
        load_weights(model, weight_files(self.checkpoint_dir))
        return model
