"""The compiled attention loops (`dsv41/kernels/cpu_decode.py`: `torch_ops._compiled_decode` for a
decode step, `torch_ops._compiled_passes` for a prefill) against the operators they stand in for:
the same bits for every output, whether the loops compute it or hand the call back."""

from __future__ import annotations

import pytest
import torch

from dsv41.kernels import cpu_decode, torch_ops
from dsv41.kernels.layouts import main_kv_format, pack_rows, swa_format


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


@pytest.fixture(autouse=True)
def one_thread():
    """Each test on one thread unless it sets its own count: the loops serve only where a batched
    GEMM gives every matrix the bits it has alone (`torch_ops._chunks_at_once_keep_bits`), which MKL
    restricted to AVX2 does on one thread and not on two; what these tests check does not depend
    on the thread count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def loops_serve(one_thread):
    """For a test that asserts the loops ran: skipped, with the reason, where they cannot here."""
    _skip_where_the_loops_do_not_serve([(4, 512)])


def _skip_where_the_loops_do_not_serve(shapes: list[tuple[int, int]]) -> None:
    """Skips a test of the loops where this machine's BLAS keeps them from serving at the current
    thread count (heads and channels `shapes`): the operators then run alone, with nothing to compare."""
    threads = torch.get_num_threads()
    for h, d in shapes:
        if not torch_ops._chunks_at_once_keep_bits(h, d, threads):
            pytest.skip(f"this BLAS sums a batched GEMM's {h}x{d} matrices otherwise on {threads} thread(s): "
                        "the compiled attention loops do not serve here")


def _step_inputs(rng: torch.Generator, b: int, window: int, k: int, pool: int, d: int = 512, h: int = 4,
                 zero_channels: int = 0):
    """One decode token per sequence: packed rings with rotated slots (the first sequence's ring
    partly unused), a page pool of packed entries, Top-k ids with unused slots and a whole unused
    chunk where k allows; `zero_channels` channels of every ring row and entry are zero."""
    rows = torch.randn(b, window, d, generator=rng) * 4
    entries = torch.randn(1, pool, d, generator=rng) * 4
    rows[..., :zero_channels] = 0
    entries[..., :zero_channels] = 0
    ring, main = pack_rows(rows, swa_format(d)), pack_rows(entries, main_kv_format(d))
    slots = torch.stack([torch.arange(window).roll(int(torch.randint(0, window, (), generator=rng)))
                         for _ in range(b)]).int()
    slots[0, int(torch.randint(1, window, (), generator=rng)):] = -1
    topk = torch.stack([torch.randperm(pool, generator=rng)[:k] for _ in range(b)]).int()
    topk[-1, k - int(torch.randint(0, k // 2 + 1, (), generator=rng)):] = -1
    if k >= 128 and b > 1:
        topk[1, :64] = -1
    q = (torch.randn(b, h, d, generator=rng) * float(torch.rand((), generator=rng) * 3 + 0.1)).bfloat16()
    sink = torch.randn(h, generator=rng)
    return q, ring, slots, main.expand(b, -1, -1), topk, sink


def _with_operators(monkeypatch, args, scale: float) -> torch.Tensor:
    with monkeypatch.context() as patch:
        patch.setattr(torch_ops, "_compiled_decode_serves", lambda *_: False)
        return torch_ops.sparse_attention_decode(*args, scale)


def _counting_outputs(monkeypatch) -> list[bool]:
    """Records each compiled output loop's verdict (True: the loop's result was used)."""
    verdicts: list[bool] = []
    loop = cpu_decode.decode_outputs

    def counted(*args):
        verdicts.append(bool(loop(*args)))
        return verdicts[-1]

    monkeypatch.setattr(cpu_decode, "decode_outputs", counted)
    return verdicts


@pytest.mark.parametrize("threads", [1, 2])
def test_compiled_decode_gives_the_operators_bits(rng, threads, monkeypatch):
    """Batches of 1 to 6 sequences, rings of 64 and 128 slots, 0 to 512 entries with unused slots,
    in whole chunks and not (a table the official width cut short is padded to whole chunks):
    every output has the operators' bits, and the loops (not the operators) produced them."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _skip_where_the_loops_do_not_serve([(4, 512)])
        verdicts = _counting_outputs(monkeypatch)
        for trial in range(24):
            b = int(torch.randint(1, 7, (), generator=rng))
            window = (64, 128)[trial % 2]
            k = 64 * int(torch.randint(0, 9, (), generator=rng)) if trial % 4 < 2 else int(
                torch.randint(1, 513, (), generator=rng))
            args = _step_inputs(rng, b, window, k, pool=1024)
            with torch.inference_mode():
                want = _with_operators(monkeypatch, args, 512**-0.5)
                got = torch_ops.sparse_attention_decode(*args, 512**-0.5)
            assert torch.equal(_bits(got), _bits(want)), trial
        assert len(verdicts) == 24 and sum(verdicts) >= 20
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("threads", [1, 2])
def test_prefill_passes_give_the_operators_bits(rng, threads, monkeypatch):
    """A prefill's attention (several queries per sequence) in compiled passes of a few queries:
    1 to 3 sequences of 2 to 13 queries, tables of any width (padded to whole chunks), early
    queries that see only part of a chunk or none of one (in some trials every query of a pass
    sees under a third of the table, so passes are cut short), a sequence's own keys or one pool
    for all, keys gathered for a whole pass (64 channels) or for each query in turn (512); every
    output has the operators' bits, and the loops produced most of them."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _skip_where_the_loops_do_not_serve([(4, 512), (8, 64)])
        verdicts = _counting_outputs(monkeypatch)
        cut = _recording_pass_widths(monkeypatch)
        per_query = _recording_key_tables(monkeypatch)
        for trial in range(16):
            b, m = int(torch.randint(1, 4, (), generator=rng)), int(torch.randint(2, 14, (), generator=rng))
            h, d = [(4, 512), (8, 64)][trial % 2]
            short = trial % 4 >= 2
            width = int(torch.randint(200 if short else 1, 400, (), generator=rng))
            q = (torch.randn(b, m, h, d, generator=rng) * float(torch.rand((), generator=rng) * 3 + 0.1)).bfloat16()
            kv = torch.randn(1 if trial % 3 == 0 else b, 500, d, generator=rng).bfloat16()
            idx = torch.randint(0, 500, (b, m, width), generator=rng).int()
            seen = torch.randint(0, (width // 3 if short else width) + 1, (b, m, 1), generator=rng)
            idx = torch.where(torch.arange(width) < seen, idx, -1)
            sink = torch.randn(h, generator=rng)
            with torch.inference_mode():
                assert torch_ops._compiled_passes_serve(q, idx)
                got = torch_ops.sparse_attention(q, kv, sink, idx, d**-0.5)
                with monkeypatch.context() as patch:
                    patch.setattr(torch_ops, "_compiled_passes_serve", lambda *_: False)
                    want = torch_ops.sparse_attention(q, kv, sink, idx, d**-0.5)
            assert torch.equal(_bits(got), _bits(want)), trial
        assert verdicts and sum(verdicts) >= len(verdicts) // 2
        assert any(width < full for full, widths in cut for width in widths), "no pass was cut short"
        assert set(per_query) == {False, True}, "one way of gathering the keys was not taken"
    finally:
        torch.set_num_threads(previous)


def _recording_key_tables(monkeypatch) -> list[bool]:
    """Records for each pass's entry products whether its keys came per query (`KeysByQuery`)."""
    kinds: list[bool] = []
    dots = torch_ops._entry_dots

    def recorded(qf, entries):
        kinds.append(isinstance(entries, torch_ops.KeysByQuery))
        return dots(qf, entries)

    monkeypatch.setattr(torch_ops, "_entry_dots", recorded)
    return kinds


def _recording_pass_widths(monkeypatch) -> list[tuple[int, list[int]]]:
    """Records each call's full table width and the widths `_pass_widths` gave its passes."""
    calls: list[tuple[int, list[int]]] = []
    widths = torch_ops._pass_widths

    def recorded(kv, idx, step):
        calls.append((idx.size(-1), widths(kv, idx, step)))
        return calls[-1][1]

    monkeypatch.setattr(torch_ops, "_pass_widths", recorded)
    return calls


def _cut_prefill(rng, seen: torch.Tensor, zero_channels: int = 0):
    """Two sequences of 9 queries over 500 keys, each seeing `seen` [2, 9, 1] of a 300-slot table."""
    q = torch.randn(2, 9, 4, 512, generator=rng).bfloat16()
    kv = torch.randn(2, 500, 512, generator=rng).bfloat16()
    kv[..., :zero_channels] = 0
    idx = torch.randint(1, 500, (2, 9, 300), generator=rng).int()
    return q, kv, torch.randn(4, generator=rng), torch.where(torch.arange(300) < seen, idx, -1)


def test_cut_passes_hand_zero_outputs_to_the_operators(rng, monkeypatch, loops_serve):
    """A pass cut short at unused chunks hands a zero output back, as a decode step beside unused
    slots does (the cut chunks would have added a zero of either sign), even where the chunk it
    keeps has every slot used: the operators' bits."""
    verdicts, cut = _counting_outputs(monkeypatch), _recording_pass_widths(monkeypatch)
    q, kv, sink, idx = _cut_prefill(rng, torch.full((2, 9, 1), 64), zero_channels=8)
    with torch.inference_mode():
        got = torch_ops.sparse_attention(q, kv, sink, idx, 512**-0.5)
        with monkeypatch.context() as patch:
            patch.setattr(torch_ops, "_compiled_passes_serve", lambda *_: False)
            want = torch_ops.sparse_attention(q, kv, sink, idx, 512**-0.5)
    assert torch.equal(_bits(got), _bits(want)) and (want[..., :8] == 0).all()
    assert cut and all(width == 64 for width in cut[0][1]) and verdicts and not any(verdicts)


def test_a_non_finite_first_key_keeps_the_full_width(rng, monkeypatch, loops_serve):
    """Unused slots read the table's first row: where it is not finite (0 x inf is NaN in the
    operators' products) no pass is cut, and the outputs keep the operators' bits, NaNs included."""
    cut = _recording_pass_widths(monkeypatch)
    q, kv, sink, idx = _cut_prefill(rng, torch.randint(1, 41, (2, 9, 1), generator=rng))
    kv[1, 0, 3] = float("inf")
    with torch.inference_mode():
        got = torch_ops.sparse_attention(q, kv, sink, idx, 512**-0.5)
        with monkeypatch.context() as patch:
            patch.setattr(torch_ops, "_compiled_passes_serve", lambda *_: False)
            want = torch_ops.sparse_attention(q, kv, sink, idx, 512**-0.5)
    assert torch.equal(_bits(got), _bits(want)) and want[1].isnan().any()
    assert cut and all(width == 320 for width in cut[0][1])


def test_top_k_entries_read_from_the_step_table_give_the_same_bits(rng, monkeypatch):
    """The layers after the first that read a group's entries take them from the step's table:
    their outputs are the operators' too."""
    args = _step_inputs(rng, 2, 128, 512, pool=2048)
    tables: dict = {}
    with torch.inference_mode():
        want = _with_operators(monkeypatch, args, 512**-0.5)
        first = torch_ops.sparse_attention_decode(*args, 512**-0.5, tables, "group")
        again = torch_ops.sparse_attention_decode(*args, 512**-0.5, tables, "group")
    assert list(tables) == ["group"]
    assert torch.equal(_bits(first), _bits(want)) and torch.equal(_bits(again), _bits(want))


def test_zero_outputs_beside_unused_entries_go_to_the_operators(rng, monkeypatch, loops_serve):
    """Channels that are zero in every key give zero outputs; where the sequence also has unused
    entry slots the loops cannot vouch for a zero's sign and hand the call back; without unused
    slots they keep it. Either way the bits are the operators'."""
    verdicts = _counting_outputs(monkeypatch)
    for unused in (True, False):
        q, ring, slots, main, topk, sink = _step_inputs(rng, 1, 128, 256, pool=512, zero_channels=8)
        if unused:
            topk[0, -1] = -1  # the draw may leave every slot used
        else:
            topk = torch.randperm(512, generator=rng)[:256].int()[None]
        with torch.inference_mode():
            want = _with_operators(monkeypatch, (q, ring, slots, main, topk, sink), 512**-0.5)
            got = torch_ops.sparse_attention_decode(q, ring, slots, main, topk, sink, 512**-0.5)
        assert torch.equal(_bits(got), _bits(want))
        assert (want[..., :8] == 0).all()
    assert verdicts == [False, True]


def test_non_finite_queries_go_to_the_operators(rng, monkeypatch):
    """A NaN or infinite query gives non-finite logits: the loops hand the call back and the
    operators' result (NaN and all) comes out."""
    for bad in (float("nan"), float("inf")):
        q, ring, slots, main, topk, sink = _step_inputs(rng, 2, 128, 128, pool=512)
        q[1, 2, 7] = bad
        with torch.inference_mode():
            want = _with_operators(monkeypatch, (q, ring, slots, main, topk, sink), 512**-0.5)
            got = torch_ops.sparse_attention_decode(q, ring, slots, main, topk, sink, 512**-0.5)
        assert torch.equal(_bits(got), _bits(want))
        assert not got[1].isfinite().all()


def test_shapes_the_loops_do_not_take_keep_the_operators(rng, loops_serve):
    """Entries or ring slots not in whole chunks of 64 (`sparse_attention_decode` pads the
    entries first), shape-stable numerics and batches over the operators' one-pass limit are
    served by the operators."""
    from dsv41.model import numerics

    q, _, slots, _, topk, _ = _step_inputs(rng, 1, 128, 256, pool=512)
    assert torch_ops._compiled_decode_serves(q, slots, topk)
    assert not torch_ops._compiled_decode_serves(q, slots, topk[:, :100])
    assert not torch_ops._compiled_decode_serves(q, slots[:, :100], topk)
    with numerics.stable_numerics():
        assert not torch_ops._compiled_decode_serves(q, slots, topk)
    many = q.expand(64, -1, -1)
    assert not torch_ops._compiled_decode_serves(many, slots.expand(64, -1), topk.expand(64, -1))


def test_bf16_rounding_loop_converts_as_torch(rng):
    """`cpu_loops.round_to_bf16` (the loops' final rounding) against torch's conversion: random
    magnitudes, exact ties (odd and even), subnormals, infinities and NaNs."""
    from dsv41.kernels import cpu_loops

    values = torch.randn(4096, generator=rng) * torch.exp2(torch.randint(-140, 120, (4096,), generator=rng).float())
    ties = (torch.randint(0, 2**16, (256,), generator=rng, dtype=torch.int64) << 16 | 0x8000).int().view(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-45, -3e-39, 3.4e38])
    values = torch.cat([values, ties, special])
    rounded = values.clone()
    cpu_loops.round_to_bf16(rounded.numpy())
    want = values.bfloat16().float()
    assert torch.equal(rounded.view(torch.int32)[~want.isnan()], want.view(torch.int32)[~want.isnan()])
    assert torch.equal(rounded.isnan(), want.isnan())
    assert torch.equal(rounded.bfloat16().view(torch.int16), values.bfloat16().view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_loop_gives_the_operators_bits(rng, dtype):
    """`cpu_loops.rms_norm_rows` (the norms inside the compiled attention inputs) against the
    operators: lengths with and without a vector tail and past the sum's first cascade level, 1 to
    20 rows of magnitudes 2^-16 to 2^16, rows holding an infinity or a NaN (a bf16 NaN output is
    handed back: torch writes its bits two ways)."""
    from dsv41.model import layers

    for n in (64, 100, 128, 256, 512, 1024, 4096):
        width = layers.norm_sum_width(n)
        assert width is not None
        weight, eps = (torch.randn(n, generator=rng) * 2).bfloat16(), float(torch.rand((), generator=rng)) * 1e-5
        rows = int(torch.randint(1, 21, (), generator=rng))
        scale = 4.0 ** torch.randint(-8, 9, (rows, 1), generator=rng)
        x = (torch.randn(rows, n, generator=rng) * scale).to(dtype)
        if rows > 2:
            x[1, 3], x[2, 5] = float("inf"), float("nan")
        with torch.inference_mode():
            got, want = layers.rms_norm_by_loop(x, weight, eps, width), layers._rms_norm(x, weight, eps)
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        if got is None:
            assert dtype == torch.bfloat16 and want.isnan().any()
        else:
            assert torch.equal(got.view(bits), want.view(bits)), n


def test_passes_take_as_many_queries_as_their_keys_allow():
    """`small`'s 128-slot tables of 64 channels (32 KB a query): 32 queries a pass, shared among the
    sequences; `mini`'s 640 slots of 512 channels (1.3 MB a query): the fewest, 8; a table so wide
    that 8 queries' scores would pass the limit: fewer."""
    assert torch_ops._pass_queries(1, 4, 64, 128) == torch_ops.PASS_QUERIES_MOST == 32
    assert torch_ops._pass_queries(4, 4, 64, 128) == 8
    assert torch_ops._pass_queries(1, 4, 512, 640) == torch_ops.COMPILED_PASS_QUERIES == 8
    assert torch_ops._pass_queries(1, 16, 64, 512) == torch_ops.CHUNKS_AT_ONCE_LIMIT // (16 * 512) == 4
