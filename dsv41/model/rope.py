"""Rotary embeddings: interleaved pairs on the last `rope_dim` channels (SPEC.md §3.4).

Two tables per model: ratio-0 layers (and DSpark) use rope_theta without YaRN; layers with a global
branch use compress_rope_theta with YaRN for every rotation they apply.
"""

from __future__ import annotations

import math
from functools import cache, lru_cache

import numpy as np
import torch

from dsv41.config import Rope, TextConfig
from dsv41.kernels import cpu_loops, cpu_projections
from dsv41.model import numerics


def yarn_band(rope_dim: int, theta: float, original_len: int, beta_fast: float, beta_slow: float) -> tuple[int, int]:
    """The (low, high) frequency indices between which YaRN fades from interpolated to original."""

    def dim_for(rotations: float) -> float:
        return rope_dim * math.log(original_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_for(beta_fast)), 0)
    high = min(math.ceil(dim_for(beta_slow)), rope_dim - 1)
    return low, high


def inverse_frequencies(rope_dim: int, theta: float, yarn: tuple[int, float, float, float] | None) -> torch.Tensor:
    """theta^(-2i/rope_dim); with YaRN (original_len, factor, beta_fast, beta_slow) the low
    frequencies are divided by `factor`, blended linearly across the YaRN band."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn is None:
        return freqs
    original_len, factor, beta_fast, beta_slow = yarn
    low, high = yarn_band(rope_dim, theta, original_len, beta_fast, beta_slow)
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    keep = 1 - ramp
    return freqs / factor * (1 - keep) + freqs * keep


@lru_cache(maxsize=8)
def rotation_table(rope_dim: int, n_positions: int, theta: float, yarn: tuple | None) -> torch.Tensor:
    """complex64 [n_positions, rope_dim/2]: e^{i p f} for every position p."""
    angles = torch.outer(torch.arange(n_positions), inverse_frequencies(rope_dim, theta, yarn))
    return torch.polar(torch.ones_like(angles), angles)


def table_for(t: TextConfig, kind: Rope, n_positions: int) -> torch.Tensor:
    if kind is Rope.PLAIN:
        return rotation_table(t.qk_rope_head_dim, n_positions, float(t.rope_theta), None)
    s = t.rope_scaling
    yarn = (s.original_max_position_embeddings, float(s.factor), float(s.beta_fast), float(s.beta_slow))
    return rotation_table(t.qk_rope_head_dim, n_positions, float(t.compress_rope_theta), yarn)


def rotate(x: torch.Tensor, table: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last `2 * table.size(-1)` channels of x [batch, seq, dim] or [batch, seq, heads, dim]
    by `table` [seq, rope_dim/2] (one row per position of x); returns a new tensor in x's dtype."""
    by_loop = _rotate_by_loop(x, table, inverse)
    if by_loop is not None:
        return by_loop
    rope_dim = 2 * table.size(-1)
    head, tail = x[..., :-rope_dim], x[..., -rope_dim:]
    pairs = torch.view_as_complex(tail.float().unflatten(-1, (-1, 2)).contiguous())
    if inverse:
        table = table.conj()
    if x.ndim == 4:
        table = table.unsqueeze(1)  # broadcast over heads
    rotated = torch.view_as_real(pairs * table).flatten(-2).to(x.dtype)
    return torch.cat([head, rotated], dim=-1)


# the most rows `rotate` takes through the loop: a decode token's four heads took 16 us a call
# against the operators' 39, a 48-token chunk's 192 rows 96 against 65 (their vector code wins)
LOOP_ROWS = 64


def _rotate_by_loop(x: torch.Tensor, table: torch.Tensor, inverse: bool) -> torch.Tensor | None:
    """`rotate` of bf16 rows in one compiled loop (`cpu_projections.rotate_bf16_rows`: the same
    float32 operations and rounding, a dozen operator calls fewer; a decode step rotates each
    attention layer's output back this way). None where it does not serve: stable numerics,
    autograd, another dtype or device, more than LOOP_ROWS rows, a machine where
    `rotation_keeps_bits` fails, a NaN."""
    if (x.dtype != torch.bfloat16 or table.dtype != torch.complex64 or x.ndim not in (3, 4) or table.dim() != 2
            or table.size(0) != x.size(1) or x.numel() > LOOP_ROWS * x.size(-1)
            or numerics.is_stable() or not cpu_loops.serves(x, table)
            or not rotation_keeps_bits(table.size(-1))):
        return None
    rows = (x if x.is_contiguous() else x.contiguous()).view(torch.int16).view(-1, x.size(-1)).numpy()
    out = np.empty_like(rows)
    repeat = x.size(2) if x.ndim == 4 else 1  # a position's rows: its heads
    if not cpu_projections.rotate_bf16_rows(rows, table.resolve_conj().numpy(), repeat, inverse, out):
        return None
    return torch.from_numpy(out).view(torch.bfloat16).view(x.shape)


@cache
def rotation_keeps_bits(pairs: int) -> bool:
    """Whether `cpu_projections.rotate_pairs` gives `rotate`'s float32 bits on this machine for
    tables of `pairs` pairs: torch's vector code multiplies complex numbers as two rounded products
    and their rounded sum, but its scalar code (a row's last pairs past whole vectors) is compiled
    with contraction allowed and may fuse them. Checked once on random rows, inverse tables too."""
    generator = torch.Generator().manual_seed(0)
    angles = torch.rand(3, pairs, generator=generator, dtype=torch.float32) * 1000
    table = torch.polar(torch.ones_like(angles), angles)
    x = torch.randn(3, 2 * pairs + 8, generator=generator, dtype=torch.float32) * 8
    for rows in (table, table.conj().resolve_conj()):
        out = torch.empty_like(x)
        cpu_projections.rotate_rows(x.numpy(), torch.view_as_real(rows).numpy(), out.numpy())
        if not torch.equal(out.view(torch.int32), rotate(x[None], rows)[0].view(torch.int32)):
            return False
    return True
