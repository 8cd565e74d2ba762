import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41.checkpoint import CheckpointError, config_from_inference, inference_from_config, load_weights
from dsv41.config import ConfigError, load_config
from dsv41.model.transformer import build_model

from .conftest import GOLDEN, SHARED


def test_official_inference_config_maps_to_the_official_config_both_ways():
    flat = json.loads((SHARED / "reference" / "inference_config.json").read_text())
    config, runtime = config_from_inference(flat)
    assert config == load_config("official")
    assert inference_from_config(config) == flat
    assert runtime.max_seq_len is None


def test_unknown_and_missing_inference_fields_are_all_reported():
    flat = json.loads((SHARED / "reference" / "inference_config.json").read_text())
    flat["rope_sclae"] = 1
    del flat["dim"], flat["index_topk"]
    with pytest.raises(ConfigError) as err:
        config_from_inference(flat)
    assert len(err.value.problems) == 3 and "rope_sclae: unknown" in str(err.value)


def _golden_model():
    flat = json.loads((GOLDEN / "config.json").read_text())
    config, _ = config_from_inference(flat)
    return build_model(config, token_map=None)


def test_golden_weights_load_and_convert_by_official_name():
    model = _golden_model()
    deferred = load_weights(model, [GOLDEN / "weights.safetensors"])
    stored = load_file(GOLDEN / "weights.safetensors")
    assert deferred and all(name.startswith("mtp.") for name in deferred)  # DSpark stages come later
    wq_a = stored["layers.2.attn.wq_a.weight"]
    assert torch.equal(model.layers[2].attn.wq_a.weight.view(torch.uint8), wq_a.view(torch.uint8))
    assert model.head.weight.dtype == torch.float32 and torch.equal(model.head.weight, stored["head.weight"].float())
    assert model.layers[2].attn.compressor.wgate.weight.dtype == torch.float32
    wo_a = stored["layers.0.attn.wo_a.weight"].float()
    scale = stored["layers.0.attn.wo_a.scale"].float().repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(model.layers[0].attn.wo_a.weight, (wo_a * scale).bfloat16())


def test_bad_checkpoints_list_every_problem(tmp_path):
    stored = load_file(GOLDEN / "weights.safetensors")
    del stored["layers.1.attn.wkv.weight"], stored["norm.weight"]
    stored["layers.9.attn.bogus"] = torch.zeros(2)
    stored["embed.weight"] = stored["embed.weight"][:-1].contiguous()
    stored["layers.0.attn.attn_sink"] = stored["layers.0.attn.attn_sink"].bfloat16()
    path = tmp_path / "bad.safetensors"
    save_file(stored, str(path))
    with pytest.raises(CheckpointError) as err:
        load_weights(_golden_model(), [path])
    text = str(err.value)
    assert len(err.value.problems) == 5
    for needle in ("layers.1.attn.wkv.weight: missing", "norm.weight: missing", "layers.9.attn.bogus: unexpected",
                   "embed.weight: shape (383, 64)", "layers.0.attn.attn_sink: dtype torch.bfloat16"):
        assert needle in text
