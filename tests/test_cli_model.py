"""`--model DIR` on the commands that take a model, and `dsv41 convert`."""

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsv41.checkpoint import load_model
from dsv41.cli.main import cli
from dsv41.export import export_model
from dsv41.model.reference import generate
from dsv41.model.tokenizer import encode, load_tokenizer

from .conftest import GOLDEN


def invoke(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def model_dir(micro, tmp_path_factory):
    return export_model(micro, micro.config, tmp_path_factory.mktemp("cli") / "micro")[0]


def test_info_kv_budget_and_flops_read_the_config_of_a_model_directory(model_dir):
    for command in (("info",), ("kv-budget", "--context", "4096"), ("flops", "--context", "4096,8192")):
        by_dir = invoke(*command, "--model", model_dir.path)
        assert by_dir.exit_code == 0, by_dir.output
        assert by_dir.output == invoke(*command, "--config", "micro").output
    both = invoke("info", "--model", model_dir.path, "--config", "micro")
    assert both.exit_code == 2 and "either --config or --model" in both.output


def test_generate_runs_the_directory_weights(model_dir):
    result = invoke("generate", "--model", model_dir.path, "--max-new-tokens", "3", "Hi")
    assert result.exit_code == 0, result.output
    model, _ = load_model(model_dir)
    tok = load_tokenizer(model_dir.path, model_dir.config.text_config.vocab_size)
    expected = list(generate(model, encode(tok, "Hi"), 3, stop_ids=model_dir.generation.eos_token_ids))
    assert result.stdout.rstrip("\n") == "Hi" + tok.decode(expected, skip_special_tokens=True)
    assert f"loading {model_dir.path}" in result.stderr


def test_convert_writes_the_release_layout(tmp_path):
    result = invoke("convert", GOLDEN, tmp_path / "hf", "--max-shard-size", "1MB")
    assert result.exit_code == 0, result.output
    assert "model-00001-of-00003.safetensors" in result.output
    assert "text_config" in json.loads((tmp_path / "hf" / "config.json").read_text())
    again = invoke("convert", GOLDEN, tmp_path / "hf")
    assert again.exit_code == 1 and "not an empty directory" in again.output
    bad = invoke("convert", GOLDEN, tmp_path / "x", "--max-shard-size", "lots")
    assert bad.exit_code == 2 and "not a size" in bad.output


def test_a_broken_model_directory_is_refused_before_anything_starts(model_dir, tmp_path):
    missing = invoke("info", "--model", tmp_path / "nowhere")
    assert missing.exit_code == 1 and "no such model directory" in missing.output
    broken = shutil.copytree(model_dir.path, tmp_path / "broken")
    (broken / "config.json").unlink()
    for command in (("generate", "x"), ("run", "inproc", "--prompt", "x"), ("serve", "inproc"),
                    ("component", "engram", "--pipeline", "inproc")):
        result = invoke(*command, "--model", broken)
        assert result.exit_code == 1 and "config.json is missing" in result.output, (command, result.output)
        assert "starting" not in result.output and "Traceback" not in result.output


@pytest.mark.timeout(120)
def test_a_pipeline_runs_a_model_directory(model_dir, tmp_path):
    runtime_dir = Path(tempfile.mkdtemp(dir="/tmp", prefix="d41m"))  # short enough for socket paths
    try:
        result = invoke("run", "inproc", "--model", model_dir.path, "--prompt", "Hello", "--max-new-tokens", "3",
                        "--prefill-mode", "full", "--store", tmp_path / "kv", "--runtime-dir", runtime_dir, "--json")
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)
    assert result.exit_code == 0, result.output
    model, _ = load_model(model_dir)
    tok = load_tokenizer(model_dir.path, model_dir.config.text_config.vocab_size)
    assert json.loads(result.stdout)["ids"] == list(generate(model, encode(tok, "Hello"), 3))
