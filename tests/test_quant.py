"""Number formats: hand-checked cases against the format rules, and the official unit goldens."""

import math

import pytest
import torch
from safetensors.torch import load_file

from dsv41.kernels import codecs, cpu_loops
from dsv41.model import quant
from dsv41.model.layers import Linear, Storage, quantize_rows

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


# Special values (docs/kernels.md): a block's scale comes from its largest finite magnitude, so a NaN
# or ±inf element changes only itself; an all-zero block keeps the floor scale and decodes to zeros.

QUANTIZERS = {"fp8": (32, quant.FP8_MAX), "mxfp4": (32, quant.FP4_MAX), "main_kv": (16, quant.FP4_MAX)}


def _quantize(name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized values, the scale of every element) of quantizer `name`."""
    block, _ = QUANTIZERS[name]
    if name == "fp8":
        _, scale = quant.fp8_quant(x)
        return quant.fp8_qdq(x), scale.repeat_interleave(block, -1)
    _, scale = quant.fp4_quant(x, block, e4m3_scale=name == "main_kv")
    return quant.fp4_qdq(x, block, e4m3_scale=name == "main_kv"), scale.repeat_interleave(block, -1)


def _random_rows(rng: torch.Generator, rows: int = 6, dim: int = 128) -> torch.Tensor:
    """Fresh nonzero bf16 values over several magnitudes."""
    x = torch.randn(rows, dim, generator=rng) * torch.exp2(torch.randint(-12, 12, (rows, 1), generator=rng).float())
    return x.masked_fill(x == 0, 1.0).bfloat16()


def _special_positions(rng: torch.Generator, shape: tuple[int, ...]) -> torch.Tensor:
    """A few random positions, at least one per row."""
    mask = torch.rand(shape, generator=rng) < 0.03
    mask[torch.arange(shape[0]), torch.randint(0, shape[-1], (shape[0],), generator=rng)] = True
    return mask


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))


@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("special", [float("nan"), -float("nan"), float("inf"), -float("inf")],
                         ids=["nan", "-nan", "inf", "-inf"])
def test_a_non_finite_element_changes_only_itself(rng, name, special):
    x = _random_rows(rng)
    mask = _special_positions(rng, x.shape)
    got, scale = _quantize(name, x.masked_fill(mask, special))
    want, want_scale = _quantize(name, x.masked_fill(mask, 0.0))  # the same finite amax per block
    assert torch.equal(scale, want_scale) and (scale > 0).all()
    assert _bits_equal(got[~mask], want[~mask])
    _, element_max = QUANTIZERS[name]
    if special != special:  # E4M3 has a NaN; E2M1 has none and gives -0
        assert got[mask].isnan().all() if name == "fp8" else _bits_equal(got[mask], torch.full_like(got[mask], -0.0))
    else:  # saturates at the element format's largest value
        assert torch.equal(got[mask], (math.copysign(element_max, special) * scale[mask]).bfloat16())


@pytest.mark.parametrize("name", QUANTIZERS)
def test_an_all_zero_block_decodes_to_zeros_with_the_floor_scale(rng, name):
    x = _random_rows(rng)
    block, _ = QUANTIZERS[name]
    row, first = int(torch.randint(0, x.size(0), (1,), generator=rng)), block * int(torch.randint(0, 4, (1,),
                                                                                                 generator=rng))
    x[row, first : first + block] = torch.where(torch.rand(block, generator=rng) < 0.5, 0.0, -0.0)
    got, scale = _quantize(name, x)
    floor = {"fp8": codecs.pow2_scale_up(torch.tensor(1e-4), 448.0).item(), "mxfp4": 2.0**-126,
             "main_kv": 2.0**-9}[name]
    assert scale[row, first : first + block].eq(floor).all() and floor > 0
    assert got[row, first : first + block].eq(0).all() and not got.isnan().any()


@pytest.mark.parametrize("special", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_weight_quantizers_keep_a_non_finite_weight_to_itself(rng, special):
    w = torch.randn(64, 96, generator=rng)
    w = w.masked_fill(w == 0, 1.0)
    mask = _special_positions(rng, w.shape)
    q8, s8 = quant.quantize_weight_fp8(w.masked_fill(mask, special))
    want8, want_s8 = quant.quantize_weight_fp8(w.masked_fill(mask, 0.0))
    assert torch.equal(s8.view(torch.uint8), want_s8.view(torch.uint8))
    assert torch.equal(q8.view(torch.uint8)[~mask], want8.view(torch.uint8)[~mask])
    nan8 = q8.float()[mask].isnan()
    assert nan8.all() if special != special else (q8.float()[mask] == 448).all()
    q4, s4 = quant.quantize_weight_fp4(w.masked_fill(mask, special))
    want4, want_s4 = quant.quantize_weight_fp4(w.masked_fill(mask, 0.0))
    assert torch.equal(s4.view(torch.uint8), want_s4.view(torch.uint8))
    codes, want_codes = codecs.unpack_nibbles(q4), codecs.unpack_nibbles(want4)
    assert torch.equal(codes[~mask], want_codes[~mask])
    assert (codes[mask] == (0x7 if special == special else codecs.E2M1_NAN_CODE)).all()  # 6, or -0 for NaN


def test_an_all_zero_weight_tile_gets_the_floor_scale(rng):
    w = torch.randn(64, 64, generator=rng)
    w[32:, :32] = 0.0
    q, scale = quant.quantize_weight_fp8(w)
    assert scale.view(torch.uint8)[1, 0].item() == 127 - 22  # 2^ceil(log2(1e-4 / 448)) = 2^-22
    assert (q.float()[32:, :32] == 0).all() and not q.float().isnan().any()


def general_fp8_quant(x: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8_quant spelled out with the bit-exact codecs (the path a NaN element takes)."""
    groups = x.float().unflatten(-1, (-1, block))
    amax = groups.abs().nan_to_num(nan=0.0, posinf=0.0).amax(-1).clamp_min(1e-4)
    scale = codecs.pow2_scale_up(amax, quant.FP8_MAX)
    return quant.to_e4m3(groups / scale.unsqueeze(-1)).flatten(-2), scale


def test_fp8_quant_short_path_gives_the_codecs_bits(rng):
    """Magnitudes from 2^-140 to 2^120 (subnormal results, clamped scales, exact powers of two),
    with ±inf and -0 among them: the same E4M3 bytes and scales as the general codecs."""
    x = torch.randn(64, 256, generator=rng) * torch.pow(2.0, torch.randint(-140, 120, (64, 8), generator=rng)
                                                          .float()).repeat_interleave(32, dim=1)
    x[0, :32] = 2.0 ** torch.arange(-10, 22).float()  # powers of two: the scale must not round up
    x[1, 3], x[2, 40], x[3, 7] = torch.inf, -torch.inf, -0.0
    x[4, :32] = 0.0  # an all-zero block: the 1e-4 floor
    q, s = quant.fp8_quant(x)
    want_q, want_s = general_fp8_quant(x)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    x[5, 9] = torch.nan  # takes the general path
    q, s = quant.fp8_quant(x)
    want_q, want_s = general_fp8_quant(x)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)


def test_block_scaled_matmul_adds_the_blocks_in_k_order(rng):
    """The product with every block's partial scaled and added in K order from +0, as a plain loop
    does it (an fp32 sum in another order would differ in the last bits)."""
    a, a_scale = quant.fp8_quant(torch.randn(5, 320, generator=rng))
    w, w_scale = quant.fp8_quant(torch.randn(48, 320, generator=rng) * 3)
    a, w = a.float(), w.float()
    partials = torch.bmm(a.view(5, 10, 32).transpose(0, 1), w.view(48, 10, 32).permute(1, 2, 0))
    want = torch.zeros(5, 48)
    for i in range(10):
        want = want + partials[i] * a_scale[:, i : i + 1] * w_scale[:, i].unsqueeze(0)
    got = quant.block_scaled_matmul(a, a_scale, w, w_scale)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_quantize_rows_loop_gives_fp8_quant_bits(rng):
    """The CPU loop behind `quantize_rows` gives `fp8_quant`'s values and scales bit for bit: wide
    ranges in fp32 and bf16, values exactly halfway between two E4M3 values (normal and
    subnormal: ties go to even), blocks of signed zeros and of values below the 1e-4 amax floor,
    and rows with NaN or infinity (the general path)."""
    def check(x: torch.Tensor) -> None:
        want_q, want_s = quant.fp8_quant(x)
        values, scale = quantize_rows(x)
        assert torch.equal(values.view(torch.int32), want_q.reshape(values.shape).float().view(torch.int32))
        assert torch.equal(scale.view(torch.int32), want_s.reshape(scale.shape).view(torch.int32))

    block_scales = torch.exp(torch.randn(5, 3, 8, 1, generator=rng) * 8).expand(-1, -1, -1, 32)
    x = torch.randn(5, 3, 256, generator=rng) * block_scales.flatten(-2)
    check(x)
    check(x.bfloat16())
    rows = x.reshape(-1, 256)  # finite rows: the loop itself answered, not the general path
    assert cpu_loops.fp8_quantize_rows(rows.numpy(), torch.empty_like(rows).numpy(), rows.new_empty(15, 8).numpy())
    block = torch.randn(32, generator=rng) * 40
    block[0] = block.abs().max()  # the amax where the ties below do not overwrite it: the scale stays
    scale = quant.fp8_quant(block)[1]
    ties = torch.tensor([1.0625, 1.1875, 3.25 + 0.125, -1.0625, 2.0**-10, 3 * 2.0**-10, -5 * 2.0**-10, 7.5 * 2.0**-9])
    block[1 : 1 + ties.numel()] = ties * scale  # |ties| * scale stays below the block's amax
    assert quant.fp8_quant(block)[1] == scale
    zeros = torch.tensor([-0.0, 0.0] * 16)
    tiny = torch.randn(32, generator=rng) * 1e-7
    check(torch.stack([block, zeros, tiny]))
    special = torch.randn(3, 64, generator=rng)
    special[0, 5], special[2, 40] = float("nan"), -float("inf")
    check(special)


def test_quantize_rows_loop_rounds_every_e4m3_midpoint_and_boundary_as_fp8_quant(rng):
    """Every midpoint between two finite E4M3 values (either sign; ties to even), values at and just
    below the smallest normal 2^-6 and at the ±448 clamp, in blocks whose scales lie 2^±40 apart,
    from fp32 and bf16 rows: the loop's values and scales are `fp8_quant`'s bit for bit."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    middles = (grid[:-1] + grid[1:]) / 2  # exact in fp32
    n = 64
    x = torch.randn(n, 6, 32, generator=rng) * torch.exp2(torch.randint(-40, 40, (n, 6, 1), generator=rng).float())
    scale = quant.fp8_quant(x.reshape(n, 192))[1].reshape(n, 6, 1)
    picked = middles[torch.randint(0, middles.numel(), (n, 6, 10), generator=rng)]
    sign = torch.where(torch.rand(n, 6, 10, generator=rng) < 0.5, -1.0, 1.0)
    x[:, :, 20:30] = (picked * sign).clamp(-447, 447) * scale  # at most the block's amax: the scale stays
    x[:, :, 30], x[:, :, 31] = 2.0**-6 * scale[..., 0], -(2.0**-6 - 2.0**-10) * scale[..., 0]
    x[:8, :, 0] = 448 * scale[:8, :, 0]
    for rows in (x.reshape(n, 192), x.reshape(n, 192).bfloat16()):
        want_q, want_s = quant.fp8_quant(rows)
        values, scales = quantize_rows(rows)
        assert torch.equal(values.view(torch.int32), want_q.float().view(torch.int32))
        assert torch.equal(scales.view(torch.int32), want_s.view(torch.int32))


@pytest.mark.parametrize("block, e4m3_scale", [(32, False), (16, True)], ids=["mxfp4", "main_kv"])
def test_fp4_loop_gives_the_operators_bits(rng, monkeypatch, block, e4m3_scale):
    """`cpu_loops.fp4_quantize_rows` behind fp4_quant and fp4_qdq against the operators: blocks
    scaled far apart in fp32 and bf16, every E2M1 midpoint (ties go to the even code) and exact
    grid values, blocks of signed zeros, and tiny blocks at the scale floors; codes, scales and
    dequantized values bit for bit (signed zeros included)."""
    scales = torch.exp2(torch.randint(-30, 30, (6, 8, 1), generator=rng).float()).expand(-1, -1, block)
    x = torch.randn(6, 8 * block, generator=rng) * scales.flatten(-2)
    grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, -0.75, -3.5])
    x[0, :block] = grid.repeat(block // 16) * 2.0 ** int(torch.randint(-12, 12, (), generator=rng))
    x[1, :block] = torch.tensor([-0.0, 0.0]).repeat(block // 2)
    x[2, :block] = torch.randn(block, generator=rng) * 1e-39
    rows, codes = x.contiguous(), torch.empty(x.shape, dtype=torch.uint8)  # finite: the loop answers itself
    assert cpu_loops.fp4_quantize_rows(rows.numpy(), block, e4m3_scale, codes.numpy(), torch.empty_like(rows).numpy(),
                                       rows.new_empty(6, 8).numpy())
    for dtype in (torch.float32, torch.bfloat16):
        rows = x.to(dtype)
        by_loop = quant.fp4_quant(rows, block, e4m3_scale), quant.fp4_qdq(rows, block, e4m3_scale)
        monkeypatch.setattr(quant, "_fp4_by_loop", lambda *args: None)
        by_operators = quant.fp4_quant(rows, block, e4m3_scale), quant.fp4_qdq(rows, block, e4m3_scale)
        monkeypatch.undo()
        (codes, scale), values = by_loop
        (want_codes, want_scale), want_values = by_operators
        assert torch.equal(codes, want_codes) and torch.equal(scale.view(torch.int32), want_scale.view(torch.int32))
        assert torch.equal(values.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           want_values.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))
    none = torch.empty(1, 0, 8 * block)  # a step without rows: the operators' shapes
    assert quant.fp4_quant(none, block, e4m3_scale)[1].shape == (1, 0, 8)
    assert quant.fp4_qdq(none, block, e4m3_scale).shape == none.shape


def _random_linear(n_in: int, n_out: int, storage: Storage, rng: torch.Generator) -> Linear:
    layer = Linear(n_in, n_out, storage)
    if storage is Storage.FP8:
        values, scale = quant.quantize_weight_fp8(torch.randn(n_out, n_in, generator=rng))
        layer.weight.data, layer.scale.data = values, scale
    else:
        layer.weight.data = torch.randint(-128, 128, layer.weight.shape, generator=rng, dtype=torch.int8)
        layer.scale.data = torch.randint(120, 128, layer.scale.shape, generator=rng,
                                         dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return layer


@pytest.mark.parametrize("storage", [Storage.FP8, Storage.FP4])
def test_linears_beside_give_each_linear_its_own_bits_and_hold_the_weights_once(rng, storage, monkeypatch):
    """LinearsBeside multiplies linears that share an input as one GEMM (at decode sizes, where the
    per-shape check allows it): every output must be the bits of that linear alone, at row counts
    inside and past SIDE_BY_SIDE_ROWS, the side-by-side path taken or not; the linears' own caches
    become views of the joined weights."""
    from dsv41.model import layers

    first, second = _random_linear(96, 64, storage, rng), _random_linear(96, 160, storage, rng)
    beside = layers.LinearsBeside(first, second)
    for rows in (1, 3, layers.SIDE_BY_SIDE_ROWS, layers.SIDE_BY_SIDE_ROWS + 1):
        x = (torch.randn(1, rows, 96, generator=rng) * 4).bfloat16()
        with torch.inference_mode():
            got = beside(x)
            assert [tuple(y.shape) for y in got] == [(1, rows, 64), (1, rows, 160)]
            assert torch.equal(got[0], first(x)) and torch.equal(got[1], second(x))
    values, _ = beside.joined()
    assert first.dequantized()[0].data_ptr() == values.data_ptr()
    assert second.dequantized()[0].untyped_storage().data_ptr() == values.untyped_storage().data_ptr()
    monkeypatch.setattr(layers, "_beside_keeps_bits", lambda *shape: False)  # a machine whose GEMM would not
    x = torch.randn(2, 96, generator=rng).bfloat16()
    with torch.inference_mode():
        assert [torch.equal(y, linear(x)) for y, linear in zip(beside(x), (first, second), strict=True)] == [True, True]
    replaced = _random_linear(96, 64, storage, rng)
    first.weight.data, first.scale.data = replaced.weight.data, replaced.scale.data  # new weights: joined anew
    monkeypatch.undo()
    with torch.inference_mode():
        assert torch.equal(beside(x)[0], replaced(x))


def test_filled_weight_caches_are_what_first_use_builds(rng):
    """fill_weight_caches dequantizes every quantized linear (and joins those side by side) up
    front: a forward afterwards dequantizes nothing and gives the bits of a model that built its
    caches on first use."""
    from dsv41.model import layers
    from dsv41.model.reference import random_model

    def quantized(model) -> list[layers.Linear]:
        return [m for m in model.modules() if isinstance(m, layers.Linear) and m.scale is not None]

    def filled(model) -> list[bool]:
        return [linear._dequant is not None and linear._dequant[0] == linear.version() for linear in quantized(model)]

    ids = torch.randint(3, 320, (1, 12), generator=rng)
    lazy, eager = random_model("micro", seed=3), random_model("micro", seed=3)
    assert not any(filled(eager))
    layers.fill_weight_caches(eager)
    assert all(filled(eager))
    beside = [v for m in eager.modules() for v in vars(m).values() if isinstance(v, layers.LinearsBeside)]
    assert beside and all(b._joined is not None for b in beside)
    assert all(b._joined_loop is not None for b in beside)
    alone = [linear for linear in quantized(eager) if all(linear not in b.linears for b in beside)]
    assert alone and all(linear._loop is not None for linear in alone)
    cached = {id(linear): linear._dequant[1] for linear in quantized(eager)}
    layouts = {id(linear): linear._loop[1] for linear in alone} | {id(b): b._joined_loop[1] for b in beside}
    with torch.inference_mode():
        assert torch.equal(eager(ids).logits, lazy(ids).logits)
    assert all(linear._dequant[1] is cached[id(linear)] for linear in quantized(eager))  # nothing rebuilt
    assert all(linear._loop[1] is layouts[id(linear)] for linear in alone)
    assert all(b._joined_loop[1] is layouts[id(b)] for b in beside)
