import json

import pytest

from dsv41.config import (
    ConfigError,
    Mode,
    Part,
    Rope,
    config_from_dict,
    config_to_dict,
    global_kv_bytes_per_token,
    load_config,
)

from .conftest import SHARED


def official_dict() -> dict:
    return json.loads((SHARED / "reference" / "config.json").read_text())


def test_official_file_is_the_release_byte_for_byte():
    from dsv41.config import CONFIG_DIR

    assert (CONFIG_DIR / "official.json").read_bytes() == (SHARED / "reference" / "config.json").read_bytes()
    assert load_config(SHARED / "reference" / "config.json") == load_config("official")


def test_official_plan_matches_spec_layer_by_layer():
    plan = load_config("official").plan
    expected = {}
    for layer in (0, 1):
        expected[layer] = (Part.ENCODER, Mode.SWA, 0, None, None)
    for owner in (2, 8, 14):
        expected[owner] = (Part.ENCODER, Mode.FULL, 2, owner, owner)
        for layer in range(owner + 1, owner + 6):
            expected[layer] = (Part.ENCODER, Mode.REUSE, 2, owner, owner)
    expected[20] = (Part.DECODER, Mode.FULL, 1, 20, 20)
    for layer in (21, 22, 23):
        expected[layer] = (Part.DECODER, Mode.REUSE, 1, 20, 20)
    for reindex in (24, 28, 32, 36):
        expected[reindex] = (Part.DECODER, Mode.REINDEX, 1, 20, reindex)
        for layer in range(reindex + 1, reindex + 4):
            expected[layer] = (Part.DECODER, Mode.REUSE, 1, 20, reindex)
    for layer in (40, 41, 42):
        expected[layer] = (Part.DSPARK, Mode.SWA, 0, None, None)
    got = {s.layer_id: (s.part, s.mode, s.ratio, s.kv_owner, s.topk_producer) for s in plan.layers}
    assert got == expected
    assert [plan.count(m) for m in (Mode.FULL, Mode.REINDEX, Mode.REUSE, Mode.SWA)] == [4, 4, 30, 2]
    assert [s.layer_id for s in plan.layers if s.candidate_source] == [20]
    assert [s.layer_id for s in plan.layers if s.candidate_consumer] == [24, 28, 32, 36]
    assert [s.layer_id for s in plan.layers if s.engram] == [1, 14]
    assert [s.layer_id for s in plan.layers if s.dspark_target] == [37, 38, 39]
    assert all((s.rope is Rope.YARN) == (s.ratio > 0) for s in plan.layers)
    assert {s.rope_theta for s in plan.layers if s.ratio > 0} == {160000}
    assert {s.rope_theta for s in plan.layers if s.ratio == 0} == {10000}


@pytest.mark.parametrize("name", ["official", "mini"])
def test_global_kv_is_890_bytes_per_token(name):
    assert global_kv_bytes_per_token(load_config(name)) == 890


def test_mini_keeps_the_official_plan_and_kv_dims():
    official, mini = load_config("official"), load_config("mini")
    assert mini.plan.layers == official.plan.layers
    t, o = mini.text_config, official.text_config
    for field in ("head_dim", "qk_rope_head_dim", "index_head_dim", "sliding_window", "index_topk",
                  "candidate_topk_blocks", "candidate_block_size", "compress_ratios"):
        assert getattr(t, field) == getattr(o, field), field
    assert t.hidden_size < o.hidden_size and t.n_routed_experts < o.n_routed_experts


def test_micro_has_every_layer_kind_and_both_ratios():
    plan = load_config("micro").plan
    assert {s.mode for s in plan.backbone} == set(Mode)
    assert {s.ratio for s in plan.backbone} == {0, 1, 2}
    assert any(s.candidate_source for s in plan.layers) and any(s.candidate_consumer for s in plan.layers)
    assert any(s.engram for s in plan.layers) and len(plan.backbone) == 8


def test_bad_config_reports_every_problem_at_once():
    d = official_dict()
    t = d["text_config"]
    d["surprise"] = 1
    t["hidden_sise"] = 5120  # typo next to the real key
    t["num_attention_heads"] = "64"
    del t["index_topk"]
    with pytest.raises(ConfigError) as err:
        config_from_dict(d, "bad.json")
    problems = err.value.problems
    assert len(problems) == 4
    text = str(err.value)
    for needle in ("surprise: unknown field", "text_config.hidden_sise: unknown field",
                   "text_config.num_attention_heads: value '64' has the wrong type",
                   "text_config.index_topk: missing required field", "bad.json"):
        assert needle in text


def test_inconsistent_values_are_named_with_field_value_and_rule():
    d = official_dict()
    t = d["text_config"]
    t["kv_source_layer_ids"] = [1, 8, 14, 20]  # layer 1 has ratio 0
    t["index_source_layer_ids"] = [2, 8, 14, 20, 24, 28, 32, 36, 44]  # outside the range
    t["candidate_topk_blocks"] = 16  # 16 x 8 cannot hold Top-512
    t["dspark_target_layer_ids"] = [37, 38, 40]  # no layer 40 in the backbone
    with pytest.raises(ConfigError) as err:
        config_from_dict(d)
    text = str(err.value)
    assert "kv_source_layer_ids = 1: layer 1 has compress ratio 0" in text
    assert "index_source_layer_ids = 44: layer id outside the backbone range 0..39" in text
    assert "candidate_topk_blocks = 16: the candidate pool (16 blocks x 8) cannot hold index_topk = 512" in text
    assert "dspark_target_layer_ids = 40: DSpark target layer does not exist" in text


def test_engram_table_sizes_must_match_the_prime_layout():
    d = official_dict()
    d["text_config"]["engram_num_embeddings"] = [384006168, 384016683]
    with pytest.raises(ConfigError, match="engram_num_embeddings = 384016683.*384016682"):
        config_from_dict(d)


def test_configs_round_trip_and_reject_non_objects(tmp_path):
    config = load_config("micro")
    assert config_from_dict(config_to_dict(config)) == config
    with pytest.raises(ConfigError, match="expected an object"):
        config_from_dict([1, 2])
    bad = tmp_path / "c.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not a built-in config name"):
        load_config(tmp_path / "missing.json")
