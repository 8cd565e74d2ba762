"""The trained default model shipped in dsv41/models/small: a release-layout directory within its
size budget, a network that has learned English and Python, and a default `dsv41 run` that answers
in the tokenizer's words."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from safetensors import safe_open

from dsv41.checkpoint import BUILTIN_MODELS_DIR, load_model, open_model_dir, resolve_model_dir
from dsv41.cli.main import cli
from dsv41.config import load_config
from dsv41.model.tokenizer import load_tokenizer
from dsv41.pipelines.schema import load_pipeline

SONNET = ("Shall I compare thee to a summer's day?\nThou art more lovely and more temperate:\n"
          "Rough winds do shake the darling buds of May,\nAnd summer's lease hath all too short a date;\n")
PYTHON = ("def read_lines(path):\n    \"\"\"Return the lines of a file without their newlines.\"\"\"\n"
          "    with open(path, encoding=\"utf-8\") as f:\n        return [line.rstrip(\"\\n\") for line in f]\n")


def test_small_is_a_release_layout_directory_of_at_most_25_mb():
    model_dir = open_model_dir("small")
    assert model_dir.path == BUILTIN_MODELS_DIR / "small" == resolve_model_dir("small")
    files = [model_dir.path / name for name in ("config.json", "generation_config.json", "tokenizer.json")]
    assert all(f.is_file() for f in files) and model_dir.tokenizer_path is not None
    assert sum(f.stat().st_size for f in model_dir.path.iterdir()) <= 25 * 10**6
    dtypes = set()
    for path in model_dir.weights_files:
        with safe_open(path, "pt") as f:
            dtypes |= {f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    assert {"F8_E4M3", "F8_E8M0"} <= dtypes  # FP8 weights with E8M0 block scales, as the release stores them
    t = model_dir.config.text_config
    layers, official = model_dir.config.plan.layers, load_config("official").plan.layers
    assert {layer.mode for layer in layers} == {layer.mode for layer in official}  # every layer kind
    assert {layer.ratio for layer in layers} == {layer.ratio for layer in official}  # both compression ratios
    assert any(layer.candidate_source for layer in layers) and any(layer.engram for layer in layers)
    assert t.sliding_window >= 64 and t.num_nextn_predict_layers == 3


def loss_per_token(model, tokenizer, text: str) -> float:
    ids = torch.tensor([[0, *tokenizer.encode(text, add_special_tokens=False).ids]])
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits.float()
    return F.cross_entropy(logits.flatten(0, 1), ids[0, 1:]).item()


@pytest.mark.timeout(120)
def test_small_has_learned_english_and_python():
    """Far below the uniform loss ln(4096) = 8.3 nats/token that untrained weights give; text the
    training corpus does not contain, written for this test."""
    model, _ = load_model("small")
    tokenizer = load_tokenizer(BUILTIN_MODELS_DIR / "small", model.config.text_config.vocab_size)
    for text in (SONNET, PYTHON):
        assert loss_per_token(model.eval(), tokenizer, text) < 0.75 * math.log(model.config.text_config.vocab_size)


def test_builtin_pipelines_run_the_small_model():
    for name in ("local", "inproc", "epd"):
        assert load_pipeline(name).model.checkpoint == "small"


@pytest.mark.timeout(180)
def test_the_default_run_answers_in_the_tokenizers_words(tmp_path):
    """The README's first command (default pipeline `local`: component processes), as JSON."""
    runtime_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="d41def"))
    try:
        result = CliRunner().invoke(cli, ["run", "--prompt", "The quick brown fox", "--max-new-tokens", "16",
                                          "--store", str(tmp_path / "kv"), "--runtime-dir", str(runtime_dir),
                                          "--json"])
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    tokenizer = load_tokenizer(BUILTIN_MODELS_DIR / "small", 4096)
    specials = {tokenizer.token_to_id(t.content) for t in tokenizer.get_added_tokens_decoder().values()}
    assert len(out["ids"]) == 16 and not specials & set(out["ids"])
    assert out["text"] == tokenizer.decode(out["ids"]) and out["text"].strip()
    assert all(c.isprintable() or c in "\n\t" for c in out["text"]), out["text"]
    pieces = [tokenizer.id_to_token(i) for i in out["ids"]]
    assert any(len(p) > 2 for p in pieces)  # whole words of the trained vocabulary, not single bytes


def test_a_component_builds_the_checkpoints_model_without_drawing_random_weights(tmp_path, monkeypatch):
    """ComponentContext.build_model of the default pipeline gives the model `load_model` gives,
    tensor for tensor, and does not run the random initialisation first (start-up time)."""
    from dsv41.components.context import ComponentContext
    from dsv41.model import random_init

    def refuse(*args, **kwargs):
        raise AssertionError("random weights drawn for a checkpoint's model")

    monkeypatch.setattr(random_init, "init_random", refuse)
    monkeypatch.setattr("dsv41.model.reference.init_random", refuse)
    built = ComponentContext(load_pipeline("local"), {}, tmp_path).build_model()
    want, got = load_model("small")[0].state_dict(), built.state_dict()

    def raw(t: torch.Tensor) -> torch.Tensor:  # float8 tensors compare as their bytes
        return t.view(torch.uint8) if t.dtype.itemsize == 1 else t

    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(raw(got[name]), raw(tensor)), name
