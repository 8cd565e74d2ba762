import json
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from dsv41.cli.docs import render
from dsv41.cli.main import cli
from dsv41.pipelines.schema import BUILTIN_PIPELINES, COMPONENTS, load_pipeline

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"


@pytest.fixture
def runtime_dir() -> Iterator[Path]:
    """A runtime directory short enough for Unix socket paths (107 bytes), unlike pytest's tmp_path."""
    path = Path(tempfile.mkdtemp(dir="/tmp", prefix="d41cli"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args))


def start_cli(*args: str) -> subprocess.Popen:
    """`dsv41 ARGS` in its own process, for commands that run until a signal."""
    return subprocess.Popen([sys.executable, "-c", "from dsv41.cli.main import cli; cli(prog_name='dsv41')", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def read_until(proc: subprocess.Popen, needle: str) -> None:
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if needle in line:
            return
    raise AssertionError(f"exited with {proc.wait()} before printing {needle!r}:\n{''.join(seen)}")


@pytest.mark.timeout(30)
def test_validate_accepts_the_builtins_and_lists_every_problem_of_a_bad_file(tmp_path):
    result = invoke("pipeline", "validate", *BUILTIN_PIPELINES)
    assert result.exit_code == 0, result.output
    assert "ok: local (6 components, placement process)" in result.output
    assert "ok: inproc (6 components, placement thread)" in result.output

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: Bad Name\nmodel: {config: mini}\nplacement: everywhere\ncomponents:\n  tokenizer: {}\n")
    result = invoke("pipeline", "validate", "local", str(bad))
    assert result.exit_code == 1
    assert "ok: local" in result.output
    assert f"{bad}:1: name:" in result.output
    assert f"{bad}:3: placement: expected one of 'thread', 'process'" in result.output
    assert f"{bad}:4: components.kvstore: missing component" in result.output
    assert "1 of 2 pipelines invalid" in result.output and "Traceback" not in result.output


@pytest.mark.timeout(30)
def test_show_prints_the_commented_yaml_which_loads_back(tmp_path):
    result = invoke("pipeline", "show", "local")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("# local:")
    copy = tmp_path / "my.yaml"
    copy.write_text(result.output)
    assert load_pipeline(copy) == load_pipeline("local")
    assert invoke("pipeline", "show", "nope").exit_code == 2


@pytest.mark.timeout(30)
def test_keys_writes_both_pairs_and_overwrites_only_with_force(tmp_path):
    keys_dir = tmp_path / "keys"
    result = invoke("keys", str(keys_dir))
    assert result.exit_code == 0, result.output
    names = {"server.key", "server.key_secret", "client.key", "client.key_secret"}
    assert {p.name for p in keys_dir.iterdir()} == names
    assert f"keys_dir: {keys_dir}" in result.output
    before = (keys_dir / "server.key").read_bytes()

    again = invoke("keys", str(keys_dir))
    assert again.exit_code == 1 and "refusing to overwrite" in again.output and "--force" in again.output
    assert (keys_dir / "server.key").read_bytes() == before

    forced = invoke("keys", str(keys_dir), "--force")
    assert forced.exit_code == 0, forced.output
    assert (keys_dir / "server.key").read_bytes() != before


@pytest.mark.timeout(30)
def test_status_of_a_pipeline_that_is_not_running_reports_every_component_down(runtime_dir):
    result = invoke("status", "local", "--runtime-dir", str(runtime_dir), "--timeout", "0.2", "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert [row["component"] for row in report["components"]] == list(COMPONENTS)
    assert {row["state"] for row in report["components"]} == {"down"}
    assert report["components"][0]["endpoint"] == f"ipc://{runtime_dir}/tokenizer.sock"
    assert "6 of 6 components of local down" in result.output


@pytest.mark.timeout(60)
def test_run_inproc_as_json_returns_the_tokens_and_the_request_statistics(tmp_path, runtime_dir):
    result = invoke("run", "inproc", "--prompt", "Hello", "--max-new-tokens", "4", "--store", str(tmp_path / "kv"),
                    "--runtime-dir", str(runtime_dir), "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert len(out["ids"]) == 4 and out["generated_tokens"] == 4 and out["reason"] == "length"
    assert out["prompt_tokens"] > 0 and out["ttft_s"] > 0
    assert {"cached_tokens", "replayed_layer_tokens", "encoder_layer_tokens", "engram_wait_s"} <= out.keys()
    assert "inproc: dspark ready" in result.stderr
    assert (tmp_path / "kv").is_dir()


@pytest.mark.timeout(30)
def test_run_rejects_bad_requests_before_starting_anything(tmp_path):
    result = invoke("run", "inproc", "--prompt", "Hello", "--max-new-tokens", "0")
    assert result.exit_code == 2
    assert "Invalid value for '--max-new-tokens': 0 is not in the range x>=1" in result.output
    assert "give the prompt with either" in invoke("run", "inproc").output
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert "the prompt is empty" in invoke("run", "inproc", "--file", str(empty)).output
    result = invoke("run", str(tmp_path / "missing.yaml"), "--prompt", "x")
    assert result.exit_code == 1 and "not a built-in pipeline name" in result.output


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--temperature", "nan", "Invalid value for '--temperature': 'nan' is not a number"),
    ("--temperature", "inf", "Invalid value for '--temperature': inf is not in the range 0.0<=x<=100.0"),
    ("--temperature", "-1", "Invalid value for '--temperature': -1.0 is not in the range 0.0<=x<=100.0"),
    ("--top-p", "nan", "Invalid value for '--top-p': 'nan' is not a number"),
    ("--top-p", "0", "Invalid value for '--top-p': 0.0 is not in the range 0.0<x<=1.0"),
    ("--top-p", "1.5", "Invalid value for '--top-p': 1.5 is not in the range 0.0<x<=1.0"),
])
@pytest.mark.parametrize("command", [("run", "inproc", "--prompt"), ("generate",)])
def test_sampling_options_outside_their_range_are_refused(command, option, value, message):
    result = invoke(*command, "Hello", option, value)
    assert result.exit_code == 2 and message in result.output


@pytest.mark.timeout(30)
def test_a_prompt_that_is_not_utf8_is_refused_before_anything_starts(tmp_path, runtime_dir):
    """Bytes that are not UTF-8 reach the command as lone surrogates (surrogateescape)."""
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff\xfe")
    for args, message in (([b"--prompt", b"ok \xff\xfe"], "Invalid value for --prompt: not valid UTF-8 text (byte "
                                                           "0xff at character 3)"),
                          ([b"--file", bytes(bad)], "Invalid value for --file: not valid UTF-8 text (byte 0xff at "
                                                    "byte 3)")):
        done = subprocess.run([sys.executable, "-c", "from dsv41.cli.main import cli; cli(prog_name='dsv41')", "run",
                               "inproc", "--runtime-dir", str(runtime_dir), *args], capture_output=True, timeout=30)
        assert done.returncode == 2 and message in done.stderr.decode(), done.stderr.decode()
        assert b"Traceback" not in done.stderr and b"starting" not in done.stderr
    assert list(runtime_dir.iterdir()) == []


@pytest.mark.timeout(30)
def test_validate_refuses_an_alias_bomb_and_invalid_fields_by_name(tmp_path):
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("l0: &l0 [lol, lol]\n" + "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n"
                                                     for i in range(1, 10)))  # 2 * 9^9 strings once expanded
    bad = tmp_path / "bad.yaml"
    bad.write_text(load_text("local").replace("  encoder: {}", "  encoder: {options: {threads: -1}}")
                   .replace("  decoder: {}", "  decoder: {options: {kv_pages: -5}}"))
    result = invoke("pipeline", "validate", str(bomb), str(bad))
    assert result.exit_code == 1
    assert f"{bomb}:1: invalid YAML: anchors and aliases (&name, *name) are not supported" in result.output
    assert "components.encoder.options.threads: expected `int` >= 1 (value -1)" in result.output
    assert "components.decoder.options.kv_pages: expected `int` >= 1 (value -5)" in result.output


def load_text(name: str) -> str:
    return invoke("pipeline", "show", name).output


@pytest.mark.timeout(60)
def test_component_serves_in_the_foreground_and_status_sees_it(tmp_path, runtime_dir):
    proc = start_cli("component", "kvstore", "--pipeline", "local", "--runtime-dir", str(runtime_dir),
                     "--store", str(tmp_path / "kv"))
    try:
        read_until(proc, "kvstore serving at ipc://")
        result = invoke("status", "local", "--runtime-dir", str(runtime_dir), "--timeout", "0.5")
        assert result.exit_code == 1
        rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[1:]}
        assert rows["kvstore"][1:3] == ["up", str(proc.pid)]
        assert all(rows[name][1] == "down" for name in COMPONENTS if name != "kvstore")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    assert not (runtime_dir / "kvstore.sock").exists()


@pytest.mark.timeout(60)
def test_serve_stays_up_until_sigterm(tmp_path, runtime_dir):
    proc = start_cli("serve", "inproc", "--no-http", "--runtime-dir", str(runtime_dir), "--store", str(tmp_path / "kv"))
    try:
        read_until(proc, "clients connect to dspark at inproc://dsv41-inproc-dspark")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    assert "inproc stopped" in proc.stdout.read()


@pytest.mark.timeout(30)
def test_help_works_with_h_and_the_docs_are_current():
    for args in ((), ("run",), ("pipeline", "validate"), ("status",)):
        result = invoke(*args, "-h")
        assert result.exit_code == 0 and result.output.startswith("Usage: "), result.output
    assert "dsv41 run --prompt" in invoke("-h").output
    assert DOCS.read_text() == render(), "docs/cli.md is stale: run `python -m dsv41.cli.docs > docs/cli.md`"
