"""Number formats: hand-checked cases against the format rules, and the official unit goldens."""

import pytest
import torch
from safetensors.torch import load_file

from dsv41.model import quant
from dsv41.model.layers import Linear, Storage

from .conftest import GOLDEN


def test_fp8_qdq_hand_checked_block():
    x = torch.zeros(32, dtype=torch.bfloat16)
    x[:4] = torch.tensor([100.0, 1.0, -3.3, 0.01])
    y = quant.fp8_qdq(x)
    # scale 0.25. 100 -> 400, halfway between E4M3 384 and 416: the even mantissa (384) wins -> 96.
    # 1 -> 4 exact. bf16(-3.3) -> -13.19 -> -13 (step 0.5 in 8..16) -> -3.25. 0.01 -> 0.04 -> 10/256 -> 0.0098.
    assert y[:4].tolist() == [96.0, 1.0, -3.25, 0.009765625]
    assert torch.equal(y[4:], x[4:])


def test_main_kv_fp4_uses_an_e4m3_scale_of_amax_over_6():
    x = torch.zeros(16, dtype=torch.bfloat16)
    x[:3] = torch.tensor([7.0, 1.0, -2.0])
    packed, scale = quant.fp4_quant(x, 16, e4m3_scale=True)
    assert scale.tolist() == [1.125]  # E4M3(7/6 = 1.1667) = 1.125
    # 7/1.125 = 6.22 -> clamp 6 -> 6.75; 1/1.125 = 0.889 -> 1 -> 1.125; -2/1.125 = -1.78 -> -2 -> -2.25
    assert quant.main_kv_qdq(x)[:3].tolist() == [6.75, 1.125, -2.25]
    assert packed.numel() == 8


def test_mxfp4_scale_is_a_power_of_two():
    x = torch.zeros(32, dtype=torch.bfloat16)
    x[0], x[1] = 7.0, 1.3
    _, scale = quant.fp4_quant(x, 32, e4m3_scale=False)
    assert scale.tolist() == [2.0]  # 7/6 = 1.17 rounds up to 2
    assert quant.mxfp4_qdq(x)[:2].tolist() == [8.0, 1.0]  # 3.5 -> 4 (tie to even), 0.65 -> 0.5


def test_shape_errors_are_clear():
    with pytest.raises(ValueError, match="not a multiple of the quantization block 32"):
        quant.fp8_quant(torch.ones(3, 40))


@pytest.fixture(scope="module")
def units():
    return load_file(GOLDEN / "units.safetensors")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_quantizers_match_official_goldens_bit_for_bit(units):
    x = units["quant.input_bf16"]
    q, s = quant.fp8_quant(x)
    assert torch.equal(bits(q), bits(units["quant.act_fp8_q"]))
    assert torch.equal(bits(s.to(torch.float8_e8m0fnu)), bits(units["quant.act_fp8_scale"]))
    assert torch.equal(quant.fp8_qdq(x), units["quant.act_fp8_qdq"])
    packed, s = quant.fp4_quant(x, 32, e4m3_scale=False)
    assert torch.equal(packed, units["quant.fp4_e8m0_packed_u8"])
    assert torch.equal(bits(s.to(torch.float8_e8m0fnu)), bits(units["quant.fp4_e8m0_scale"]))
    assert torch.equal(quant.mxfp4_qdq(x), units["quant.fp4_e8m0_qdq"])
    packed, s = quant.fp4_quant(x, 16, e4m3_scale=True)
    assert torch.equal(packed, units["quant.fp4_e4m3_packed_u8"])
    assert torch.equal(bits(s.to(torch.float8_e4m3fn)), bits(units["quant.fp4_e4m3_scale"]))
    assert torch.equal(quant.main_kv_qdq(x), units["quant.fp4_e4m3_qdq"])


@pytest.mark.parametrize("storage", [Storage.FP8, Storage.FP4])
def test_quantized_gemms_match_official_goldens(units, storage):
    layer = Linear(64, 48, storage)
    key = "fp8" if storage is Storage.FP8 else "fp4"
    weight = units["gemm.fp8_weight"] if key == "fp8" else units["gemm.fp4_weight_packed_u8"].view(torch.int8)
    layer.weight.data, layer.scale.data = weight, units[f"gemm.{key}_scale"]
    assert torch.equal(layer(units["gemm.x_bf16"]), units[f"gemm.{key}_out"])


def test_weight_quantizers_round_trip_within_format_error(rng):
    w = torch.randn(70, 96, generator=rng)
    values, scale = quant.quantize_weight_fp8(w)
    assert values.shape == (70, 96) and scale.shape == (3, 3)
    back = values.float() * scale.float().repeat_interleave(32, 0).repeat_interleave(32, 1)[:70, :96]
    assert torch.allclose(back, w, rtol=2**-3, atol=scale.float().max().item() * 2**-9)
    packed, scale = quant.quantize_weight_fp4(w)
    back = quant.unpack_e2m1(packed) * scale.float().repeat_interleave(32, 1)
    assert packed.dtype == torch.int8 and (back - w).abs().max() <= scale.float().max()
