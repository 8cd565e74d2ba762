"""Codecs against their format definitions, every code point, and the ONNX reference vectors."""

import json
import math

import pytest
import torch

from dsv41.kernels import codecs

from .conftest import SHARED

ONNX = json.loads((SHARED / "data" / "mx_test_vectors" / "onnx_node_tests_decoded.json").read_text())


def _values(t: dict) -> torch.Tensor:
    return torch.tensor([float(v) for v in t["values"]], dtype=torch.float32)


def _e2m1_by_definition(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exponent, mantissa = (code >> 1) & 3, code & 1
    return sign * (mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2))


def _e4m3_by_definition(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exponent, mantissa = (code >> 3) & 0xF, code & 7
    if exponent == 15 and mantissa == 7:
        return math.nan
    if exponent == 0:
        return sign * mantissa / 8 * 2.0**-6
    return sign * (1 + mantissa / 8) * 2.0 ** (exponent - 7)


def test_every_e2m1_code_decodes_by_definition_and_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    values = codecs.e2m1_decode(codes)
    assert values.tolist() == [_e2m1_by_definition(c) for c in range(16)]
    assert torch.equal(codecs.e2m1_encode(values), codes)  # -0.0 keeps its own code 0x8


def test_every_e4m3_code_decodes_by_definition_and_round_trips():
    codes = torch.arange(256, dtype=torch.uint8)
    values = codecs.e4m3_decode(codes)
    want = torch.tensor([_e4m3_by_definition(c) for c in range(256)])
    assert torch.equal(values.isnan(), want.isnan())
    assert torch.equal(values[~values.isnan()], want[~want.isnan()])
    assert torch.equal(codecs.e4m3_encode(values), codes)


def test_every_e8m0_code_decodes_to_its_power_of_two():
    codes = torch.arange(256, dtype=torch.uint8)
    values = codecs.e8m0_decode(codes)
    assert values[255].isnan()
    assert values[:255].tolist() == [2.0 ** (c - 127) for c in range(255)]
    for rounding in ("up", "down", "nearest"):
        assert torch.equal(codecs.e8m0_encode(values[1:255], rounding), codes[1:255])


def test_e2m1_ties_saturation_zero_and_nan():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 7.0, -1e9, math.inf, -0.0, math.nan])
    assert codecs.e2m1_decode(codecs.e2m1_encode(x))[:11].tolist() == [
        0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, 6.0, -6.0, 6.0]
    assert codecs.e2m1_encode(x)[-2:].tolist() == [0x8, 0x8]


def test_e4m3_saturates_or_overflows_to_nan():
    x = torch.tensor([449.0, 464.0, 1e6, -math.inf, math.nan, -1e-9])
    assert codecs.e4m3_encode(x).tolist() == [0x7E, 0x7E, 0x7E, 0xFE, 0x7F, 0x80]
    assert codecs.e4m3_encode(x, saturate=False).tolist() == [0x7E, 0x7E, 0x7F, 0xFF, 0x7F, 0x80]


def test_nibble_packing_puts_the_even_element_low():
    codes = torch.tensor([2, 15, 1, 5], dtype=torch.uint8)
    assert codecs.pack_nibbles(codes).tolist() == [0xF2, 0x51]
    assert torch.equal(codecs.unpack_nibbles(codecs.pack_nibbles(codes)), codes)


@pytest.mark.parametrize("test", ["test_cast_FLOAT_to_FLOAT4E2M1", "test_cast_FLOAT4E2M1_to_FLOAT",
                                  "test_cast_FLOAT_to_FLOAT8E4M3FN", "test_cast_FLOAT8E4M3FN_to_FLOAT",
                                  "test_cast_no_saturate_FLOAT_to_FLOAT8E4M3FN",
                                  "test_cast_e8m0_FLOAT_to_FLOAT8E8M0", "test_cast_e8m0_FLOAT8E8M0_to_FLOAT"])
def test_onnx_cast_vectors_bit_for_bit(test):
    case = ONNX[test]
    x, y = case["test_data_set_0/input_0.pb"], case["test_data_set_0/output_0.pb"]
    attributes = case["model"][0]["attributes"]
    if y["dtype"] == "FLOAT4E2M1":
        assert codecs.e2m1_encode(_values(x)).tolist() == y["codes"]
    elif y["dtype"] == "FLOAT8E4M3FN":
        got = codecs.e4m3_encode(_values(x), saturate=bool(attributes.get("saturate", 1)))
        assert got.tolist() == y["codes"]
    elif y["dtype"] == "FLOAT8E8M0":
        assert attributes["round_mode"] == "up"
        assert codecs.e8m0_encode(_values(x), "up").tolist() == y["codes"]
    else:
        codes = torch.tensor(x["codes"], dtype=torch.uint8)
        decode = {"FLOAT4E2M1": codecs.e2m1_decode, "FLOAT8E4M3FN": codecs.e4m3_decode,
                  "FLOAT8E8M0": codecs.e8m0_decode}[x["dtype"]]
        got, want = decode(codes), _values(y)
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got[~got.isnan()], want[~want.isnan()])
        assert torch.equal(torch.signbit(got[~got.isnan()]), torch.signbit(want[~want.isnan()]))


def test_onnx_quantize_linear_e2m1_per_axis():
    case = ONNX["test_quantizelinear_float4e2m1"]
    x = _values(case["test_data_set_0/input_0.pb"]).view(3, 4)
    scale = _values(case["test_data_set_0/input_1.pb"]).view(3, 1)
    want = case["test_data_set_0/output_0.pb"]
    zero_point = 0.0  # QuantizeLinear adds it, which turns -0 into +0
    assert codecs.e2m1_encode(x / scale + zero_point).flatten().tolist() == want["codes"]


def test_reference_scales_round_up_and_ocp_scales_round_down():
    amax = torch.tensor([100.0, 448.0, 449.0, 7.0])
    assert codecs.pow2_scale_up(amax, 448.0).tolist() == [0.25, 1.0, 2.0, 0.015625]
    # OCP MX for E4M3 (emax 8): 2^(floor(log2 amax) - 8)
    assert codecs.ocp_mx_scale(amax, 8).tolist() == [0.25, 1.0, 1.0, 2.0**-6]
    # for E2M1 the OCP rule can clip: amax 7 -> scale 1, 7 saturates to 6; the reference takes 2
    assert codecs.ocp_mx_scale(torch.tensor([7.0]), 2).tolist() == [1.0]
    assert codecs.pow2_scale_up(torch.tensor([7.0]), 6.0).tolist() == [2.0]
    assert codecs.e4m3_scale(torch.tensor([7.0])).tolist() == [1.125]


@pytest.mark.parametrize(("test", "decode"), [("test_dequantizelinear_e4m3fn", codecs.e4m3_decode),
                                              ("test_dequantizelinear_float4e2m1", codecs.e2m1_decode)])
def test_onnx_dequantize_linear(test, decode):
    case = ONNX[test]
    codes = torch.tensor(case["test_data_set_0/input_0.pb"]["codes"], dtype=torch.uint8)
    scale = _values(case["test_data_set_0/input_1.pb"])
    assert torch.equal(decode(codes) * scale, _values(case["test_data_set_0/output_0.pb"]))


def test_onnx_quantize_linear_e4m3_saturates():
    case = ONNX["test_quantizelinear_e4m3fn"]
    x, scale = _values(case["test_data_set_0/input_0.pb"]), _values(case["test_data_set_0/input_1.pb"])
    assert codecs.e4m3_encode(x / scale).tolist() == case["test_data_set_0/output_0.pb"]["codes"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoding_whole_fp4_bytes_equals_decoding_each_nibble(dtype):
    packed = torch.arange(256, dtype=torch.uint8)[torch.randperm(256)].view(4, 2, 32)
    expected = codecs.e2m1_decode(codecs.unpack_nibbles(packed))
    got = codecs.e2m1_decode_bytes(packed, dtype)
    assert got.shape == (4, 2, 64) and got.dtype == dtype
    assert torch.equal(got.float().view(torch.int32), expected.view(torch.int32))  # -0 stays -0


# Special values (docs/kernels.md): E8M0 by value over its whole range, clamps, NaN; scales never 0.

_E8M0_VALUES = torch.exp2(torch.arange(255, dtype=torch.float64) - 127)  # code c holds 2^(c - 127)


def _e8m0_by_definition(x: torch.Tensor, rounding: str) -> torch.Tensor:
    """Codes chosen among the 255 E8M0 values by comparing values in float64 (exact for fp32
    inputs): 'up' the smallest value >= x, 'down' the largest <= x, 'nearest' the closer of the
    two (ties up); results clamp to codes 0..254."""
    v = x.double()
    above = torch.searchsorted(_E8M0_VALUES, v).clamp(max=254)
    below = (torch.searchsorted(_E8M0_VALUES, v, right=True) - 1).clamp(min=0)
    if rounding == "up":
        code = torch.where(v > _E8M0_VALUES[-1], 254, above)
    elif rounding == "down":
        code = below
    else:
        code = torch.where(_E8M0_VALUES[above] - v <= v - _E8M0_VALUES[below], above, below)
    return code.to(torch.uint8)


def _from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


@pytest.mark.parametrize("rounding", ["up", "down", "nearest"])
def test_e8m0_encode_of_every_fp32_subnormal_goes_by_its_value(rounding):
    """All 2^23 subnormals and +0: only codes 0 (2^-127) and 1 (2^-126) are near them."""
    x = _from_bits(torch.arange(2**23, dtype=torch.int32))
    got = codecs.e8m0_encode(x, rounding)
    assert torch.equal(got, _e8m0_by_definition(x, rounding))
    # the boundaries by hand: 2^-127 is code 0 itself; 'nearest' goes up from 1.5 * 2^-127
    edges = _from_bits(torch.tensor([0x400000, 0x400001, 0x5FFFFF, 0x600000]))
    want = {"up": [0, 1, 1, 1], "down": [0, 0, 0, 0], "nearest": [0, 0, 0, 1]}[rounding]
    assert codecs.e8m0_encode(edges, rounding).tolist() == want


@pytest.mark.parametrize("rounding", ["up", "down", "nearest"])
def test_e8m0_encode_of_every_exponent_matches_the_definition(rng, rounding):
    """Every fp32 exponent field 1..254, with the mantissas at the rounding edges and random ones."""
    exponents = torch.arange(1, 255, dtype=torch.int32).repeat_interleave(12)
    edges = torch.tensor([0, 1, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFF], dtype=torch.int32).repeat(254)
    random = torch.randint(0, 2**23, (254 * 6,), generator=rng, dtype=torch.int32)
    mantissas = torch.stack([edges.view(254, 6), random.view(254, 6)], dim=1).flatten()
    x = _from_bits((exponents << 23) | mantissas)
    assert torch.equal(codecs.e8m0_encode(x, rounding), _e8m0_by_definition(x, rounding))


def test_e8m0_clamps_to_its_range_and_refuses_what_is_no_scale(rng):
    tiny = torch.rand(50, generator=rng) * 2.0**-128  # below 2^-127, subnormal
    huge = (1 + torch.rand(50, generator=rng)) * 2.0**127  # above 2^127, finite
    for rounding in ("up", "down", "nearest"):
        assert codecs.e8m0_encode(tiny, rounding).eq(0).all()
        assert codecs.e8m0_encode(torch.tensor([0.0, -0.0]), rounding).tolist() == [0, 0]
        assert codecs.e8m0_encode(huge, rounding).eq(254).all()
        bad = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, -1e-30, -3.0])
        assert codecs.e8m0_encode(bad, rounding).eq(0xFF).all()
    smallest = codecs.e8m0_decode(torch.tensor([0], dtype=torch.uint8))
    assert smallest.view(torch.int32).tolist() == [0x400000]  # 2^-127 exactly, not 0


def test_pow2_scale_up_is_an_e8m0_value_for_every_amax(rng):
    """2^ceil(log2(amax * fp32(1/max))) clamped to [2^-127, 2^127]: never 0 (a zero amax gives
    2^-127) and never inf; NaN stays NaN. Inputs over the whole fp32 range, subnormals included."""
    bits = torch.randint(0, 0x7F800000, (20000,), generator=rng, dtype=torch.int32)
    amax = torch.cat([_from_bits(bits), torch.tensor([0.0, 3.4028234663852886e38])])
    for max_value in (448.0, 6.0):
        ratio = amax * torch.tensor(1.0 / max_value, dtype=torch.float32)
        want = _E8M0_VALUES[_e8m0_by_definition(ratio, "up").long()].float()
        got = codecs.pow2_scale_up(amax, max_value)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        assert (got > 0).all() and got.isfinite().all()
    assert codecs.pow2_scale_up(torch.tensor([math.nan]), 448.0).isnan().all()


def test_ocp_scale_floors_from_the_bits_and_stays_in_the_e8m0_range(rng):
    below_powers = _from_bits(torch.arange(-120, 120, dtype=torch.int32).add(127).mul(2**23) - 1)
    want = torch.exp2(torch.arange(-121, 119, dtype=torch.float64) - 2).clamp(2.0**-127).float()
    assert torch.equal(codecs.ocp_mx_scale(below_powers, 2), want)  # a float log2 rounds these up
    amax = torch.rand(1000, generator=rng) * torch.exp2(torch.randint(-140, 127, (1000,), generator=rng).float())
    floor_log2 = _e8m0_by_definition(amax, "down").long() - 127  # values below 2^-127 clamp anyway
    assert torch.equal(codecs.ocp_mx_scale(amax, 8), torch.exp2((floor_log2 - 8).clamp(-127, 127).double()).float())
    assert codecs.ocp_mx_scale(torch.tensor([0.0, math.inf, math.nan]), 2)[0].item() == 2.0**-127
    assert codecs.ocp_mx_scale(torch.tensor([math.inf, math.nan]), 2).isnan().all()


def test_main_kv_scale_is_never_zero():
    assert codecs.e4m3_scale(torch.tensor([0.0, -0.0, 1e-30])).tolist() == [2.0**-9] * 3
