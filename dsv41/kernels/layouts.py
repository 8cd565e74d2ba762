"""Byte layouts of one cache entry, and the torch twins of the quantize-and-pack kernel.

Every entry is its element codes followed by its scale bytes, entries back to back:

| entry | codes (bytes) | scales (bytes) | total |
|---|---|---|---|
| main KV, 512 channels | E2M1, 2 per byte, even channel low (0..255) | 32 E4M3, per 16 (256..287) | 288 |
| indexer K, 128 channels | E2M1, 2 per byte (0..63) | 4 E8M0, per 32 (64..67) | 68 |
| SWA, 512 channels | E4M3 (0..511) | 16 E8M0, per 32 (512..527) | 528 |

All values are post-RoPE; the SWA entry is both key and value.

Why this order: codes start at the entry's first byte and scales follow in one run, so a kernel
reads an entry as whole vectors. Main-KV and SWA entries are multiples of 16 bytes (288 = 18 x 16,
528 = 33 x 16), so with a 16-byte aligned page every entry, its codes and its scales start on a
16-byte boundary and load as 128-bit vectors; an indexer-K entry (68 = 17 x 4) loads as 32-bit
words, its 4 scales as one word.

Quantization follows the reference exactly (SPEC.md §4.1), so unpacking gives bit for bit the
values the reference's fake quantization produces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsv41.kernels import codecs, cpu_loops
from dsv41.model.quant import fp4_qdq, fp4_quant, fp8_qdq, fp8_quant


@dataclass(frozen=True)
class EntryFormat:
    name: str
    dim: int
    block: int  # channels per scale
    fp4: bool  # E2M1 codes (else E4M3)
    e4m3_scale: bool  # E4M3 scales (else E8M0)

    @property
    def code_bytes(self) -> int:
        return self.dim // 2 if self.fp4 else self.dim

    @property
    def scale_bytes(self) -> int:
        return self.dim // self.block

    @property
    def entry_bytes(self) -> int:
        return self.code_bytes + self.scale_bytes


def main_kv_format(dim: int) -> EntryFormat:
    return EntryFormat("main KV", dim, 16, fp4=True, e4m3_scale=True)


def index_k_format(dim: int) -> EntryFormat:
    return EntryFormat("indexer K", dim, 32, fp4=True, e4m3_scale=False)


def swa_format(dim: int) -> EntryFormat:
    return EntryFormat("SWA", dim, 32, fp4=False, e4m3_scale=False)


def pack_rows(x: torch.Tensor, fmt: EntryFormat) -> torch.Tensor:
    """Quantize rows x [..., dim] and pack them: uint8 [..., entry_bytes]."""
    if x.size(-1) != fmt.dim:
        raise ValueError(f"{fmt.name} rows have {fmt.dim} channels, got {x.size(-1)}")
    if _loop_packs(x, fmt):
        rows = x.reshape(-1, fmt.dim).float().contiguous()
        packed = torch.empty(rows.size(0), fmt.entry_bytes, dtype=torch.uint8)
        if cpu_loops.fp8_pack_rows(rows.numpy(), packed.numpy()):
            return packed.view(*x.shape[:-1], fmt.entry_bytes)
    if fmt.fp4:
        codes, scale = fp4_quant(x, fmt.block, fmt.e4m3_scale)
    else:
        values, scale = fp8_quant(x, fmt.block)
        codes = values.view(torch.uint8)
    scale_codes = codecs.e4m3_encode(scale) if fmt.e4m3_scale else codecs.e8m0_encode(scale, "up")
    return torch.cat([codes, scale_codes], dim=-1)


def _loop_packs(x: torch.Tensor, fmt: EntryFormat) -> bool:
    """Whether the compiled loop packs these rows (`cpu_loops.fp8_pack_rows`, the same bytes as the
    operators below; about 30 operator calls fewer for the SWA rows a step writes in every layer):
    an FP8 format with E8M0 scales per 32 channels, CPU rows without autograd."""
    return not fmt.fp4 and not fmt.e4m3_scale and fmt.block == cpu_loops.FP8_BLOCK and cpu_loops.serves(x)


def unpack_rows(packed: torch.Tensor, fmt: EntryFormat, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """uint8 [..., entry_bytes] -> dequantized rows [..., dim] in `dtype`."""
    if packed.size(-1) != fmt.entry_bytes:
        raise ValueError(f"{fmt.name} entries are {fmt.entry_bytes} bytes, got {packed.size(-1)}")
    # A code times its power-of-two or E4M3 scale has at most 6 significant bits, so the product
    # is exact in fp32: computing in bf16 gives that product rounded to bf16 once, with half the traffic.
    work = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    if cpu_loops.serves(packed):  # one lookup per code byte of its value(s) times its block's scale
        table = codecs.scaled_code_table(fmt.fp4, fmt.e4m3_scale, fmt.block, work)
        entries = packed.reshape(-1, fmt.entry_bytes).view(torch.uint8)
        values = torch.empty(entries.size(0), fmt.code_bytes, dtype=table.dtype)
        cpu_loops.unpack_by_table(entries.numpy(), fmt.code_bytes, table.numpy(), values.numpy())
        return values.view(work).view(*packed.shape[:-1], fmt.dim).to(dtype)
    codes, scale_codes = packed[..., : fmt.code_bytes], packed[..., fmt.code_bytes :]
    values = codecs.e2m1_decode_bytes(codes, work) if fmt.fp4 else codecs.e4m3_decode(codes, work)
    scale = codecs.e4m3_decode(scale_codes, work) if fmt.e4m3_scale else codecs.e8m0_decode(scale_codes).to(work)
    return (values.unflatten(-1, (-1, fmt.block)) * scale.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_dequantize(x: torch.Tensor, fmt: EntryFormat) -> torch.Tensor:
    """The values an entry of `fmt` holds for rows x: what `unpack_rows(pack_rows(x))` returns."""
    return fp4_qdq(x, fmt.block, fmt.e4m3_scale) if fmt.fp4 else fp8_qdq(x, fmt.block)
