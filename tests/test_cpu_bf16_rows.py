"""One-row bf16 products in one loop (`dsv41/kernels/cpu_bf16_rows.py`, `Linear.one_row_products`):
the loop's order against a machine-independent twin, its bits against this machine's GEMM where
the probe found the GEMM's order, and the calls it hands back to the GEMM."""

from __future__ import annotations

import pytest
import torch

from dsv41.kernels import cpu_bf16_rows
from dsv41.model import numerics
from dsv41.model.layers import Linear, Storage
from dsv41.model.numerics import stable_numerics


def _twin(x: torch.Tensor, w: torch.Tensor, lanes: int, block: int, odd_first: bool, paired: bool = False,
          tree: tuple[int, ...] = ()) -> torch.Tensor:
    """The documented order in float64 arithmetic rounded to float32 after every addition (a product
    of two bf16 values is exact in both): x [R, g, K], w [g, N, K] -> [R, g, N] bf16."""
    k = x.size(-1)
    place_order = [c ^ 1 if odd_first else c for c in range(k)]
    block = block or k
    spread = 2 if paired else 1
    products = x.double().unsqueeze(-2) * w.double()  # [R, g, N, K]
    total = torch.zeros(products.shape[:-1], dtype=torch.float32)

    def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a.double() + b.double()).float()

    for first in range(0, k, block):
        accs = [torch.zeros_like(total) for _ in range(lanes)]
        for c in place_order[first : first + block]:
            lane = (c // spread) % lanes
            accs[lane] = add(accs[lane], products[..., c])
        if tree:
            alive = list(range(lanes))
            for stride in tree:  # each lane still in without this stride's bit takes its partner
                for lane in [lane for lane in alive if not lane & stride]:
                    accs[lane] = add(accs[lane], accs[lane + stride])
                alive = [lane for lane in alive if not lane & stride]
            part = accs[0]
        else:
            part = accs[0]
            for acc in accs[1:]:
                part = add(part, acc)
        total = add(total, part)
    return total.bfloat16()


def _loop(x: torch.Tensor, w: torch.Tensor, lanes: int, block: int, odd_first: bool = False, paired: bool = False,
          tree: tuple[int, ...] = ()) -> torch.Tensor | None:
    out = torch.empty(x.size(0), w.size(0), w.size(1), dtype=torch.bfloat16)
    done = cpu_bf16_rows.run(x.contiguous().view(torch.int16).numpy(), cpu_bf16_rows.layout(w).numpy(),
                             (lanes, block, odd_first, paired, tree), cpu_bf16_rows.row_floor(w),
                             out.view(torch.int16).numpy())
    return out if done else None


def _spread_rows(rng: torch.Generator, *shape: int) -> torch.Tensor:
    """bf16 values whose magnitudes span 2^-12 to 2^12: another order of their sums shows."""
    spread = torch.exp2(torch.randint(-12, 13, shape, generator=rng).float())
    return (torch.randn(*shape, generator=rng) * spread).bfloat16()


@pytest.mark.parametrize(("lanes", "block", "odd_first", "paired", "tree", "k"),
                         [(2, 32, False, False, (), 128), (4, 0, False, False, (), 128), (1, 0, False, False, (), 128),
                          (8, 64, False, False, (), 128), (1, 0, True, False, (), 128), (1, 512, True, False, (), 1024),
                          (1, 0, False, False, (), 127), (1, 0, True, False, (), 130),
                          (16, 0, True, True, (8, 1, 2, 4), 128), (16, 0, True, True, (8, 1, 2, 4), 130),
                          (16, 64, True, True, (8, 1, 2, 4), 256), (64, 0, False, False, (32, 16, 8, 4, 2, 1), 200),
                          (4, 0, False, True, (2, 1), 100)])
def test_the_loop_adds_in_the_documented_order(rng, lanes, block, odd_first, paired, tree, k):
    """On any machine: candidate orders and others of the family, rows of two groups, K one or a
    few blocks long (K not a multiple of four: the one-accumulator loop's last places one at a
    time; not a multiple of the lanes: the last pass fills some of them)."""
    x, w = _spread_rows(rng, 5, 2, k), _spread_rows(rng, 2, 24, k)
    assert torch.equal(_loop(x, w, lanes, block, odd_first, paired, tree).view(torch.int16),
                       _twin(x, w, lanes, block, odd_first, paired, tree).view(torch.int16))
    # order-revealing columns (2^20, -2^20 and 2^-10 at random places): most orders' bf16 results
    # agree on spread values, not on these
    revealing = torch.zeros(2, 24, k)
    for g in range(2):
        for j in range(24):
            revealing[g, j, torch.randperm(k, generator=rng)[:3]] = torch.tensor([2.0**20, -(2.0**20), 2.0**-10])
    ones = torch.ones(1, 2, k).bfloat16()
    got = _loop(ones, revealing.bfloat16(), lanes, block, odd_first, paired, tree)
    assert torch.equal(got, _twin(ones, revealing.bfloat16(), lanes, block, odd_first, paired, tree))
    assert 0 < int((got != 0).sum()) < got.numel()  # (both outcomes occur: the columns do reveal)


def test_the_orders_differ_on_order_revealing_values():
    """2^20, -2^20 and 2^-10 in one column: the sum is 2^-10 only where the small value is not added
    to a sum holding just one of the large ones. One pass adds it between them; two lanes put it in
    the odd lane, apart from both; pairs added odd place first move it after both: the orders
    disagree (what the probe relies on)."""
    w = torch.zeros(1, 1, 64)
    w[0, 0, [0, 2, 1]] = torch.tensor([2.0**20, -(2.0**20), 2.0**-10])  # the small one between them
    x = torch.ones(1, 1, 64).bfloat16()
    one_pass, by_blocks = _loop(x, w.bfloat16(), 1, 0), _loop(x, w.bfloat16(), 2, 32)
    assert float(one_pass) == 0.0 and float(by_blocks) == 2.0**-10
    # 2^20 at place 1, 2^-10 at 2, -2^20 at 3: in place order the small one comes between the large
    # ones, odd places first (1, 0, 3, 2) after both
    w = torch.zeros(1, 1, 64)
    w[0, 0, [1, 3, 2]] = torch.tensor([2.0**20, -(2.0**20), 2.0**-10])
    in_place, odd_first = _loop(x, w.bfloat16(), 1, 0), _loop(x, w.bfloat16(), 1, 0, odd_first=True)
    assert float(in_place) == 0.0 and float(odd_first) == 2.0**-10
    # 16 lanes of pairs: 2^20 at place 0 (lane 0), -2^20 at 2 (lane 1), 2^-10 at 16 (lane 8). Added
    # first to last the large ones cancel before lane 8 comes; by the tree lane 8 joins lane 0 first
    w = torch.zeros(1, 1, 64)
    w[0, 0, [0, 2, 16]] = torch.tensor([2.0**20, -(2.0**20), 2.0**-10])
    in_turn, by_tree = (_loop(x, w.bfloat16(), 16, 0, True, True, tree) for tree in ((), (8, 1, 2, 4)))
    assert float(in_turn) == 2.0**-10 and float(by_tree) == 0.0


@pytest.mark.parametrize(("groups", "k", "n"), [(2, 128, 64), (2, 1024, 128)])
def test_where_the_probe_finds_the_gemms_order_the_loop_gives_its_bits(rng, groups, k, n):
    """`small`'s and `mini`'s `wo_a` shapes: each row through `Linear.one_row_products` has the bits
    of its own one-row GEMM; where the probe found no order the GEMM keeps every row."""
    linear = Linear(k, groups * n, Storage.BF16)  # as `wo_a`: every group's rows take the same K inputs
    with torch.inference_mode():
        linear.weight.copy_((torch.randn(groups * n, k, generator=rng) * 0.05).bfloat16())
        x = (torch.randn(9, groups, k, generator=rng) * torch.exp2(torch.randint(-6, 7, (9, 1, 1), generator=rng)))
        x = x.bfloat16()
        got = linear.one_row_products(x, groups)
        if cpu_bf16_rows.find_order("grouped", groups, k, n, torch.get_num_threads()) is None:
            assert got is None
            return
        w = linear.weight.view(groups, n, k)
        for r in range(x.size(0)):
            alone = numerics.grouped_projection(x[r].view(1, 1, groups, k), w).view(groups, n)
            assert torch.equal(got[r].view(torch.int16), alone.view(torch.int16)), r


def test_a_gemm_in_no_order_of_the_family_is_not_matched(monkeypatch):
    """A product summed exactly (float64, rounded once) loses no small value on the order-revealing
    rows: no candidate order matches it, so the loop would not stand in for it."""
    def exact(x, w):
        return torch.einsum("bsgd,grd->bsgr", x.double(), w.double()).bfloat16()

    monkeypatch.setattr(numerics, "grouped_projection", exact)
    cpu_bf16_rows.find_order.cache_clear()
    try:
        assert cpu_bf16_rows.find_order("grouped", 2, 128, 64, 1) is None
    finally:
        cpu_bf16_rows.find_order.cache_clear()


def test_rows_and_weights_outside_the_exact_range_and_other_modes_go_to_the_gemm(rng, monkeypatch):
    """A row holding a value below the weight's row floor (a bf16 denormal among them), 2^60, an
    infinity or a NaN; a weight holding 2^60 or more values than `MOST_WEIGHTS`; stable numerics and
    autograd. A row value just at the floor (far below the weight's own range) keeps the loop and
    the GEMM's bits."""
    groups, k, n = 2, 128, 64
    if cpu_bf16_rows.find_order("grouped", groups, k, n, torch.get_num_threads()) is None:
        pytest.skip("this machine's one-row bf16 GEMM sums in no order of the loop's family")
    linear = Linear(k, groups * n, Storage.BF16)  # as `wo_a`: every group's rows take the same K inputs
    with torch.inference_mode():
        linear.weight.copy_((torch.randn(groups * n, k, generator=rng) * 0.05).bfloat16())
        x = torch.randn(3, groups, k, generator=rng).bfloat16()
        assert linear.one_row_products(x, groups) is not None
        floor = cpu_bf16_rows.row_floor(linear.weight)
        assert 2.0**-126 < floor < 2.0**-56  # the weight's smallest magnitude is above 2^-56
        for bad in (floor / 2, 2.0**-130, 2.0**60, float("inf"), float("nan")):
            odd = x.clone()
            odd[1, 1, 5] = bad
            assert linear.one_row_products(odd, groups) is None, bad
        tiny = x.clone()
        tiny[1, 1, 5] = floor
        w = linear.weight.view(groups, n, k)
        alone = numerics.grouped_projection(tiny[1].view(1, 1, groups, k), w).view(groups, n)
        assert torch.equal(linear.one_row_products(tiny, groups)[1].view(torch.int16), alone.view(torch.int16))
        with stable_numerics():
            assert linear.one_row_products(x, groups) is None
        monkeypatch.setattr(cpu_bf16_rows, "MOST_WEIGHTS", linear.weight.numel() - 1)
        assert linear.one_row_products(x, groups) is None
        monkeypatch.undo()
        linear.weight[3, 7] = 2.0**60
        assert linear.one_row_products(x, groups) is None
    assert torch.is_grad_enabled() and linear.one_row_products(x, groups) is None


def test_a_bf16_linear_of_one_token_each_takes_the_loop_with_each_tokens_bits(rng, monkeypatch):
    """`Linear.forward` of a bf16 weight (N = 64, as the ratio-1 compressor's): one token alone, and
    one token of each of five sequences (`rows` all 1, in a contiguous and a strided tensor), each
    with the bits of its own GEMM; a sequence of two tokens keeps the GEMM."""
    linear = Linear(192, 64, Storage.BF16)
    served = []
    real = Linear.one_row_products
    monkeypatch.setattr(Linear, "one_row_products", lambda *a: served.append(real(*a)) or served[-1])
    with torch.inference_mode():
        linear.weight.copy_((torch.randn(64, 192, generator=rng) * 0.05).bfloat16())
        x = (torch.randn(1, 5, 192, generator=rng) * torch.exp2(torch.randint(-6, 7, (1, 5, 1), generator=rng)))
        x = x.bfloat16()
        alone = torch.cat([numerics.linear(x[:, i : i + 1], linear.weight) for i in range(5)], dim=1)
        assert torch.equal(linear(x, rows=[1] * 5).view(torch.int16), alone.view(torch.int16))
        assert torch.equal(linear(x[:, 2:3]).view(torch.int16), alone[:, 2:3].view(torch.int16))
        strided = x.transpose(1, 2).contiguous().transpose(1, 2)  # the same tokens, not contiguous
        assert not strided.is_contiguous()
        assert torch.equal(linear(strided, rows=[1] * 5).view(torch.int16), alone.view(torch.int16))
        found = cpu_bf16_rows.find_order("linear", 1, 192, 64, torch.get_num_threads()) is not None
        assert [y is not None for y in served] == [found, found, found]
        linear(x, rows=[2, 3])
        assert len(served) == 3
