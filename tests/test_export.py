"""Writing model directories: bit-exact round trips, quantised export of float weights, and the
errors of missing or partial directories."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsv41.checkpoint import (
    CheckpointError,
    GenerationConfig,
    engram_tables_file,
    load_model,
    load_weights,
    open_model_dir,
)
from dsv41.config import config_to_dict, load_config
from dsv41.export import Form, convert, export_model, parse_size, storage_layout
from dsv41.model.quant import fp8_quant, quantize_weight_fp4, quantize_weight_fp8, unpack_e2m1
from dsv41.model.reference import forward
from dsv41.model.tokenizer import byte_tokenizer
from dsv41.model.transformer import build_model

from .conftest import GOLDEN


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A view that compares bit for bit (NaN payloads and -0 included)."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _tensors(model_dir) -> dict[str, torch.Tensor]:
    out = {}
    for file in model_dir.weights_files:
        out |= load_file(file)
    return out


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(_bits(a[name]), _bits(b[name])), name


def test_golden_checkpoint_converts_and_round_trips_bit_for_bit(tmp_path):
    single, rounded = convert(GOLDEN, tmp_path / "single")
    assert rounded == []
    golden = load_file(GOLDEN / "weights.safetensors")
    _assert_same(_tensors(single), golden)  # wo_a re-quantised from its bf16 form gives the stored bytes back
    assert json.loads((tmp_path / "single" / "config.json").read_text()) == config_to_dict(single.config)
    assert "text_config" in json.loads((tmp_path / "single" / "config.json").read_text())

    sharded, _ = convert(tmp_path / "single", tmp_path / "sharded", max_shard_size="200KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(sharded.weights_files) > 3 and not (tmp_path / "sharded" / "model.safetensors").exists()
    assert set(index["weight_map"]) == set(golden)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in golden.values())
    for file in sharded.weights_files:
        held = load_file(file)
        assert all(index["weight_map"][name] == file.name for name in held)
        assert sum(t.numel() * t.element_size() for t in held.values()) <= 200_000 or len(held) == 1
    _assert_same(_tensors(sharded), golden)
    again, _ = convert(tmp_path / "sharded", tmp_path / "again")
    _assert_same(_tensors(again), golden)


@pytest.mark.parametrize("shard_size", [None, "100KB"])
def test_random_micro_model_writes_loads_and_writes_the_same_tensors(micro, tmp_path, shard_size):
    tok = tmp_path / "tok.json"
    byte_tokenizer(micro.config.text_config.vocab_size).save(str(tok))
    first, rounded = export_model(micro, micro.config, tmp_path / "first", tok, max_shard_size=shard_size)
    # the random init holds fp32 / bf16 values the release stores narrower; a loaded model holds none
    assert rounded and all(name.endswith(("head.weight", "compressor.wkv.weight", "compressor.wgate.weight",
                                          "wo_a.weight")) for name in rounded)
    assert first.tokenizer_path == tmp_path / "first" / "tokenizer.json"
    assert (shard_size is None) == (first.weights_files == (tmp_path / "first" / "model.safetensors",))
    loaded, deferred = load_model(first)
    assert deferred == []
    held = dict(micro.named_parameters())
    for name, param in loaded.named_parameters():
        if name not in rounded:
            assert torch.equal(_bits(param.data), _bits(held[name].data)), name
    second, again = export_model(loaded, loaded.config, tmp_path / "second", first.tokenizer_path)
    assert again == []
    _assert_same(_tensors(first), _tensors(second))
    ids = torch.tensor([[0, 5, 77, 12, 9]])
    assert torch.equal(forward(load_model(second)[0], ids).logits, forward(loaded, ids).logits)


def _float_weights(config, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Float master weights for every weight of the model, O(1) with a spread of magnitudes."""
    out = {}
    for name, slot in storage_layout(config).items():
        value = torch.randn(slot.shape, generator=gen) * torch.rand(slot.shape, generator=gen).pow(4)
        out[name] = value if slot.form is not Form.PLAIN or slot.dtype == torch.float32 else value.bfloat16()
    return out


def test_float_weights_are_quantised_as_the_release_stores_them(tmp_path, rng):
    config = load_config("micro")
    weights = _float_weights(config, rng)
    model_dir, rounded = export_model(weights, config, tmp_path / "m")
    assert set(rounded) >= {n for n, s in storage_layout(config).items() if s.form is not Form.PLAIN}
    model, _ = load_model(model_dir)
    params = dict(model.named_parameters())
    layout = storage_layout(config)

    name = "layers.0.attn.wq_a.weight"  # FP8, 32x32 tiles
    q, s = quantize_weight_fp8(weights[name])
    assert torch.equal(_bits(params[name]), _bits(q)) and torch.equal(_bits(params[name[:-6] + "scale"]), _bits(s))
    tiles = s.float().repeat_interleave(32, 0).repeat_interleave(32, 1)
    error = (params[name].float() * tiles - weights[name]).abs()
    assert (error <= torch.maximum(weights[name].abs() * 2**-4, tiles * 2**-10)).all()  # E4M3 half-step

    name = "layers.0.attn.wo_a.weight"  # FP8 on disk, dequantised to bf16 at load
    q, s = quantize_weight_fp8(weights[name])
    dequant = q.float() * s.float().repeat_interleave(32, 0).repeat_interleave(32, 1)
    assert torch.equal(params[name], dequant.bfloat16())

    name = next(n for n, slot in layout.items() if slot.form is Form.FP4)  # MXFP4 experts
    q, s = quantize_weight_fp4(weights[name])
    assert torch.equal(params[name], q) and torch.equal(_bits(params[name[:-6] + "scale"]), _bits(s))
    per_k = s.float().repeat_interleave(32, 1)
    error = (unpack_e2m1(params[name]) * per_k - weights[name]).abs()
    assert (error <= torch.maximum(weights[name].abs() / 4, per_k / 4)).all()  # E2M1 half-step

    name = "layers.1.engram.embed.weight"  # FP8 rows, one scale per 32 channels of a row
    q, s = fp8_quant(weights[name])
    assert torch.equal(_bits(params[name]), _bits(q)) and torch.equal(params[name[:-6] + "scale"].float(), s)

    assert torch.equal(params["head.weight"], weights["head.weight"].bfloat16().float())  # BF16 on disk
    assert torch.equal(params["layers.0.attn.attn_sink"], weights["layers.0.attn.attn_sink"])  # F32 on disk
    assert load_file(model_dir.weights_files[0])["head.weight"].dtype == torch.bfloat16


def test_export_reports_every_missing_unknown_and_misshaped_weight(tmp_path, rng):
    config = load_config("micro")
    weights = _float_weights(config, rng)
    del weights["norm.weight"]
    weights["layers.0.attn.bogus"] = torch.zeros(3)
    weights["layers.0.attn.wq_a.weight"] = weights["layers.0.attn.wq_a.weight"][:, :-1]
    weights["layers.0.attn.wq_b.weight"] = weights["layers.0.attn.wq_b.weight"].to(torch.float8_e4m3fn)
    with pytest.raises(CheckpointError) as err:
        export_model(weights, config, tmp_path / "m")
    text = str(err.value)
    assert len(err.value.problems) == 4
    for needle in ("norm.weight: missing", "layers.0.attn.bogus: not a weight", "wq_a.weight: shape (64, 63)",
                   "wq_b.weight: torch.float8_e4m3fn without a scale cannot"):
        assert needle in text
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.partial").exists()


def test_export_refuses_a_non_empty_directory(micro, tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.safetensors").write_bytes(b"old")
    with pytest.raises(FileExistsError):
        export_model(micro, micro.config, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == b"old"


def test_generation_config_round_trips_in_the_hf_form(micro, tmp_path):
    generation = GenerationConfig(bos_token_id=0, eos_token_ids=(1, 7), pad_token_id=2, temperature=0.6, top_p=0.95)
    model_dir, _ = export_model(micro, micro.config, tmp_path / "m", generation=generation)
    data = json.loads((tmp_path / "m" / "generation_config.json").read_text())
    assert data == {"bos_token_id": 0, "eos_token_id": [1, 7], "pad_token_id": 2, "do_sample": True,
                    "temperature": 0.6, "top_p": 0.95, "transformers_version": micro.config.transformers_version}
    assert model_dir.generation == generation
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": "x", "top_p": 2}))
    with pytest.raises(CheckpointError) as err:
        open_model_dir(tmp_path / "m")
    assert len(err.value.problems) == 2 and "generation_config.json" in str(err.value)


def test_shard_sizes_parse_like_hf():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20 and parse_size(1000) == 1000
    for bad in ("5 parsecs", "0", -1, ""):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.fixture(scope="module")
def sharded(micro, tmp_path_factory):
    return export_model(micro, micro.config, tmp_path_factory.mktemp("s") / "m", max_shard_size="300KB")[0]


def _copy(model_dir, tmp_path):
    return shutil.copytree(model_dir.path, tmp_path / "copy")


def test_missing_directory_config_and_weights_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="no such model directory"):
        open_model_dir(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        open_model_dir(tmp_path / "empty")
    shutil.copy(GOLDEN / "config.json", tmp_path / "empty" / "config.json")
    with pytest.raises(CheckpointError, match="no safetensors weight files"):
        open_model_dir(tmp_path / "empty")


def test_a_missing_shard_is_named(sharded, tmp_path):
    folder = _copy(sharded, tmp_path)
    gone = sharded.weights_files[1].name
    (folder / gone).unlink()
    with pytest.raises(CheckpointError, match=f"names shard {gone}, which is missing"):
        open_model_dir(folder)


def test_an_index_that_disagrees_with_its_shards_is_refused(sharded, tmp_path):
    folder = _copy(sharded, tmp_path)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    moved = next(iter(index["weight_map"]))
    first, second = sharded.weights_files[0].name, sharded.weights_files[1].name
    index["weight_map"][moved] = second if index["weight_map"][moved] == first else first
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        open_model_dir(folder)
    assert len(err.value.problems) == 2
    assert f"{moved}: model.safetensors.index.json puts it in" in str(err.value)
    assert f"{moved}: in " in str(err.value) and "but not listed" in str(err.value)


def test_missing_mistyped_and_misshaped_tensors_name_the_tensor_and_the_file(sharded, tmp_path):
    folder = _copy(sharded, tmp_path)
    shard = sharded.weights_files[0]
    held = load_file(shard)
    names = list(held)
    typed, shaped = names[0], next(n for n in names[1:] if held[n].dim() == 2 and held[n].dtype == torch.bfloat16)
    held[typed] = held[typed].to(torch.float64)
    held[shaped] = held[shaped][:-1].contiguous()
    removed = next(n for n in names if n.endswith("attn_norm.weight"))
    del held[removed]
    save_file(held, str(folder / shard.name))
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    del index["weight_map"][removed]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        load_model(folder)
    text = str(err.value)
    assert f"{typed}: dtype torch.float64" in text and f"[{shard.name}]" in text
    assert f"{shaped}: shape" in text and f"{removed}: missing from the checkpoint" in text
    assert len(err.value.problems) == 3


def test_a_truncated_shard_is_named(sharded, tmp_path):
    folder = _copy(sharded, tmp_path)
    shard = folder / sharded.weights_files[-1].name
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=shard.name):
        load_model(folder)


def test_an_fp8_wo_a_without_its_scale_is_reported(tmp_path):
    stored = load_file(GOLDEN / "weights.safetensors")
    del stored["layers.0.attn.wo_a.scale"]
    (tmp_path / "m").mkdir()
    save_file(stored, str(tmp_path / "m" / "model.safetensors"))
    shutil.copy(GOLDEN / "config.json", tmp_path / "m" / "config.json")
    model_dir = open_model_dir(tmp_path / "m")
    with pytest.raises(CheckpointError, match=r"layers\.0\.attn\.wo_a\.weight: FP8 weight without its"):
        load_weights(build_model(model_dir.config), list(model_dir.weights_files))


def test_a_tokenizer_that_does_not_fit_the_engram_vocabulary_is_named(tmp_path):
    convert(GOLDEN, tmp_path / "m")  # the golden vocabulary compresses by its own stub tokenizer
    with pytest.raises(CheckpointError, match="byte-level tokenizer.*engram_compressed_vocab_size 120"):
        load_model(tmp_path / "m")


def test_the_engram_tables_file_is_the_one_that_holds_every_table(micro, sharded, tmp_path):
    single, _ = export_model(micro, micro.config, tmp_path / "single")
    assert engram_tables_file(single) == single.weights_files[0]
    with pytest.raises(CheckpointError, match="must all be in one file; they are in model-0000"):
        engram_tables_file(sharded)  # 300 KB shards split the two tables
