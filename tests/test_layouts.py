import math

import pytest
import torch

from dsv41.config import index_k_entry_bytes, load_config, main_kv_entry_bytes, swa_entry_bytes
from dsv41.kernels import codecs, cpu_loops
from dsv41.kernels.layouts import (
    index_k_format,
    main_kv_format,
    pack_rows,
    quantize_dequantize,
    swa_format,
    unpack_rows,
)
from dsv41.model.quant import fp8_qdq, fp8_quant, main_kv_qdq, mxfp4_qdq


def test_entry_sizes_are_288_68_528_by_construction():
    assert main_kv_format(512).entry_bytes == main_kv_entry_bytes(512) == 288
    assert index_k_format(128).entry_bytes == index_k_entry_bytes(128) == 68
    assert swa_format(512).entry_bytes == swa_entry_bytes(512) == 528
    assert main_kv_format(512).entry_bytes % 16 == 0 and swa_format(512).entry_bytes % 16 == 0


@pytest.mark.parametrize(("fmt", "qdq"), [(main_kv_format(512), main_kv_qdq), (index_k_format(128), mxfp4_qdq),
                                          (swa_format(512), fp8_qdq)])
def test_packed_rows_unpack_to_the_reference_fake_quantization(rng, fmt, qdq):
    x = (torch.randn(3, 7, fmt.dim, generator=rng) * torch.rand(3, 7, 1, generator=rng) * 20).bfloat16()
    packed = pack_rows(x, fmt)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 7, fmt.entry_bytes)
    assert torch.equal(unpack_rows(packed, fmt), qdq(x))
    assert torch.equal(quantize_dequantize(x, fmt), qdq(x))


def test_main_kv_entry_layout_codes_then_e4m3_scales():
    x = torch.zeros(512, dtype=torch.bfloat16)
    x[0], x[1], x[16] = 6.0, -3.0, 0.5
    packed = pack_rows(x, main_kv_format(512))
    assert packed[0].item() == (0xD << 4) | 0x7  # channel 0 (6.0, code 7) low, channel 1 (-3.0, code 0xD) high
    assert codecs.e4m3_decode(packed[256:257]).item() == 1.0  # scale of channels 0..15: E4M3(6/6)
    assert codecs.e4m3_decode(packed[257:258]).item() == 0.0859375  # E4M3(0.5/6 = 0.0833): 0.0859 is nearest


def test_swa_entry_layout_e4m3_values_then_e8m0_scales():
    x = torch.zeros(512, dtype=torch.bfloat16)
    x[33] = 100.0
    packed = pack_rows(x, swa_format(512))
    assert codecs.e8m0_decode(packed[513:514]).item() == 0.25  # block 1: 2^ceil(log2(100/448))
    assert codecs.e4m3_decode(packed[33:34]).item() == 384.0  # 100 / 0.25 = 400 -> 384 (ties to even)


def test_wrong_shapes_are_rejected():
    with pytest.raises(ValueError, match="main KV rows have 512 channels, got 64"):
        pack_rows(torch.zeros(2, 64), main_kv_format(512))
    with pytest.raises(ValueError, match="SWA entries are 528 bytes, got 500"):
        unpack_rows(torch.zeros(2, 500, dtype=torch.uint8), swa_format(512))


def test_packed_cache_holds_the_plan_bytes():
    from dsv41.model.cache import DecodeCache

    config = load_config("mini")
    cache = DecodeCache.allocate(config, batch=1, capacity=1024, packed=True)
    for layer, group in cache.groups.items():  # entries of 1024 positions: whole pages in every group
        n = 1024 // config.plan.layers[layer].ratio
        for store in (group.main_kv, group.index_k):
            store.put_raw(0, torch.randint(0, 256, (n, store.fmt.entry_bytes), dtype=torch.uint8))
    global_bytes = sum(g.main_kv.nbytes + g.index_k.nbytes for g in cache.groups.values())
    cache.length = 1024
    assert global_bytes == 890 * 1024 == cache.global_kv_bytes_held()
    assert sum(w.nbytes for w in cache.windows.values()) == 40 * 128 * 528


def test_an_unpacked_cache_reports_the_bf16_bytes_it_holds():
    """The reference path's bf16 caches are not 890 B a token: what a cache reports holding is
    what its pages and rings take, packed or not."""
    from dsv41.model.cache import DecodeCache

    config = load_config("mini")
    held = {}
    for packed in (True, False):
        cache = DecodeCache.allocate(config, batch=1, capacity=1024, packed=packed)
        cache.reserve(1024)  # entries of 1024 positions fill whole pages in every group
        cache.length = 1024
        pages = sum(g.main_kv.nbytes + g.index_k.nbytes for g in cache.groups.values())
        assert cache.global_kv_bytes_held() == pages
        assert cache.swa_bytes_held() == sum(w.nbytes for w in cache.windows.values())
        held[packed] = cache.global_kv_bytes_held() / 1024
    assert held[True] == 890
    assert held[False] == 3200  # bf16 main KV rows of 512 and index keys of 128, at ratios 1 and 2


@pytest.mark.parametrize("fmt", [main_kv_format(64), index_k_format(64), swa_format(64)], ids=lambda f: f.name)
def test_unpacking_to_bf16_equals_rounding_the_fp32_values(fmt):
    """Rows decode in bf16 directly; every code byte with every scale code (subnormal, NaN) gives
    bit for bit the fp32 values rounded to bf16 (NaN where they are NaN)."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(256, -(-fmt.code_bytes // 256))[:, : fmt.code_bytes]
    scales = torch.arange(256, dtype=torch.uint8).view(-1, 1).repeat(1, fmt.scale_bytes)
    rows = torch.cat([codes.roll(1, dims=0), scales], dim=1)
    direct = unpack_rows(rows, fmt, torch.bfloat16)
    rounded = unpack_rows(rows, fmt, torch.float32).bfloat16()
    nan = rounded.isnan()
    assert torch.equal(direct.isnan(), nan) and nan.any()
    assert torch.equal(direct[~nan].view(torch.int16), rounded[~nan].view(torch.int16))


def _rows_with_special_values(rng: torch.Generator, dim: int) -> torch.Tensor:
    """Fresh random rows with NaN (both signs) and ±inf at random places, one all-zero block of 16
    and one all-NaN block of 32."""
    x = torch.randn(6, dim, generator=rng) * torch.exp2(torch.randint(-10, 10, (6, 1), generator=rng).float())
    specials = torch.tensor([math.nan, -math.nan, math.inf, -math.inf])
    where = torch.rand(6, dim, generator=rng) < 0.05
    x[where] = specials[torch.randint(0, 4, (int(where.sum()),), generator=rng)]
    x[1, 16:32], x[2, 32:64] = 0.0, math.nan
    return x.bfloat16()


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int16), b[~nan].view(torch.int16))


@pytest.mark.parametrize(("fmt", "qdq"), [(main_kv_format(512), main_kv_qdq), (index_k_format(128), mxfp4_qdq),
                                          (swa_format(512), fp8_qdq)])
def test_packed_rows_with_special_values_unpack_to_the_fake_quantization(rng, fmt, qdq):
    x = _rows_with_special_values(rng, fmt.dim)
    packed = pack_rows(x, fmt)
    assert _same_values(unpack_rows(packed, fmt), qdq(x))
    scales = packed[..., fmt.code_bytes :]
    decoded = codecs.e4m3_decode(scales) if fmt.e4m3_scale else codecs.e8m0_decode(scales)
    assert decoded.isfinite().all() and (decoded > 0).all()  # no block lost to a NaN or zero scale
    assert unpack_rows(packed, fmt)[1, 16:32].eq(0).all()


@pytest.mark.parametrize("fmt", [main_kv_format(512), index_k_format(128), swa_format(512), main_kv_format(64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_unpacking_by_table_gives_the_bits_of_decoding_then_scaling(fmt, dtype):
    """`unpack_rows` looks each code byte up with its block's scale byte in one table; every
    (scale, code) pair, NaN codes and scales included, gives the bits of decoding the codes and the
    scales and multiplying them in the working dtype; the blocks of a row have different scales."""
    codes = torch.arange(fmt.code_bytes, dtype=torch.int32)
    rows = []
    for scale in range(256):
        for first in range(0, 256, fmt.code_bytes):
            row_codes = (codes + first) % 256
            block_scales = (scale + 37 * torch.arange(fmt.scale_bytes, dtype=torch.int32)) % 256  # one per block
            rows.append(torch.cat([row_codes, block_scales]))
    packed = torch.stack(rows).to(torch.uint8)
    code_bytes, scale_bytes = packed[:, : fmt.code_bytes], packed[:, fmt.code_bytes :]
    values = codecs.e2m1_decode_bytes(code_bytes, dtype) if fmt.fp4 else codecs.e4m3_decode(code_bytes, dtype)
    scales = codecs.e4m3_decode(scale_bytes, dtype) if fmt.e4m3_scale else codecs.e8m0_decode(scale_bytes).to(dtype)
    want = (values.unflatten(-1, (-1, fmt.block)) * scales.unsqueeze(-1)).flatten(-2)
    got = unpack_rows(packed, fmt, dtype)
    as_int = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert got.dtype == dtype and torch.equal(got.view(as_int), want.view(as_int))
    assert want.isnan().any()  # the NaN codes and scales were among them


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_swa_rows_packed_by_the_loop_are_the_operators_bytes(rng, dtype):
    """SWA rows on the CPU are packed by one compiled loop (`cpu_loops.fp8_pack_rows`); its bytes
    are those of fp8_quant's codes and the scales' E8M0 bytes, over wide ranges, values halfway
    between two E4M3 values, signed zeros and values below the amax floor; rows with a NaN or an
    infinity take the operators."""
    fmt = swa_format(128)
    x = torch.randn(6, 4, 128, generator=rng) * torch.exp(torch.randn(6, 4, 4, 1, generator=rng) * 8).expand(
        -1, -1, -1, 32).flatten(-2)
    x[0, 0, :32] = torch.tensor([-0.0, 0.0] * 16)
    x[0, 1, :32] = torch.randn(32, generator=rng) * 1e-7
    x[0, 2, :8] = torch.tensor([448.0, 1.0625, 1.1875, -3.375, 2.0**-10, 3 * 2.0**-10, -5 * 2.0**-10, 7.5 * 2.0**-9])
    x = x.to(dtype)
    values, scale = fp8_quant(x, 32)
    want = torch.cat([values.view(torch.uint8), codecs.e8m0_encode(scale, "up")], dim=-1)
    rows = x.reshape(-1, 128).float()
    assert cpu_loops.fp8_pack_rows(rows.numpy(), torch.empty(24, fmt.entry_bytes, dtype=torch.uint8).numpy())
    assert torch.equal(pack_rows(x, fmt), want)
    x[1, 1, 7], x[2, 0, 90] = float("nan"), float("inf")
    values, scale = fp8_quant(x, 32)
    assert torch.equal(pack_rows(x, fmt), torch.cat([values.view(torch.uint8), codecs.e8m0_encode(scale, "up")], -1))
