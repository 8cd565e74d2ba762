import torch
from safetensors.torch import load_file

from dsv41.config import Rope, load_config
from dsv41.model import mhc, rope
from dsv41.parity import compare

from .conftest import GOLDEN


def test_sinkhorn_is_doubly_stochastic_after_20_iterations(rng):
    # Mixing logits of moderate spread (std 0.5) converge within the release's 20 iterations.
    mixes = torch.randn(4096, 24, generator=rng) * 0.5
    scale, base = torch.ones(3), torch.zeros(24)
    pre, post, comb = mhc.sinkhorn_split(mixes, scale, base, hc=4, iters=20, eps=1e-6)
    assert torch.allclose(comb.sum(-1), torch.ones(4096, 4), atol=1e-5)
    assert torch.allclose(comb.sum(-2), torch.ones(4096, 4), atol=1e-5)
    assert (post > 0).all() and (post < 2).all() and (pre > 0).all() and (pre < 1 + 2e-6).all()


def test_sinkhorn_columns_always_sum_to_one_and_skewed_rows_need_more_iterations(rng):
    # Sharply peaked logits are not doubly stochastic after 20 rounds (rows off by up to ~1e-2, as in
    # the official algorithm); the last step normalises columns, and more rounds converge the rows.
    mixes = torch.randn(4096, 24, generator=rng) * 3
    scale, base = torch.ones(3), torch.zeros(24)
    _, _, comb = mhc.sinkhorn_split(mixes, scale, base, hc=4, iters=20, eps=1e-6)
    assert torch.allclose(comb.sum(-2), torch.ones(4096, 4), atol=1e-5)
    row_error_20 = (comb.sum(-1) - 1).abs().max()
    _, _, comb = mhc.sinkhorn_split(mixes, scale, base, hc=4, iters=200, eps=1e-6)
    assert (comb.sum(-1) - 1).abs().max() < row_error_20 / 5


def test_sinkhorn_compiled_loop_gives_the_torch_iterations_bits(rng):
    # Inference on the CPU runs the iterations as one compiled loop (kernels/cpu_loops.py); they
    # must be the torch code's bits, at decode and prefill shapes and other stream counts (torch
    # sums more than 4 values in another order: those stay on the torch code), with spreads wide
    # enough that some exponentials underflow.
    eps, two = torch.tensor(1e-6), torch.tensor(2.0)
    cases = (((1, 1), 1.0, 4), ((8, 1), 3.0, 4), ((1, 37), 10.0, 4), ((3, 5), 5.0, 2), ((1, 9), 5.0, 3),
             ((1, 9), 5.0, 6), ((2, 300), 40.0, 4))
    for shape, spread, hc in cases:
        mixes = torch.randn(*shape, (2 + hc) * hc, generator=rng) * spread
        scale, base = torch.rand(3, generator=rng) * 2 + 0.25, torch.randn((2 + hc) * hc, generator=rng)
        if spread == 40.0:  # one comb row whose logits lie 200+ apart: its exponential underflows for sure
            mixes[0, 0, 8:10] = torch.tensor([400.0, -400.0])
        expected = mhc._split(mixes, scale, base, eps, two, hc, 20)
        with torch.inference_mode():
            got = mhc.sinkhorn_split(mixes, scale, base, hc=hc, iters=20, eps=1e-6)
        for want, have in zip(expected, got, strict=True):
            assert torch.equal(want, have), (shape, hc)
        if hc <= mhc.FIRST_TO_LAST_SUMS:  # the loop itself, not only the path that chose it
            comb = mhc._gates(mixes, scale, base, eps, two, hc)[2]
            assert torch.equal(mhc._normalize_in_place(comb.clone(), 1e-6, 20), mhc._normalize(comb, eps, 20))
    assert (mhc._gates(mixes, scale, base, eps, two, 4)[2] == 0).any()  # the widest spread underflows


def test_sinkhorn_matches_official_golden():
    u = load_file(GOLDEN / "units.safetensors")
    pre, post, comb = mhc.sinkhorn_split(u["hc.mixes"], u["hc.scale"], u["hc.base"], 4, 20, 1e-6)
    # floats within the parity policy: the sigmoid's vector code differs in the last bit between CPUs
    rows = [compare("hc", name, got, u[f"hc.{name}"]) for name, got in (("pre", pre), ("post", post), ("comb", comb))]
    assert all(r.passed and r.max_ulp <= 4 for r in rows), rows


def test_collapse_and_expand_follow_the_transposed_comb(rng):
    x = torch.randn(1, 2, 4, 8, generator=rng)
    out = torch.randn(1, 2, 8, generator=rng)
    post, comb = torch.rand(1, 2, 4, generator=rng), torch.rand(1, 2, 4, 4, generator=rng)
    y = mhc.expand(out, x, post, comb)
    j = 2
    want = post[..., j, None] * out + sum(comb[..., i, j, None] * x[..., i, :] for i in range(4))
    assert torch.allclose(y[..., j, :], want, atol=1e-6)
    pre = torch.rand(1, 2, 4, generator=rng)
    assert torch.allclose(mhc.collapse(x, pre), (pre.unsqueeze(-1) * x).sum(2), atol=1e-6)


def test_rope_tables_match_official_goldens():
    u = load_file(GOLDEN / "units.safetensors")
    official = load_config("official").text_config
    assert torch.equal(torch.view_as_real(rope.table_for(official, Rope.PLAIN, 40)), u["rope.official_swa.real_imag"])
    assert torch.equal(torch.view_as_real(rope.table_for(official, Rope.YARN, 40)),
                       u["rope.official_compressed.real_imag"])
    table = rope.table_for(load_config("micro").text_config, Rope.YARN, 64)
    rotated = rope.rotate(u["rope.apply_input_bf16"], table[7:12])
    assert torch.equal(rotated, u["rope.apply_out_pos7to11"])
    assert torch.equal(rope.rotate(rotated, table[7:12], inverse=True), u["rope.apply_then_inverse"])


def test_rotation_of_bf16_rows_by_the_loop_gives_the_operators_bits(rng, monkeypatch):
    """`rope.rotate` of bf16 rows through the compiled loop against the operators it stands in for:
    rows of one position per token and of several heads, two sequences, forward and inverse, values
    spread over many magnitudes; a NaN and more than LOOP_ROWS rows go to the operators; the loop
    served the others."""
    table = rope.rotation_table(16, 40, 10000.0, None)[5:12]
    served = []
    loop = rope._rotate_by_loop
    monkeypatch.setattr(rope, "_rotate_by_loop", lambda *a: served.append(loop(*a)) or served[-1])
    for shape in ((2, 7, 48), (2, 7, 4, 48), (1, 7, 1, 16)):
        spread = torch.exp2(torch.randint(-20, 21, shape, generator=rng).float())
        x = (torch.randn(*shape, generator=rng) * spread).bfloat16()
        for inverse in (False, True):
            got = rope.rotate(x, table, inverse)
            with monkeypatch.context() as patch:
                patch.setattr(rope, "_rotate_by_loop", lambda *_: None)
                want = rope.rotate(x, table, inverse)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (shape, inverse)
    expected_by_loop = rope.rotation_keeps_bits(8)
    assert [y is not None for y in served] == [expected_by_loop] * 6
    x[0, 3, 0, 9] = float("nan")
    assert rope._rotate_by_loop(x, table, False) is None
    many = torch.randn(1, 7, rope.LOOP_ROWS // 7 + 1, 16, generator=rng).bfloat16()  # past LOOP_ROWS rows
    assert rope._rotate_by_loop(many, table, False) is None
    # a table per sequence ([b, s, pairs], as the drafter's blocks have) is the operators' too, even
    # where b equals s
    blocks = rope.rotation_table(16, 40, 10000.0, None)[:9].view(3, 3, 8)
    x = torch.randn(3, 3, 48, generator=rng).bfloat16()
    assert rope._rotate_by_loop(x, blocks, False) is None
    assert torch.equal(rope.rotate(x, blocks)[1], rope.rotate(x[1:2], blocks[1])[0])


def test_yarn_band_for_the_release_is_15_to_25():
    assert rope.yarn_band(64, 160000, 65536, 32, 1) == (15, 25)


def test_rope_touches_only_the_last_dims_and_preserves_norm(rng):
    x = torch.randn(1, 6, 3, 32, generator=rng)
    table = rope.rotation_table(8, 6, 10000.0, None)
    y = rope.rotate(x, table)
    assert torch.equal(y[..., :24], x[..., :24])
    pairs = lambda t: t[..., 24:].unflatten(-1, (-1, 2)).norm(dim=-1)  # noqa: E731
    assert torch.allclose(pairs(y), pairs(x), atol=1e-5)
    assert torch.allclose(y[:, 0], x[:, 0])  # position 0 is the identity rotation


def test_predict_by_rows_equals_each_sequence_alone(rng):
    """A batch's sequences (`rows`) get the coefficients each would get alone, bit for bit: the GEMM
    and the gates' sigmoids run per sequence (both change their last bits with the tensor's shape
    on some CPUs); sizes that put sequences across vector boundaries, and equal sizes (one token
    each: a decode step), whose gates run as one pass over the batch."""
    hc, dim = 4, 64
    fn = torch.randn((2 + hc) * hc, hc * dim, generator=rng) * 0.05
    scale, base = torch.rand(3, generator=rng), torch.randn((2 + hc) * hc, generator=rng) * 0.1
    for sizes in ([3, 64], [1, 17, 5], [33, 2, 40], [1] * 40, [5] * 9, [2, 2]):
        x = (torch.randn(1, sum(sizes), hc, dim, generator=rng) * 4).bfloat16()
        batched = mhc.predict(x, fn, scale, base, hc, 20, 1e-6, 1e-6, rows=sizes)
        alone = [mhc.predict(part.contiguous(), fn, scale, base, hc, 20, 1e-6, 1e-6) for part in x.split(sizes, 1)]
        for got, parts in zip(batched, zip(*alone, strict=True), strict=True):
            assert torch.equal(got, torch.cat(parts, dim=1))
