"""The dispatch shortcuts of the decode path give the bits of the plain torch expressions."""

import pytest
import torch

from dsv41.model import numerics
from dsv41.model.quant import block_scaled_matmul


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float64: torch.int64, torch.bfloat16: torch.int16}.get(t.dtype, torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_constant_tensors_and_mean_equal_the_python_number_forms(rng, dtype):
    x = (torch.randn(3, 5, 37, generator=rng) * torch.exp(torch.randn(3, 5, 37, generator=rng) * 4)).to(dtype)
    x[0, 0, :5] = -0.0
    for value in (1e-6, 1e-20, 2.0, 2.5, 3e-38):
        assert torch.equal(_bits(x + numerics.scalar(value, dtype)), _bits(x + value))
        assert torch.equal(_bits(x * numerics.scalar(value, dtype)), _bits(x * value))
        assert torch.equal(_bits(x / (x.abs() + numerics.scalar(value, dtype))), _bits(x / (x.abs() + value)))
    for dim in (-1, 1):
        assert torch.equal(_bits(numerics.mean(x, dim)), _bits(x.mean(dim, keepdim=True)))


def _block_products(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each 32-wide block's a_k w_k^T [K/32, M, N], from the product the functions under test use
    (its rows' bits alone and batched are checked below): this test is about adding the blocks."""
    from dsv41.model.quant import _block_products as products

    m, k = a.shape
    return products(a.view(m, k // 32, 32).transpose(0, 1), w.view(w.size(0), k // 32, 32).permute(1, 2, 0))


def test_block_scaled_matmul_adds_the_blocks_in_order_from_plus_zero(rng):
    """The loop it replaced: a zeroed fp32 accumulator, then every block's scaled partial in K order."""
    for m, n, nk in [(1, 1, 1), (1, 1, 24), (1, 192, 6), (3, 37, 9), (5, 8, 17)]:
        a, w = torch.randn(m, nk * 32, generator=rng), torch.randn(n, nk * 32, generator=rng)
        if m > 1:
            a[0] = -0.0  # a row of -0 partials: the sum from +0 gives +0
        a_scale = torch.exp2(torch.randint(-6, 6, (m, nk), generator=rng).float())
        w_scale = torch.exp2(torch.randint(-6, 6, (n, nk), generator=rng).float())
        partials = _block_products(a, w)
        scaled = partials * a_scale.t().unsqueeze(-1) * w_scale.t().unsqueeze(1)
        want = torch.zeros(m, n)
        for i in range(nk):
            want.add_(scaled[i])
        assert torch.equal(_bits(block_scaled_matmul(a, a_scale, w, w_scale)), _bits(want))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dots_equal_the_einsum_they_replace(rng, dtype):
    """`numerics.dots` (bmm on a transposed view) gives torch.einsum's bits for index-score shapes:
    MXFP4-rounded bf16 queries and keys, scales far apart, key counts around the GEMM's blockings and
    between the whole granules they are padded to, and one sequence's keys split into whole granules
    and a padded rest where the products are the smaller (5,000 keys: 4,864 and 136; 33,000: 32,768
    and 232)."""
    from dsv41.model.quant import mxfp4_qdq

    shapes = [(1, 4, 1, 128), (1, 4, 118, 32), (1, 4, 257, 128), (2, 32, 1000, 128), (3, 1, 4099, 64),
              (1, 16, 5000, 128), (1, 8, 33000, 128), (1, 4, 4096, 64), (1, 160, 3000, 64)]
    for n, heads, keys, dim in shapes:
        spread = torch.exp2(torch.randint(-30, 30, (n, keys, dim), generator=rng).float())
        k = mxfp4_qdq(torch.randn(n, keys, dim, generator=rng) * spread).to(dtype)
        q = mxfp4_qdq(torch.randn(n, heads, dim, generator=rng) * 8).to(dtype)
        got, want = numerics.dots(q, k), torch.einsum("bhd,btd->bht", q, k)
        assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want))


def test_index_scores_of_several_tokens_equal_the_reference_einsum(rng):
    """`Indexer.scores` (a prompt chunk's or a verification's tokens on unpacked keys, their
    (token, head) rows through `numerics.dots`) gives the bits of the reference's einsum formula."""
    from dsv41.model.attention import Indexer
    from dsv41.model.quant import mxfp4_qdq

    for b, s, heads, keys, dim in [(1, 4, 4, 5000, 128), (1, 37, 4, 300, 32), (2, 3, 8, 1000, 64)]:
        spread = torch.exp2(torch.randint(-20, 20, (b, keys, dim), generator=rng).float())
        k = mxfp4_qdq(torch.randn(b, keys, dim, generator=rng) * spread).bfloat16()
        q = mxfp4_qdq(torch.randn(b, s, heads, dim, generator=rng) * 8).bfloat16()
        weights = torch.randn(b, s, heads, generator=rng).bfloat16()
        dots = torch.einsum("bshd,btd->bsht", q, k)
        want = (dots.relu() * weights.unsqueeze(-1)).sum(dim=2)
        assert torch.equal(_bits(Indexer.scores(q, weights, k)), _bits(want)), (b, s, heads, keys, dim)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_projection_equals_the_einsum_it_replaces(rng, dtype):
    """`numerics.grouped_projection` (the output projection's bmm, called directly) gives
    torch.einsum's bits: one decode token, a batch's sequences one by one, multi-token forwards,
    the default model's and `mini`'s group shapes and others, strided inputs included."""
    for b, s, g, d, r in [(1, 1, 2, 128, 64), (1, 7, 2, 128, 64), (2, 33, 4, 96, 48), (1, 1, 8, 512, 1024),
                          (1, 130, 8, 512, 1024)]:
        x, w = torch.randn(b, s, g, d, generator=rng).to(dtype), torch.randn(g, r, d, generator=rng).to(dtype)
        for piece in (x, x.transpose(0, 1).contiguous().transpose(0, 1), x[:, : max(1, s // 2)]):
            got, want = numerics.grouped_projection(piece, w), torch.einsum("bsgd,grd->bsgr", piece, w)
            assert got.dtype == want.dtype and got.shape == want.shape
            assert torch.equal(_bits(got), _bits(want)), (b, s, g, d, r)


def test_index_scores_by_chunks_equal_one_pass_over_every_key(rng):
    """Index scores computed INDEX_CHUNK keys at a time equal the formula over all keys at once
    (unpack, einsum, ReLU, weighted sum over heads), for a whole key range and for a pool of ids,
    with key scales far apart so that another summation order would show."""
    from dsv41.kernels import torch_ops
    from dsv41.kernels.layouts import index_k_format, pack_rows, unpack_rows

    fmt, n = index_k_format(128), 2 * torch_ops.INDEX_CHUNK + 1234
    spread = torch.exp2(torch.randint(-30, 30, (2, n, 4, 1), generator=rng).float()).expand(2, n, 4, 32)
    keys = pack_rows(torch.randn(2, n, 128, generator=rng) * spread.flatten(-2), fmt)
    q = pack_rows(torch.randn(2, 8, 128, generator=rng) * 4, fmt)
    q = unpack_rows(q, fmt)
    weights = torch.randn(2, 8, generator=rng).bfloat16()

    def one_pass(rows: torch.Tensor) -> torch.Tensor:
        dots = torch.einsum("bhd,btd->bht", q, unpack_rows(rows, fmt))
        return (dots.relu() * weights.unsqueeze(-1)).sum(dim=1)

    assert torch.equal(_bits(torch_ops.index_scores(q, weights, keys)), _bits(one_pass(keys)))
    ids = torch.randint(-1, n, (2, torch_ops.INDEX_CHUNK + 77), generator=rng)
    want = one_pass(keys[torch.arange(2).unsqueeze(-1), ids.clamp(min=0)])
    assert torch.equal(_bits(torch_ops.index_scores(q, weights, keys, ids)), _bits(want))


def test_gather_rows_equals_indexing_by_batch_and_id(rng):
    """gather_rows (one index_select) picks what rows[batch, id] picks, -1 reading row 0, for
    per-sequence rows and for a page pool [1, n, ...] shared by the batch; mismatched batches fail."""
    from dsv41.kernels.torch_ops import gather_rows

    rows = torch.randint(0, 256, (3, 50, 68), generator=rng, dtype=torch.uint8)
    ids = torch.randint(-1, 50, (3, 17), generator=rng)
    want = rows[torch.arange(3).unsqueeze(-1), ids.clamp(min=0)]
    assert torch.equal(gather_rows(rows, ids), want)
    pool = rows[:1]
    assert torch.equal(gather_rows(pool, ids), pool[0][ids.clamp(min=0)])
    assert torch.equal(gather_rows(pool.expand(3, -1, -1), ids), pool[0][ids.clamp(min=0)])
    with pytest.raises(ValueError, match="cannot serve"):
        gather_rows(rows[:2], ids)


def test_sparse_attention_by_query_blocks_equals_each_query_alone(rng):
    """sparse_attention runs query_block(d) queries per pass and gathers keys by index_select;
    every query's output must be the bits of that query computed alone (its own indices, -1 slots
    too)."""
    from dsv41.kernels import torch_ops

    b, h, d, n = 2, 4, 64, 300
    m = 2 * torch_ops.query_block(d) + 5
    q = (torch.randn(b, m, h, d, generator=rng) * 3).bfloat16()
    kv = torch.randn(b, n, d, generator=rng).bfloat16()
    idx = torch.randint(-1, n, (b, m, 150), generator=rng).int()
    sink = torch.randn(h, generator=rng)
    got = torch_ops.sparse_attention(q, kv, sink, idx, d**-0.5)
    for j in range(m):
        alone = torch_ops.sparse_attention(q[:, j : j + 1], kv, sink, idx[:, j : j + 1], d**-0.5)
        assert torch.equal(_bits(got[:, j : j + 1]), _bits(alone))


def test_sparse_attention_does_not_depend_on_unused_slots_past_a_rows_last_index(rng):
    """A batch's index table is as wide as its widest row, so a row alone has a narrower table
    than in a batch. Padding a table with unused (-1) slots must not change a bit: the last chunk
    of 64 is summed as a whole chunk whatever the width (a 70-wide table's 6-key tail summed 6 wide
    differed from the same keys in a 72-wide one). Tails of 1-16 keys (where vector and scalar sums
    part) and small queries (close probabilities, so a reordered sum shows through the bf16
    output)."""
    from dsv41.kernels import torch_ops

    h, d, n = 4, 64, 200
    for _ in range(300):
        width = 64 * int(torch.randint(0, 3, (), generator=rng)) + int(torch.randint(1, 17, (), generator=rng))
        q = (torch.randn(1, 1, h, d, generator=rng) * 0.05).bfloat16()
        kv = torch.randn(1, n, d, generator=rng).bfloat16()
        idx = torch.randperm(n, generator=rng)[:width].int().view(1, 1, width)
        sink = torch.randn(h, generator=rng)
        alone = torch_ops.sparse_attention(q, kv, sink, idx, d**-0.5)
        for extra in (1, 2, 9, 17):
            wider = torch.nn.functional.pad(idx, (0, extra), value=-1)
            got = torch_ops.sparse_attention(q, kv, sink, wider, d**-0.5)
            assert torch.equal(_bits(got), _bits(alone)), (width, extra)


@pytest.mark.parametrize("threads", [1, 2])
def test_sparse_attention_gives_the_chunk_by_chunk_bits(rng, threads):
    """Small passes (a decode step's) take every chunk of 64 keys at once (_chunks_at_once) where this
    machine's GEMMs allow it; the result must be the reference walk's bits, chunk after chunk: with
    unused slots, whole unused chunks, batches of sequences and queries, any width."""
    from dsv41.kernels import torch_ops

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for trial in range(60):
            b, m = int(torch.randint(1, 9, (), generator=rng)), int(torch.randint(1, 3, (), generator=rng))
            h, d = [(4, 512), (8, 64), (16, 128)][trial % 3]
            width = int(torch.randint(1, 640, (), generator=rng))
            q = (torch.randn(b, m, h, d, generator=rng) * float(torch.rand((), generator=rng) * 4)).bfloat16()
            kv = torch.randn(b, 700, d, generator=rng).bfloat16()
            idx = torch.randint(-1, 700, (b, m, width), generator=rng).int()
            if trial % 4 == 0:
                idx[..., :64] = -1
            sink = torch.randn(h, generator=rng)
            padded = torch.nn.functional.pad(idx, (0, -width % 64), value=-1)
            want = torch_ops._chunk_by_chunk(q, kv.float(), sink, padded, d**-0.5)
            assert torch.equal(_bits(torch_ops.sparse_attention(q, kv, sink, idx, d**-0.5)), _bits(want)), trial
    finally:
        torch.set_num_threads(previous)


def test_chunks_are_taken_at_once_only_where_the_batched_products_keep_each_chunks_bits(monkeypatch):
    """The check behind _chunks_at_once compares fp32 products, which a bf16 output would mostly
    hide: products made chunk by chunk pass it, and the same products one ulp off in one chunk
    count fail it (so sparse_attention takes the reference walk)."""
    from dsv41.kernels import torch_ops

    def dots_by_chunk(qf, keys):
        n, h, d = qf.shape
        flat = keys.view(n, -1, torch_ops.ATTENTION_CHUNK, d)
        return torch.stack([numerics.einsum("bmhd,bmkd->bmhk", qf[:, None], flat[:, None, c])[:, 0]
                            for c in range(flat.size(1))], dim=1)

    def pv_by_chunk(probs, keys):
        n, chunks, h, k = probs.shape
        flat = keys.view(n, chunks, k, -1)
        return torch.stack([numerics.einsum("bmhk,bmkd->bmhd", probs[:, None, c], flat[:, None, c])[:, 0]
                            for c in range(chunks)], dim=1)

    def pv_off_at_three_chunks(probs, keys):
        out = pv_by_chunk(probs, keys)
        return torch.nextafter(out, torch.full_like(out, torch.inf)) if probs.size(1) == 3 else out

    monkeypatch.setattr(torch_ops, "_chunk_dots", dots_by_chunk)
    monkeypatch.setattr(torch_ops, "_chunk_pv", pv_by_chunk)
    assert torch_ops._chunks_at_once_keep_bits.__wrapped__(4, 64, 1)
    monkeypatch.setattr(torch_ops, "_chunk_pv", pv_off_at_three_chunks)
    assert not torch_ops._chunks_at_once_keep_bits.__wrapped__(4, 64, 1)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_of_a_block_scaled_product_gets_the_same_bits_alone_as_in_a_batch(rng, threads):
    """Batched == alone at the bottom: FP8 rows (what the quantized linears take) multiplied one at
    a time and as a batch of 2..9. On MKL with AVX-512/AMX a one-row product used to take the
    matrix-vector kernel and come out in other bits than the same row beside others; on AVX2 one
    to three rows each sum another way than four or more, and at one block with two threads five
    to seven rows another way than nine (the shape (37, 1) runs four rows at a time there)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _rows_alone_and_batched(rng)
    finally:
        torch.set_num_threads(previous)


def _rows_alone_and_batched(rng) -> None:
    def fp8(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=rng) * 16).to(torch.float8_e4m3fn).float()

    for _ in range(20):
        m = int(torch.randint(2, 10, (), generator=rng))
        for n, nk in [(64, 8), (512, 32), (256, 2), (37, 1)]:
            a, w = fp8(m, nk * 32), fp8(n, nk * 32)
            a_scale = torch.exp2(torch.randint(-6, 6, (m, nk), generator=rng).float())
            w_scale = torch.exp2(torch.randint(-6, 6, (n, nk), generator=rng).float())
            batch = block_scaled_matmul(a, a_scale, w, w_scale)
            for i in range(m):
                alone = block_scaled_matmul(a[i:i + 1], a_scale[i:i + 1], w, w_scale)
                assert torch.equal(_bits(alone), _bits(batch[i:i + 1])), (m, n, nk, i)


def test_rows_run_four_at_a_time_where_a_batched_product_would_sum_them_otherwise(rng, monkeypatch):
    """Where the per-shape check finds a batch's rows summed otherwise than alone, the product runs
    ALONE_ROWS rows at a time: the same bits as each row's own (padded) product."""
    from dsv41.model import quant

    monkeypatch.setattr(quant, "_many_rows_keep_bits", lambda w: False)
    a, w = torch.randn(4, 7, 32, generator=rng), torch.randn(4, 40, 32, generator=rng).transpose(1, 2)
    rows = quant._block_products(a, w)
    for i in range(7):
        assert torch.equal(_bits(rows[:, i]), _bits(quant._block_products(a[:, i:i + 1], w)[:, 0]))


def test_rows_take_only_the_places_that_sum_them_as_alone(rng, monkeypatch):
    """Where a product sums the rows at some places otherwise than at the first (MKL's SSE4.2
    kernels: the odd places), the rows go two to a product at the faithful places, the others zero:
    each row's bits are its own padded product's, in any batch."""
    from dsv41.model import quant

    monkeypatch.setattr(quant, "_places_as_alone", lambda w: (0, 2))
    monkeypatch.setattr(quant, "_many_rows_keep_bits", lambda w: False)
    products = []
    bmm = quant.numerics.bmm
    monkeypatch.setattr(quant.numerics, "bmm", lambda a, w: products.append(a.clone()) or bmm(a, w))
    a, w = torch.randn(3, 7, 32, generator=rng), torch.randn(3, 40, 32, generator=rng).transpose(1, 2)
    rows = quant._block_products(a, w)
    assert len(products) == 4 and all(p.size(1) == quant.ALONE_ROWS for p in products)
    assert all(not p[:, [1, 3]].any() for p in products)  # the odd places hold zero rows
    for i in range(7):
        assert torch.equal(_bits(rows[:, i]), _bits(quant._block_products(a[:, i : i + 1], w)[:, 0]))


def test_the_place_check_finds_places_that_sum_otherwise(monkeypatch):
    """A product that sums every row alike leaves all four places; one whose rows at odd places
    come out one ulp away (as MKL's SSE4.2 kernels sum them otherwise) leaves the even ones."""
    from dsv41.model import quant

    def alike(a, b):  # every row's sums in float64, the same at any place
        return (a.double() @ b.double()).float()

    def odd_places_otherwise(a, b):
        out = alike(a, b)
        out[:, 1::2] = torch.nextafter(out[:, 1::2], torch.full_like(out[:, 1::2], torch.inf))
        return out

    w = torch.randn(2, 24, 32).transpose(1, 2)  # [blocks, 32, N] as `block_scaled_matmul` lays it out
    for product, places in ((alike, (0, 1, 2, 3)), (odd_places_otherwise, (0, 2))):
        monkeypatch.setattr(quant, "_PLACES_AS_ALONE", {})
        monkeypatch.setattr(torch, "bmm", product)
        assert quant._places_as_alone(w) == places


@pytest.mark.parametrize("fn", [torch.sigmoid, torch.exp])
def test_elementwise_runs_gives_each_run_the_bits_it_gets_alone(rng, fn):
    """A batch's gates (4 or 16 values per token) through one call, each sequence as alone: on a
    plain contiguous tensor an element takes vector or scalar code by its place in the whole."""
    for run, count in ((4, 40), (16, 9), (20, 3), (80, 17), (4, 2)):
        x = torch.randn(1, count * run, generator=rng) * 4
        alone = torch.cat([fn(part.clone()) for part in x.split(run, dim=1)], dim=1)
        assert torch.equal(numerics.elementwise_runs(fn, x, run), alone), (run, count)


@pytest.mark.parametrize("tokens", [1, 5])
def test_fp32_linears_of_equal_sequences_give_each_the_bits_it_gets_alone(rng, tokens):
    """A batch of equal sequences (a decode step, a verification of fixed length) multiplied as
    one batched fp32 GEMM where this machine's BLAS allows it, else per sequence: either way each
    sequence gets its own GEMM's bits (the mHC mix projection's and the head's shapes in `small`),
    over many random batches."""
    for n, k in ((24, 768), (4096, 192)):
        w = torch.randn(n, k, generator=rng)
        for _ in range(20):
            count = int(torch.randint(2, 34, (1,), generator=rng))
            x = torch.randn(1, count * tokens, k, generator=rng) * 3
            alone = torch.cat([numerics.linear(part, w) for part in x.split(tokens, dim=1)], dim=1)
            assert torch.equal(numerics.linear(x, w, [tokens] * count), alone), (n, k, count)
            # the batched form itself (used only where it gives these bits): the same values
            # (atol from the terms' size: sums of k terms near 0 keep the error of the large terms)
            torch.testing.assert_close(numerics._linear_as_batch(x, w, count), alone, rtol=1e-5,
                                       atol=1e-6 * float(alone.abs().max()))
    bf16 = torch.randn(64, 192, generator=rng).bfloat16(), torch.randn(1, 8, 192, generator=rng).bfloat16()
    assert not numerics._as_batch_keeps_bits(bf16[1], bf16[0], [1] * 8)  # bf16 stays per sequence
