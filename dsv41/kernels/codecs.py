"""Bit-exact codecs of the number formats in V4.1's caches and weights, vectorized in torch.

- E2M1 (FP4): 4-bit codes, bit 3 = sign, magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6}; round to nearest,
  ties to the even code; saturates at ±6; NaN encodes as 0x8 (-0), as the ONNX reference does.
- E4M3 (FP8, "fn": no infinities): saturating encode (±inf and overflow -> ±448); without
  saturation overflow becomes NaN (0x7F, sign kept). NaN -> 0x7F (sign kept).
- E8M0: an exponent byte, value 2^(code - 127), 0xFF = NaN; encodes clamp to [2^-127, 2^127] and
  round fp32 subnormals by their value.

Two E2M1 codes share a byte, the even element in the low nibble.

Scale rules: the reference rounds power-of-two scales *up*, 2^ceil(log2(amax / max)), computed as
amax times the fp32 reciprocal of the format maximum; OCP MX instead takes 2^(floor(log2(amax)) -
emax of the element type), which can clip the largest element. Both are here; the caches use the
reference's. Neither scale is ever 0 (docs/kernels.md, "Special values").
"""

from __future__ import annotations

import functools

import torch

E2M1_MAX, E4M3_MAX = 6.0, 448.0
# Explicit dtypes: these tables are built at import time, possibly under a bf16 default dtype.
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float32)
E2M1_TABLE = torch.cat([E2M1_GRID, -E2M1_GRID])
# A value exactly between two magnitudes goes to the even code: up at 0.75, 1.75 and 3.5.
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_TIE_GOES_UP = torch.tensor([False, True, False, True, False, True, False])
E2M1_NAN_CODE = 0x8
_E4M3_OVERFLOW = 464.0
E8M0_NAN_CODE = 0xFF
_E8M0_SMALLEST_BITS = 0x00400000  # 2^-127 as fp32 bits
_FP32_NAN_BITS = 0x7FC00000


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> 4-bit codes (uint8), round-to-nearest-even, saturating at ±6."""
    x = x.float()
    magnitude = x.abs().nan_to_num(nan=0.0).contiguous()
    last = len(_MIDPOINTS) - 1
    code = torch.bucketize(magnitude, _MIDPOINTS, right=False)
    on_midpoint = (code <= last) & (magnitude == _MIDPOINTS[code.clamp(max=last)])
    code = code + (on_midpoint & _TIE_GOES_UP[code.clamp(max=last)])
    code = code.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)
    return torch.where(x.isnan(), E2M1_NAN_CODE, code).to(torch.uint8)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    return E2M1_TABLE.to(codes.device)[codes.long() & 0xF]


# Both values of every byte (low nibble first): packed FP4 rows decode with one lookup per byte.
_E2M1_BYTE_PAIRS = torch.stack([E2M1_TABLE[torch.arange(256) & 0xF], E2M1_TABLE[torch.arange(256) >> 4]], dim=-1)
_PAIR_AS_INT = {torch.bfloat16: torch.int32, torch.float32: torch.int64}


def e2m1_decode_bytes(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] values in dtype (bf16 or fp32; both hold them exactly): what
    e2m1_decode(unpack_nibbles(packed)) gives. Each byte's pair of values is one integer of the
    table, so the decode is a single 1-D index_select (several times faster than a 2-D lookup)."""
    table = _E2M1_BYTE_PAIRS.to(device=packed.device, dtype=dtype).view(_PAIR_AS_INT[dtype]).flatten()
    pairs = table.index_select(0, packed.reshape(-1).view(torch.uint8).int())
    return pairs.view(dtype).view(*packed.shape[:-1], 2 * packed.size(-1))


_AS_INT = {(torch.bfloat16, 1): torch.int16, (torch.float32, 1): torch.int32, **{
    (dtype, 2): as_int for dtype, as_int in _PAIR_AS_INT.items()}}


def scaled_code_table(fp4: bool, e4m3_scale: bool, block: int, dtype: torch.dtype,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """Every (scale byte, code byte) pair's dequantized values, at index scale << 8 | code, as
    integers holding the byte's values in dtype (two for E2M1, one for E4M3). Each is computed as
    unpacking computes it (the code's value times its block's scale, in dtype, blocks of `block`
    channels), NaN bits included, so a lookup gives the bits of decoding and scaling in one pass."""
    return _scaled_code_table(fp4, e4m3_scale, block, dtype, torch.device(device))


@functools.cache
def _scaled_code_table(fp4: bool, e4m3_scale: bool, block: int, dtype: torch.dtype,
                       device: torch.device) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = (_E2M1_BYTE_PAIRS.to(dtype) if fp4 else e4m3_decode(codes, dtype).unsqueeze(-1)).flatten()
    scales = e4m3_decode(codes, dtype) if e4m3_scale else e8m0_decode(codes).to(dtype)
    per_byte = 2 if fp4 else 1
    rows = values.expand(256, -1).contiguous()  # row s: every code byte's values, scaled by scale s
    scale = scales.unsqueeze(-1).expand(256, rows.size(-1) // block).contiguous()
    table = (rows.unflatten(-1, (-1, block)) * scale.unsqueeze(-1)).flatten(-2)
    return table.view(256, 256, per_byte).view(_AS_INT[dtype, per_byte]).flatten().to(device)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] 4-bit codes -> [..., K/2] bytes, the even element in the low nibble."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes (any 8-bit storage) -> [..., K] 4-bit codes."""
    b = packed.view(torch.uint8)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).flatten(-2)


def e4m3_encode(x: torch.Tensor, saturate: bool = True) -> torch.Tensor:
    """fp32 -> E4M3 codes (uint8), round-to-nearest-even. Saturating maps overflow and ±inf to
    ±448; otherwise they become NaN. NaN -> 0x7F (sign kept)."""
    x = x.float()
    sign = torch.signbit(x).to(torch.uint8) << 7
    codes = torch.where(x.isnan(), x, x.clamp(-E4M3_MAX, E4M3_MAX)).to(torch.float8_e4m3fn).view(torch.uint8)
    codes = torch.where(x.isnan(), 0x7F | sign, codes)
    if not saturate:  # beyond 464 (halfway to the next, unrepresentable step) the value is NaN
        codes = torch.where(x.abs() > _E4M3_OVERFLOW, 0x7F | sign, codes)
    return codes.to(torch.uint8)


def e4m3_decode(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """E4M3 bytes -> values in dtype (every E4M3 value is exact in bf16). On the CPU the 256 values
    are looked up in a table: torch converts float8 one element at a time in scalar code, about 5x
    slower than an index_select (the SWA rings are decoded every step); the bits are the same."""
    if codes.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return codes.contiguous().view(torch.float8_e4m3fn).to(dtype)
    picked = torch.index_select(_e4m3_values(dtype), 0, codes.reshape(-1).int())
    return picked.view(codes.shape)


@functools.cache
def _e4m3_values(dtype: torch.dtype) -> torch.Tensor:
    """Every E4M3 code's value in dtype, by code (NaN codes keep their sign)."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(dtype)


def e8m0_encode(x: torch.Tensor, rounding: str = "up") -> torch.Tensor:
    """Positive fp32 -> exponent byte. rounding 'up' (ceil to a power of two, the reference and the
    ONNX 'up' mode), 'down' (floor, OCP MX) or 'nearest' (ties, at 1.5 times a power of two, go up).
    Results clamp to codes 0..254 (2^-127..2^127), so ±0 and every value below 2^-127 give code 0;
    NaN, ±inf and negative values encode as NaN (0xFF), as ONNX does.

    fp32 subnormals round by their value, not by their exponent field: the only codes near them
    are 0 (2^-127, itself a subnormal) and 1 (2^-126), so 'up' gives 1 only above 2^-127 and
    'nearest' only from 1.5 * 2^-127."""
    x = x.float().contiguous()
    bits = x.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    subnormal = exponent == 0
    if rounding == "up":
        bump = torch.where(subnormal, mantissa > 0x400000, mantissa != 0)
    elif rounding == "nearest":
        bump = torch.where(subnormal, mantissa >= 0x600000, mantissa >= 0x400000)
    elif rounding == "down":
        bump = torch.zeros_like(subnormal)
    else:
        raise ValueError(f"unknown rounding {rounding!r}; use 'up', 'down' or 'nearest'")
    code = (exponent + bump.int()).clamp(0, 254)
    bad = x.isnan() | x.isinf() | (x < 0)
    return torch.where(bad, E8M0_NAN_CODE, code).to(torch.uint8)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """Exponent byte -> fp32 2^(code - 127), built from the bits; code 0 is 2^-127 (a float32
    subnormal, which a plain shift of the code into the exponent field would make 0), 0xFF NaN."""
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, _E8M0_SMALLEST_BITS, c << 23)
    return torch.where(c == E8M0_NAN_CODE, _FP32_NAN_BITS, bits).view(torch.float32)


def pow2_scale_up(amax: torch.Tensor, max_value: float) -> torch.Tensor:
    """The reference's scale: 2^ceil(log2(amax * fp32(1 / max_value))), from the float's bits, as an
    E8M0 value: clamped to [2^-127, 2^127] (a zero amax gives 2^-127, never a 0 scale); NaN stays NaN."""
    ratio = amax.float() * torch.tensor(1.0 / max_value, dtype=torch.float32)
    return e8m0_decode(e8m0_encode(ratio, "up"))


def ocp_mx_scale(amax: torch.Tensor, element_emax: int) -> torch.Tensor:
    """OCP MX v1.0 scale: 2^(floor(log2(amax)) - emax_elem) (emax 2 for E2M1, 8 for E4M3), clamped
    to the E8M0 range. floor(log2) comes from the bits: a float log2 rounds values just below a
    power of two up to it. A zero amax gives 2^-127; NaN and inf give NaN."""
    codes = e8m0_encode(amax, "down")
    shifted = (codes.int() - element_emax).clamp(0, 254)
    return e8m0_decode(torch.where(codes == E8M0_NAN_CODE, E8M0_NAN_CODE, shifted))


def e4m3_scale(amax: torch.Tensor, max_value: float = E2M1_MAX) -> torch.Tensor:
    """Main-KV scale: E4M3(max(amax, max_value * 2^-9) / max_value), round-to-nearest-even,
    saturating, as fp32. The floor (the reference's) is the smallest E4M3 value, so a zero block
    gets a nonzero scale and decodes to zeros."""
    return e4m3_decode(e4m3_encode(amax.float().clamp_min(max_value * 2**-9) / max_value))
