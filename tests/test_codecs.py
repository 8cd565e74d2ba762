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
