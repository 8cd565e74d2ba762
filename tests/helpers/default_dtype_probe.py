"""Runs a representative set of dsv41 ops and returns their results, so a test can compare a
process whose torch default dtype was bf16 before dsv41 was imported (as the official generate.py
sets it) with one under the fp32 default.

Run as a script: `python -m tests.helpers.default_dtype_probe DTYPE SEED OUT` sets the default
dtype first, then imports dsv41 (its import-time tables are built under that default) and saves
the results to OUT.
"""

from __future__ import annotations

import sys

import torch


def probe(seed: int) -> dict[str, torch.Tensor]:
    """Results of codecs, quantizers, GEMMs, packing, RoPE, the fused mHC kernel and a micro model
    (prefill and packed cached decode), all from inputs drawn with `seed`."""
    from dsv41.config import Rope, load_config
    from dsv41.kernels import codecs, layouts, triton_kernels
    from dsv41.kernels import torch_ops as ops
    from dsv41.model import quant, rope
    from dsv41.model.cache import DecodeCache
    from dsv41.model.decode import cached_generate
    from dsv41.model.layers import Linear, Storage
    from dsv41.model.reference import forward, random_model

    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float32)

    out: dict[str, torch.Tensor] = {}
    every_byte = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    out["e2m1_decode"] = codecs.e2m1_decode(every_byte & 0xF)
    out["e2m1_decode_bytes_fp32"] = codecs.e2m1_decode_bytes(every_byte.view(-1, 2), torch.float32)
    out["e2m1_decode_bytes_bf16"] = codecs.e2m1_decode_bytes(every_byte.view(-1, 2), torch.bfloat16)
    out["e4m3_decode"] = codecs.e4m3_decode(every_byte)
    out["e8m0_decode"] = codecs.e8m0_decode(every_byte)
    x = normal(8, 512) * 4
    out["e2m1_encode"] = codecs.e2m1_encode(x)
    out["e4m3_encode"] = codecs.e4m3_encode(x)
    out["e8m0_encode"] = codecs.e8m0_encode(x.abs(), "nearest")
    out["pow2_scale_up"] = codecs.pow2_scale_up(x.abs(), 448.0)
    out["ocp_mx_scale"] = codecs.ocp_mx_scale(x.abs(), 2)
    out["e4m3_scale"] = codecs.e4m3_scale(x.abs())
    xb = x.bfloat16()
    out["fp8_q"], out["fp8_scale"] = quant.fp8_quant(xb)
    out["fp8_qdq"] = quant.fp8_qdq(xb)
    out["mxfp4_qdq"], out["main_kv_qdq"] = quant.mxfp4_qdq(xb), quant.main_kv_qdq(xb)
    for fmt in (layouts.main_kv_format(512), layouts.index_k_format(128), layouts.swa_format(512)):
        rows = xb[:, : fmt.dim]
        packed = layouts.pack_rows(rows, fmt)
        out[f"pack {fmt.name}"] = packed
        out[f"unpack {fmt.name}"] = layouts.unpack_rows(packed, fmt)
        out[f"unpack fp32 {fmt.name}"] = layouts.unpack_rows(packed, fmt, torch.float32)
        out[f"triton pack {fmt.name}"] = triton_kernels.pack_rows(rows, fmt)
    w = normal(96, 128) * 128**-0.5
    for storage in (Storage.FP8, Storage.FP4):
        layer = Linear(128, 96, storage)
        values, scale = (quant.quantize_weight_fp8 if storage is Storage.FP8 else quant.quantize_weight_fp4)(w)
        layer.weight.data, layer.scale.data = values, scale
        out[f"{storage} weight"], out[f"{storage} scale"] = values, scale
        out[f"{storage} dequantized"] = torch.cat([t.flatten() for t in layer.dequantized()])
        out[f"{storage} gemm"] = layer(xb[:, :128])
    config = load_config("micro")
    t = config.text_config
    for kind in (Rope.PLAIN, Rope.YARN):
        table = rope.table_for(t, kind, 64)
        out[f"rope table {kind}"] = table
        out[f"rope rotate {kind}"] = rope.rotate(normal(2, 64, t.qk_rope_head_dim + 8).bfloat16(), table)
    hc, d, tokens = 4, 64, 3
    mhc_args = (normal(1, tokens, hc, d).bfloat16(), normal(1, tokens, d).bfloat16(), normal(1, tokens, hc).sigmoid(),
                normal(1, tokens, hc, hc).softmax(-1), normal(1, tokens, hc).softmax(-1), normal(24, hc * d) * 0.05,
                1 + 0.1 * normal(3), 0.5 * normal(24))
    for name, kernel in (("twin", ops.mhc_update), ("triton", triton_kernels.mhc_update)):
        for i, result in enumerate(kernel(*mhc_args, 20, 1e-6, 1e-6)):
            out[f"mhc {name} {i}"] = result
    model = random_model(config, seed=seed % 1000)
    out["micro params"] = torch.cat([p.detach().contiguous().view(torch.uint8).flatten() for p in model.parameters()])
    ids = torch.randint(3, t.vocab_size, (1, 10), generator=gen)
    out["micro logits"] = forward(model, ids).logits
    cache = DecodeCache.allocate(config, 1, 32, packed=True)
    out["micro cache dtypes"] = torch.tensor([g.kv_state.dtype == torch.float32 for g in cache.groups.values()
                                              if g.kv_state is not None])
    out["micro cached decode"] = torch.tensor(list(cached_generate(model, ids[0].tolist(), 3, packed=True)))
    return out


def main(dtype: str, seed: str, path: str) -> None:
    torch.set_default_dtype(getattr(torch, dtype))
    torch.save(probe(int(seed)), path)


if __name__ == "__main__":
    main(*sys.argv[1:])
