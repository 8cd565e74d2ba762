import re

from click.testing import CliRunner

from dsv41.cli.main import cli


def test_info_official_builds_on_meta_and_reports_spec_totals():
    result = CliRunner().invoke(cli, ["info", "--config", "official"])
    assert result.exit_code == 0, result.output
    out = result.output

    def billions(label: str) -> float:
        return float(re.search(rf"^{label}\s+([\d.]+) B", out, re.M).group(1))

    # SPEC.md §10.3: backbone ≈ 552B, routed 543.58B, Engram tables 196.61B (within 1 %)
    assert abs(billions("backbone") / 552 - 1) < 0.01
    assert abs(billions("routed experts") / 543.58 - 1) < 0.01
    assert abs(billions("engram tables") / 196.61 - 1) < 0.01
    assert "total global KV per token: 890 B" in out
    assert out.count(" reuse ") == 30 and out.count(" reindex ") == 4


def test_generate_micro_prints_text_and_speed():
    result = CliRunner().invoke(cli, ["generate", "--config", "micro", "--max-new-tokens", "3", "Hi"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("Hi")
    assert re.search(r"\d+ tokens in [\d.]+ s: [\d.]+ tokens/s", result.stderr)


def test_cli_errors_are_readable(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"text_config": {}}')
    result = CliRunner().invoke(cli, ["info", "--config", str(bad)])
    assert result.exit_code == 1
    assert "missing required field" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(cli, ["generate", "--config", "official", "x"])
    assert result.exit_code == 1 and "too large" in result.output
    result = CliRunner().invoke(cli, ["generate", "--config", "micro", "--top-p", "0", "x"])
    assert result.exit_code == 2 and "top-p" in result.output


def test_kv_budget_matches_the_plan_and_prints_the_v4_comparison():
    result = CliRunner().invoke(cli, ["kv-budget", "--config", "official", "--context", "1000000",
                                      "--context", "1048576"])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "global KV per token: 890 B (main KV 720 + indexer K 170)" in out
    assert "ratio 0.2533" in out
    assert re.search(r"layer 20\s+decoder\s+1\s+288\s+68\s+356", out)
    assert len(re.findall(r"layer (2|8|14)\s+encoder\s+2\s+144\s+34\s+178", out)) == 3
    assert re.search(r"1000000\s+720,000,000\s+170,000,000\s+890,000,000\s+0\.829", out)
    assert re.search(r"1048576\s+754,974,720\s+178,257,920\s+933,232,640\s+0\.869", out)
    mini = CliRunner().invoke(cli, ["kv-budget", "--config", "mini"]).stdout
    assert "global KV per token: 890 B" in mini


def test_flops_grow_only_through_the_indexers():
    from dsv41.config import load_config
    from dsv41.engine.flops import decode_token_flops

    config = load_config("official")
    short, long = decode_token_flops(config, 4096), decode_token_flops(config, 1_048_576)
    changed = {p for p in long.parts if abs(long.parts[p] - short.parts[p]) > 1e-6 * long.parts[p]}
    assert changed == {"indexer scoring (Full)", "indexer scoring (Reindex, pool)"}
    # Full layers score every visible entry: 3 encoder layers at ratio 2 and layer 20 at ratio 1
    assert long.parts["indexer scoring (Full)"] == 2 * 0.25 * 32 * 128 * (3 * 524288 + 1048576)
    plain = decode_token_flops(config, 1_048_576, weighted=False)  # every multiply-add as 2 FLOPs
    assert plain.parts["indexer scoring (Full)"] == 4 * long.parts["indexer scoring (Full)"]
    assert plain.parts["head"] == long.parts["head"] and plain.total > long.total
    result = CliRunner().invoke(cli, ["flops", "--context", "4096,1048576"])
    assert result.exit_code == 0 and "+31.5%" in result.stdout and "about +1/4" in result.stdout
    assert CliRunner().invoke(cli, ["flops", "--context", "4k"]).exit_code == 2


def test_config_options_take_the_flat_inference_format_and_refuse_bad_files_readably(tmp_path):
    """--config takes a built-in name or a config.json in either official format (the nested one or
    the flat inference one): both forms of micro describe the same model."""
    import json

    from dsv41.checkpoint import inference_from_config
    from dsv41.config import load_config

    flat = tmp_path / "inference_config.json"
    flat.write_text(json.dumps(inference_from_config(load_config("micro"))))
    by_name = CliRunner().invoke(cli, ["info", "--config", "micro"])
    by_file = CliRunner().invoke(cli, ["info", "--config", str(flat)])
    assert by_name.exit_code == 0 and by_file.exit_code == 0, by_file.output
    assert by_file.output == by_name.output
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    for path, says in ((broken, "not valid JSON"), (tmp_path / "absent.json", "no such file")):
        result = CliRunner().invoke(cli, ["info", "--config", str(path)])
        assert result.exit_code == 1 and says in result.output and "Traceback" not in result.output, result.output
