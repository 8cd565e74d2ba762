"""Each Triton kernel against its torch twin, on the CPU through Triton's interpreter."""

import math

import pytest
import torch

from dsv41.kernels import codecs, torch_ops
from dsv41.kernels.layouts import index_k_format, main_kv_format, swa_format
from dsv41.kernels.selection import topk_entries

triton_kernels = pytest.importorskip("dsv41.kernels.triton_kernels", reason="triton is not installed")
triton = pytest.importorskip("triton")
tl = triton.language


def _within_bf16_ulp(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within one bf16 ulp of each value, or of the largest value for outputs near zero (their
    error comes from summing terms of the larger magnitude in another order)."""
    want = want.float()
    bound = want.abs() * 2**-7 + want.abs().max() * 2**-8
    return bool(((got.float() - want).abs() <= bound).all())


@pytest.mark.parametrize("fmt", [main_kv_format(64), index_k_format(32), swa_format(64), main_kv_format(512),
                                 swa_format(512)], ids=lambda f: f"{f.name}-{f.dim}")
def test_pack_rows_is_bit_exact(rng, fmt):
    x = torch.randn(7, 3, fmt.dim, generator=rng) * torch.rand(7, 3, 1, generator=rng).pow(4) * 1000
    x[0, 0, :8] = torch.tensor([400.0, -0.0, 0.75, 1.75, 3.5, 1e-9, 2.5, 5.0])  # ties, -0, tiny
    x[1, 1] = 0.0  # an all-zero row takes the floor scale
    x = x.bfloat16()
    assert torch.equal(triton_kernels.pack_rows(x, fmt), torch_ops.pack_rows(x, fmt))


def _packed_case(rng, b=2, h=3, d=64, window=8, n=37, k=11):
    q = torch.randn(b, h, d, generator=rng).bfloat16()
    ring = torch_ops.pack_rows(torch.randn(b, window, d, generator=rng) * 3, swa_format(d))
    main = torch_ops.pack_rows(torch.randn(b, n, d, generator=rng) * 3, main_kv_format(d))
    slots = torch.randperm(window, generator=rng).repeat(b, 1).int()
    slots[0, 5:] = -1  # ring still filling
    topk = torch.randint(0, n, (b, k), generator=rng).int()
    topk[-1, 3:6] = -1  # fewer visible entries than k
    return q, ring, slots, main, topk, torch.randn(h, generator=rng)


def test_sparse_attention_decode_within_one_bf16_ulp(rng):
    args = _packed_case(rng)
    got = triton_kernels.sparse_attention_decode(*args, 64**-0.5)
    want = torch_ops.sparse_attention_decode(*args, 64**-0.5)
    assert _within_bf16_ulp(got, want)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # exp(sink + 1e30): the empty row's denominator
def test_sparse_attention_decode_with_nothing_visible_gives_zeros(rng):
    q, ring, slots, main, topk, sink = _packed_case(rng, b=1)
    slots[:], topk[:] = -1, -1
    got = triton_kernels.sparse_attention_decode(q, ring, slots, main, topk, sink, 0.125)
    assert torch.equal(got, torch.zeros_like(got))
    assert torch.equal(torch_ops.sparse_attention_decode(q, ring, slots, main, topk, sink, 0.125), got)


def test_sparse_attention_decode_reads_one_shared_pool_for_the_whole_batch(rng):
    """Paged caches: every sequence's entries sit in one pool, passed expanded over the batch
    (stride 0) with each sequence's pool rows; equal to a per-sequence copy of the pool."""
    q, ring, slots, main, topk, sink = _packed_case(rng, b=3, n=40)
    pool = main[:1]
    shared = triton_kernels.sparse_attention_decode(q, ring, slots, pool.expand(3, -1, -1), topk, sink, 0.125)
    copied = triton_kernels.sparse_attention_decode(q, ring, slots, pool.repeat(3, 1, 1), topk, sink, 0.125)
    assert torch.equal(shared, copied)
    assert _within_bf16_ulp(shared, torch_ops.sparse_attention_decode(q, ring, slots, pool.expand(3, -1, -1), topk,
                                                                      sink, 0.125))


def test_sparse_attention_decode_over_the_official_sizes(rng):
    args = _packed_case(rng, b=1, h=5, d=512, window=128, n=70, k=64)
    got = triton_kernels.sparse_attention_decode(*args, 512**-0.5)
    assert _within_bf16_ulp(got, torch_ops.sparse_attention_decode(*args, 512**-0.5))


def _index_case(rng, b=2, heads=5, d=32, n=41):
    q = torch.randn(b, heads, d, generator=rng).bfloat16()
    weights = torch.randn(b, heads, generator=rng).bfloat16()
    keys = torch_ops.pack_rows(torch.randn(b, n, d, generator=rng), index_k_format(d))
    return q, weights, keys


def test_index_scores_are_bit_exact_over_all_entries_and_over_a_pool(rng):
    q, weights, keys = _index_case(rng)
    assert torch.equal(triton_kernels.index_scores(q, weights, keys), torch_ops.index_scores(q, weights, keys))
    pool = torch.randint(0, keys.size(1), (2, 13), generator=rng)
    assert torch.equal(triton_kernels.index_scores(q, weights, keys, pool),
                       torch_ops.index_scores(q, weights, keys, pool))


def test_pool_scoring_equals_masking_full_scores_with_the_newest_block_kept(rng):
    q, weights, keys = _index_case(rng, b=1, n=40)
    full = torch_ops.index_scores(q, weights, keys)
    pool = torch_ops.select_candidate_blocks(full.float().unsqueeze(1), 38, 3, 4)[0, 0]
    assert pool[36:38].all()  # the newest block (entries 36..39, 38 visible) is always in
    ids = pool.nonzero().flatten().unsqueeze(0)
    restricted = triton_kernels.index_scores(q, weights, keys, ids)
    assert torch.equal(restricted[0], full[0, pool])


def test_topk_ties_go_to_the_newer_entry():
    scores = torch.tensor([[1.0, 3.0, 2.0, 3.0, -0.0, 0.0, 3.0, float("-inf")]]).bfloat16()
    assert topk_entries(scores, 2).tolist() == [[3, 6]]
    assert topk_entries(scores, 4).tolist() == [[1, 2, 3, 6]]
    assert topk_entries(scores[:, 4:6], 1).tolist() == [[1]]  # -0 equals +0: the higher id wins
    assert topk_entries(scores, 8).tolist() == [list(range(8))]  # more than visible: -inf ones last


def test_fused_mhc_update_matches_its_twin(rng):
    t, d = 5, 128
    x = torch.randn(1, t, 4, d, generator=rng).bfloat16()
    f = torch.randn(1, t, d, generator=rng).bfloat16()
    post, mix = torch.rand(1, t, 4, generator=rng) * 2, torch.rand(1, t, 4, generator=rng)
    comb = torch.softmax(torch.randn(1, t, 4, 4, generator=rng), -1)
    fn = torch.randn(24, 4 * d, generator=rng) * (4 * d) ** -0.5
    scale, base = 1 + 0.3 * torch.randn(3, generator=rng), 0.5 * torch.randn(24, generator=rng)
    got = triton_kernels.mhc_update(x, f, post, comb, mix, fn, scale, base, 20, 1e-6, 1e-20)
    want = torch_ops.mhc_update(x, f, post, comb, mix, fn, scale, base, 20, 1e-6, 1e-20)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # stream and collapse: exact
    for g, w in zip(got[2:], want[2:], strict=True):  # coefficients: fp32 sums in another order
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-6)
    assert torch.allclose(got[4].sum(-2), torch.ones(1, t, 4), atol=1e-5)


def test_an_unknown_kernel_backend_is_refused(monkeypatch):
    from dsv41.kernels import dispatch

    monkeypatch.setenv("DSV41_KERNELS", "cuda")
    with pytest.raises(ValueError, match="DSV41_KERNELS='cuda': use auto, triton or torch"):
        dispatch.pack_rows(torch.zeros(1, 64), main_kv_format(64))


@pytest.mark.parametrize("fmt", [main_kv_format(64), index_k_format(32), swa_format(64)], ids=lambda f: f.name)
def test_pack_rows_with_nan_inf_and_zero_blocks_is_bit_exact(rng, fmt):
    """Non-finite elements change only themselves and zero blocks take the floor scale, in both."""
    x = torch.randn(5, fmt.dim, generator=rng) * 10
    where = torch.rand(5, fmt.dim, generator=rng) < 0.1
    x[where] = torch.tensor([math.nan, -math.nan, math.inf, -math.inf])[torch.randint(0, 4, (int(where.sum()),),
                                                                                      generator=rng)]
    x[1, :32], x[2, :32] = 0.0, math.nan
    x = x.bfloat16()
    assert torch.equal(triton_kernels.pack_rows(x, fmt), torch_ops.pack_rows(x, fmt))


@triton.jit
def _codecs_kernel(x_ptr, amax_ptr, codes_ptr, e4m3_ptr, e2m1_ptr, scale_ptr, scale_code_ptr, e8m0_ptr,
                   N: tl.constexpr):
    """The kernels' codec helpers, element by element."""
    i = tl.arange(0, N)
    x = tl.load(x_ptr + i)
    tl.store(e4m3_ptr + i, triton_kernels._e4m3_encode(x))
    tl.store(e2m1_ptr + i, triton_kernels._e2m1_encode(x))
    scale, scale_code = triton_kernels._pow2_scale_up(tl.load(amax_ptr + i), 1.0)
    tl.store(scale_ptr + i, scale)
    tl.store(scale_code_ptr + i, scale_code)
    tl.store(e8m0_ptr + i, triton_kernels._e8m0_decode(tl.load(codes_ptr + i)))


def test_kernel_codec_helpers_agree_with_the_codecs_on_special_values(rng):
    """NaN (both signs), ±inf, ±0, subnormals and fresh random values through the kernels' encodes;
    subnormals, zero and every other fp32 exponent through their power-of-two scale; every E8M0 code
    (0 is 2^-127, 255 NaN) through their decode."""
    n = 256
    special = torch.tensor([math.nan, -math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-40, -1e-45, 464.0, 5.0])
    x = torch.cat([special, torch.randn(n - len(special), generator=rng) * torch.exp2(
        torch.randint(-12, 12, (n - len(special),), generator=rng).float())])
    subnormal_bits = torch.cat([torch.tensor([0, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFF]),
                                torch.randint(1, 2**23, (n // 2 - 5,), generator=rng)])
    fields = torch.arange(n // 2) * 2  # every other exponent field, 0..254
    normal_bits = fields * 2**23 + torch.randint(0, 2**23, (n // 2,), generator=rng)
    amax = torch.cat([subnormal_bits, normal_bits]).int().view(torch.float32)
    codes = torch.arange(n, dtype=torch.int32).to(torch.uint8)
    outs = [torch.empty(n, dtype=dt) for dt in (torch.int32, torch.int32, torch.float32, torch.int32, torch.float32)]
    _codecs_kernel[(1,)](x, amax, codes, *outs, n)
    e4m3, e2m1, scale, scale_code, e8m0 = outs
    assert torch.equal(e4m3.to(torch.uint8), codecs.e4m3_encode(x))
    assert torch.equal(e2m1.to(torch.uint8), codecs.e2m1_encode(x))
    assert torch.equal(scale.view(torch.int32), codecs.pow2_scale_up(amax, 1.0).view(torch.int32))
    assert torch.equal(scale_code.to(torch.uint8), codecs.e8m0_encode(amax, "up"))
    assert torch.equal(e8m0.view(torch.int32), codecs.e8m0_decode(codes).view(torch.int32))
