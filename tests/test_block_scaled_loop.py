"""The compiled loop of decode-sized quantized products (`cpu_loops.block_scaled_rows`): its order
against a machine-independent twin, its bits against the block-scaled GEMM where the per-shape
check admits it, and the paths that must not take it."""

import pytest
import torch

from dsv41.kernels import cpu_loops
from dsv41.model import quant
from dsv41.model.layers import Linear, LinearsBeside, Storage, quantize_rows
from dsv41.model.numerics import stable_numerics


def _fp8(rng: torch.Generator, *shape: int, spread: float = 4.0) -> torch.Tensor:
    """FP8 values as fp32, as the quantized linears' inputs and weights hold them."""
    return (torch.randn(*shape, generator=rng) * spread).to(torch.float8_e4m3fn).float()


def _scales(rng: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.exp2(torch.randint(-12, 12, shape, generator=rng).float())


def _fma_twin(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The loop's order in torch: each 32-product block summed from +0 by fused multiply-adds (the
    product of two FP8 values and its sum with an fp32 accumulator are exact in float64 here, so
    one rounding to fp32 per step is the fused operation), times the row's scale, times the
    column's, the blocks added in K order from +0."""
    m, k = a.shape
    out = torch.zeros(m, w.size(0))
    for kb in range(k // 32):
        acc = torch.zeros(m, w.size(0))
        for c in range(kb * 32, kb * 32 + 32):
            acc = (acc.double() + a[:, c : c + 1].double() * w[:, c].double()).float()
        out += (acc * a_scale[:, kb : kb + 1]) * w_scale[:, kb]
    return out


def _loop(a, a_scale, w, w_scale) -> torch.Tensor:
    return quant.block_scaled_rows(a, a_scale, quant.loop_layout(w, w_scale))


def test_the_loop_sums_each_block_by_fused_multiply_adds_in_order(rng):
    """On any machine: far-apart scales, so that another order of the blocks or within them shows;
    row counts that the loop takes four at a time, one at a time, and both."""
    for m, n, nk in [(1, 1, 1), (1, 96, 6), (3, 37, 4), (16, 64, 2), (7, 45, 3)]:
        a, w = _fp8(rng, m, nk * 32), _fp8(rng, n, nk * 32)
        a_scale, w_scale = _scales(rng, m, nk), _scales(rng, n, nk)
        got = _loop(a, a_scale, w, w_scale)
        assert torch.equal(got.view(torch.int32), _fma_twin(a, a_scale, w, w_scale).view(torch.int32)), (m, n, nk)


def test_the_loop_keeps_the_order_within_a_block_on_order_revealing_values(rng):
    """Random FP8 products of one block mostly sum exactly in any order; these do not. Each row is
    ±448 at even places and ±2^-9 at odd ones, each column 448 and -448 at two even places and 2^-9
    at an odd one of a block: products about ±2^17.6 and ±2^-18, so the small one survives only if
    it is not added to a sum holding one large one. Rows 0-8 take both the four-row and the
    one-row paths; any other order of a block's multiply-adds loses or keeps other small ones."""
    m, n, nk = 9, 96, 2
    places = torch.arange(nk * 32)
    signs = torch.randint(0, 2, (m, nk * 32), generator=rng).float() * 2 - 1
    a = (torch.where(places % 2 == 0, 448.0, 2.0**-9) * signs).to(torch.float8_e4m3fn).float()
    w = torch.zeros(n, nk * 32)
    for j in range(n):
        block = int(torch.randint(0, nk, (), generator=rng)) * 32
        even = block + 2 * torch.randperm(16, generator=rng)[:2]
        odd = block + 1 + 2 * torch.randint(0, 16, (), generator=rng)
        w[j, even], w[j, odd] = torch.tensor([448.0, -448.0]), 2.0**-9
    w = w.to(torch.float8_e4m3fn).float()
    ones_a, ones_w = torch.ones(m, nk), torch.ones(n, nk)
    want = _fma_twin(a, ones_a, w, ones_w)
    assert (want != 0).any() and (want == 0).any()  # the values reveal the order: some kept, some lost
    assert torch.equal(_loop(a, ones_a, w, ones_w).view(torch.int32), want.view(torch.int32))


def test_runs_of_rows_take_each_runs_weight_in_place(rng):
    """Run e by weight e of the stacked layout; empty runs (experts no token chose) at the start, in
    the middle and at the end are skipped."""
    experts, nk, n = 6, 3, 48
    w, w_scale = _fp8(rng, experts, n, nk * 32), _scales(rng, experts, n, nk)
    layout = quant.loop_layout(w, w_scale)
    lengths = [0, 3, 0, 1, 5, 0]
    a, a_scale = _fp8(rng, sum(lengths), nk * 32), _scales(rng, sum(lengths), nk)
    got = quant.runs_block_scaled_rows(a, a_scale, layout, torch.tensor(lengths).cumsum(0))
    start = 0
    for e, length in enumerate(lengths):
        rows = slice(start, start + length)
        assert torch.equal(got[rows], _loop(a[rows], a_scale[rows], w[e], w_scale[e]))
        start += length


@pytest.mark.parametrize("threads", [1, 2])
def test_where_the_check_admits_the_loop_it_gives_the_gemms_bits(rng, threads):
    """Both products at the shapes of `small` and `mini` and at every row count the loop takes; a
    shape the check refuses keeps the GEMM (the loop is then not used: see below)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        admitted = 0
        for k, n in [(192, 96), (192, 448), (128, 192), (256, 1024), (512, 256)]:
            if not quant._loop_keeps_bits(k, n, threads):
                continue
            admitted += 1
            w, w_scale = _fp8(rng, n, k), _scales(rng, n, k // 32)
            for m in range(1, quant.LOOP_ROWS + 1):
                a, a_scale = _fp8(rng, m, k), _scales(rng, m, k // 32)
                want = quant.block_scaled_matmul(a, a_scale, w, w_scale)
                assert torch.equal(_loop(a, a_scale, w, w_scale).view(torch.int32), want.view(torch.int32)), (k, n, m)
        print(f"loop admitted at {admitted} of 5 shapes on {threads} thread(s)")
    finally:
        torch.set_num_threads(previous)


def test_the_check_refuses_a_loop_one_ulp_off_and_admits_an_exact_one(monkeypatch):
    """Against a GEMM replaced by the loop's own order the check must admit it; with the loop's
    result one ulp off at one row count it must refuse it."""
    check = quant._loop_keeps_bits.__wrapped__
    monkeypatch.setattr(quant, "block_scaled_matmul", lambda a, s, w, ws, block=32: _fma_twin(a, s, w, ws))
    assert check(64, 24, 1)
    exact = cpu_loops.block_scaled_rows

    def off_at_five_rows(a, a_scale, w_t, w_scale_t, out):
        exact(a, a_scale, w_t, w_scale_t, out)
        if a.shape[0] == 5:
            out[4, 3] = torch.nextafter(torch.tensor(out[4, 3]), torch.tensor(torch.inf)).item()

    monkeypatch.setattr(cpu_loops, "block_scaled_rows", off_at_five_rows)
    assert not check(64, 24, 1)


@pytest.fixture
def no_loop(monkeypatch):
    """The loop made to fail if called."""
    def refuse(*args):
        raise AssertionError("the compiled loop ran")

    monkeypatch.setattr(cpu_loops, "block_scaled_rows", refuse)
    monkeypatch.setattr(cpu_loops, "runs_block_scaled_rows", refuse)
    monkeypatch.setattr(cpu_loops, "quantized_block_scaled_rows", refuse)


def _linear(rng: torch.Generator, storage: Storage, n_in: int = 96, n_out: int = 64) -> Linear:
    linear = Linear(n_in, n_out, storage)
    with torch.no_grad():
        if storage is Storage.FP8:
            values, scale = quant.quantize_weight_fp8(torch.randn(n_out, n_in, generator=rng))
            linear.weight.copy_(values)
            linear.scale.copy_(scale)
        else:
            packed, scale = quant.fp4_quant(torch.randn(n_out, n_in, generator=rng), 32, e4m3_scale=False)
            linear.weight.copy_(packed)
            linear.scale.copy_(scale.to(torch.float8_e8m0fnu))
    return linear


@pytest.mark.parametrize("storage", [Storage.FP8, Storage.FP4])
def test_quantized_linears_give_the_same_bits_with_and_without_the_loop(rng, storage, monkeypatch):
    linear, other = _linear(rng, storage), _linear(rng, storage, n_out=40)
    beside = LinearsBeside(linear, other)
    with torch.inference_mode():
        for rows in (1, 3, quant.LOOP_ROWS):
            x = (torch.randn(rows, 96, generator=rng) * 3).bfloat16()
            with_loop = [linear(x), *beside(x)]
            monkeypatch.setattr(quant, "LOOP_ROWS", 0)
            without = [linear(x), *beside(x)]
            monkeypatch.undo()
            for got, want in zip(with_loop, without, strict=True):
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), rows


def test_the_loop_is_used_where_the_check_admits_it_and_nowhere_else(rng, monkeypatch):
    """A linear given its input quantizes and multiplies in one call; given quantized rows (an input
    shared with other linears), it multiplies them."""
    linear = _linear(rng, Storage.FP8)
    x = torch.randn(4, 96, generator=rng).bfloat16()
    calls = []
    for name in ("block_scaled_rows", "quantized_block_scaled_rows"):
        exact = getattr(cpu_loops, name)
        monkeypatch.setattr(cpu_loops, name, lambda *a, name=name, exact=exact: calls.append((name, a[0].shape[0]))
                            or exact(*a))
    admitted = quant._loop_keeps_bits(96, 64, torch.get_num_threads())
    with torch.inference_mode():
        linear(x)
        linear(x, quantize_rows(x))
        assert calls == ([("quantized_block_scaled_rows", 4), ("block_scaled_rows", 4)] if admitted else [])
        before = list(calls)
        monkeypatch.setattr(quant, "_loop_keeps_bits", lambda *a: False)
        linear(x)
        linear(x, quantize_rows(x))
        assert calls == before


def test_quantizing_and_multiplying_in_one_call_gives_the_two_calls_bits(rng):
    """`quant.quantized_block_scaled_rows` against `quantize_rows` then `block_scaled_rows`, on
    rows spread over wide ranges; a row with an infinity is left to the general quantizer (None)."""
    w, w_scale = _fp8(rng, 48, 96), _scales(rng, 48, 3)
    layout = quant.loop_layout(w, w_scale)
    for rows in (1, 5, quant.LOOP_ROWS):
        x = torch.randn(rows, 96, generator=rng) * torch.exp2(torch.randint(-20, 20, (rows, 3, 1), generator=rng)
                                                              .float()).expand(-1, -1, 32).flatten(1)
        for source in (x, x.bfloat16()):
            got = quant.quantized_block_scaled_rows(source, layout)
            want = quant.block_scaled_rows(*quantize_rows(source), layout)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), rows
    x[0, 7] = torch.inf
    assert quant.quantized_block_scaled_rows(x, layout) is None


@pytest.mark.usefixtures("no_loop")
def test_stable_numerics_autograd_and_long_inputs_keep_the_gemm(rng):
    linear = _linear(rng, Storage.FP8)
    x = torch.randn(3, 96, generator=rng).bfloat16()
    with stable_numerics(), torch.inference_mode():
        linear(x)
    with torch.enable_grad():
        linear(x)
    with torch.inference_mode():
        linear(torch.randn(quant.LOOP_ROWS + 1, 96, generator=rng).bfloat16())


def test_scaled_blocks_added_by_the_loop_give_the_operators_bits(rng):
    """A prompt chunk's block products scaled and added in K order (`quant._add_scaled_blocks`):
    the one-pass loop gives the operators' bits (on two threads), with signed zeros, infinities,
    NaNs, and scales that take products into the denormals and past fp32's range."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for blocks, rows, n in ((1, 3, 5), (4, 128, 256), (8, 512, 128), (8, 170, 96)):
            partials = torch.randn(blocks, rows, n, generator=rng) * 8
            partials[0, 0, :3] = torch.tensor([-0.0, float("inf"), float("nan")])
            partials[-1, -1, -1] = -0.0
            a_scale = torch.exp2(torch.randint(-70, 70, (blocks, rows), generator=rng).float())
            w_scale = torch.exp2(torch.randint(-70, 70, (blocks, n), generator=rng).float())
            partials[:, 1, 0], partials[0, 1, 0] = 0.0, 1.5 + float(torch.rand((), generator=rng))
            a_scale[0, 1], w_scale[0, 0] = 2.0**-70, 2.0**-70  # a product rounded into the denormals
            want = quant._add_scaled_blocks_by_operators(partials.clone(), a_scale, w_scale)
            with torch.inference_mode():
                got = quant._add_scaled_blocks(partials.clone(), a_scale, w_scale)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (blocks, rows, n)
            assert want.isnan().any() and want.isinf().any() and (want.abs() < 2.0**-126).logical_and(want != 0).any()
    finally:
        torch.set_num_threads(previous)
