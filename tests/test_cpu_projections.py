"""The compiled attention inputs (`dsv41/kernels/cpu_projections.py`, `Attention._inputs_by_loop`)
against the operators they stand in for: the same bits for the low-rank query, the rotated query
heads and the rotated KV row, or the call handed back."""

from __future__ import annotations

import pytest
import torch

from dsv41.config import Rope
from dsv41.kernels import cpu_projections
from dsv41.model import rope
from dsv41.model.layers import fill_weight_caches
from dsv41.model.reference import random_model

from .conftest import skip_where_the_gemm_sums_blocks_otherwise


@pytest.fixture(scope="module")
def mini():
    model = random_model("mini", seed=3)
    fill_weight_caches(model)
    return model


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def _loop_shapes(attn, hidden: int) -> list[tuple[int, int]]:
    """The (K, N) of the products `Attention._inputs_loop_serves` asks the loop for."""
    q_rank, kv_dim = attn.wq_a.out_features, attn.head_dim
    return [(hidden, q_rank + kv_dim), (hidden, q_rank), (hidden, kv_dim), (q_rank, attn.n_heads * kv_dim)]


def test_inputs_by_loop_give_the_operators_bits(mini, rng):
    """Every layer kind (both rotation tables), 1 to 9 rows at random positions, magnitudes 2^-6 to
    2^6: qr, q and kv have the operators' bits, and the loop served every call."""
    t = mini.config.text_config
    skip_where_the_gemm_sums_blocks_otherwise(sorted({shape for layer in mini.layers
                                                      for shape in _loop_shapes(layer.attn, t.hidden_size)}))
    tables = {kind: rope.table_for(t, kind, 4096) for kind in Rope}
    with torch.inference_mode():
        for layer in mini.layers:
            attn = layer.attn
            table = tables[Rope.PLAIN] if not attn.spec.ratio else tables[Rope.YARN]
            for rows in (1, 2, 5, 9):
                x = (torch.randn(1, rows, t.hidden_size, generator=rng)
                     * 2.0 ** torch.randint(-6, 7, (1, rows, 1), generator=rng)).bfloat16()
                start = int(torch.randint(0, 4000, (), generator=rng))
                positions = table[start : start + rows]
                got = attn._inputs_by_loop(x, positions)
                assert got is not None
                for mine, want in zip(got, attn._inputs(x, positions), strict=True):
                    assert torch.equal(_bits(mine), _bits(want)), attn.spec.layer_id


def test_inputs_the_loop_cannot_vouch_for_go_to_the_operators(mini, rng, monkeypatch):
    """An input whose quantization or outputs hold an infinity or NaN, fp32 rows, more rows than the
    loop takes, and the opt-in fast GEMM: the operators compute them."""
    attn = mini.layers[10].attn
    table = rope.table_for(mini.config.text_config, Rope.YARN, 128)
    x = torch.randn(1, 2, 256, generator=rng).bfloat16()
    x[0, 1, 7] = float("inf")
    with torch.inference_mode():
        assert attn._inputs_by_loop(x, table[3:5]) is None
        assert not attn._inputs_loop_serves(x.float(), table[3:5])
        assert not attn._inputs_loop_serves(torch.zeros(1, 65, 256).bfloat16(), table[:65])
        monkeypatch.setenv("DSV41_FAST_GEMM", "1")
        assert not attn._inputs_loop_serves(x, table[3:5])


@pytest.mark.parametrize("pairs", [32, 16, 5])
def test_rotation_check_agrees_with_a_direct_comparison(rng, pairs):
    """Where `rope.rotation_keeps_bits` lets the loop rotate, its complex products are torch's on
    fresh rows too (pairs past whole vectors run torch's scalar code, which the check may refuse)."""
    table = torch.polar(torch.ones(4, pairs), torch.rand(4, pairs, generator=rng) * 1000)
    x = torch.randn(4, 2 * pairs + 16, generator=rng) * 8
    out = torch.empty_like(x)
    cpu_projections.rotate_rows(x.numpy(), torch.view_as_real(table).numpy(), out.numpy())
    same = torch.equal(out.view(torch.int32), rope.rotate(x[None], table)[0].view(torch.int32))
    assert same or not rope.rotation_keeps_bits(pairs)
