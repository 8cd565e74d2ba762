"""Engram: hashed n-gram lookups added to the residual streams at a few layers (SPEC.md §7).

Row ids depend only on token ids, which is why a runtime can fetch the rows ahead of the layer.
Token ids are first folded by a compressed map (tokens whose text normalises alike share an id),
then each position hashes the 2..max-gram ending at it into prime-sized bucket ranges.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
from torch import nn

from dsv41.config import TextConfig
from dsv41.model import numerics
from dsv41.model.layers import Linear, Storage

# A token that is exactly one space is protected by this private-use character while the
# normaliser strips, so it keeps its own compressed id instead of becoming the empty string.
_SPACE_SENTINEL = "\ue000"


@lru_cache(maxsize=1)
def _normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SPACE_SENTINEL, " "),
    ])


def compression_key(decoded: str, raw_token: str) -> str:
    """The text under which a token is merged: its normalised decode, the decode itself when that
    normalises to nothing, or the raw token string for partial UTF-8 pieces (decode has U+FFFD)."""
    if "\ufffd" in decoded:
        return raw_token
    return _normalizer().normalize_str(decoded) or decoded


def compressed_token_map(decoded: list[str], raw_tokens: list[str]) -> tuple[list[int], int]:
    """Map token id -> compressed id, ids assigned in first-seen order. Returns (map, size)."""
    ids: dict[str, int] = {}
    pairs = zip(decoded, raw_tokens, strict=True)
    mapping = [ids.setdefault(compression_key(text, raw), len(ids)) for text, raw in pairs]
    return mapping, len(ids)


def token_map_from_tokenizer(tokenizer) -> tuple[list[int], int]:
    """The compressed map of a `tokenizers.Tokenizer`, decoding each id on its own, specials kept."""
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    decoded = [tokenizer.decode([i], skip_special_tokens=False) for i in range(size)]
    raw = [tokenizer.id_to_token(i) for i in range(size)]
    return compressed_token_map(decoded, raw)


def table_primes(vocab_size: int, n_layers: int, max_ngram: int, n_heads: int) -> list[list[list[int]]]:
    """[layer][order][head] bucket moduli: for each layer and order, the n_heads smallest primes
    >= vocab_size not used before anywhere in the model (so every range is disjoint)."""
    from sympy import nextprime

    used: set[int] = set()
    layers = []
    for _ in range(n_layers):
        orders = []
        for _ in range(max_ngram - 1):
            heads, p = [], vocab_size - 1
            for _ in range(n_heads):
                p = nextprime(p)
                while p in used:
                    p = nextprime(p)
                used.add(p)
                heads.append(p)
            orders.append(heads)
        layers.append(orders)
    return layers


def table_rows(t: TextConfig) -> list[int]:
    """Rows per Engram table implied by the prime layout; must equal engram_num_embeddings."""
    primes = table_primes(t.engram_vocab_size, len(t.engram_layer_ids), t.engram_max_ngram_size, t.engram_n_heads)
    return [sum(sum(order) for order in layer) for layer in primes]


def hash_multipliers(layer_ids: list[int], max_ngram: int, compressed_vocab: int) -> torch.Tensor:
    """[n_layers, max_ngram] odd int64 multipliers from numpy's PCG64 seeded with 10007 * layer,
    bounded so that compressed id * multiplier cannot overflow int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=max_ngram, dtype=np.int64) * 2 + 1
            for layer in layer_ids]
    return torch.from_numpy(np.stack(rows))


@dataclass(frozen=True)
class EngramHasher:
    """Hash ids for every position: [b, s, n_engram_layers, (max_ngram-1) * n_heads] row ids."""

    token_map: torch.Tensor  # [vocab] compressed id per token id
    multipliers: torch.Tensor  # [n_layers, max_ngram]
    primes: torch.Tensor  # [n_layers, max_ngram-1, n_heads]
    offsets: torch.Tensor  # [n_layers, (max_ngram-1) * n_heads] first row of each bucket range
    pad_id: int  # compressed id of the pad token, used where the look-back is blocked

    @classmethod
    def build(cls, t: TextConfig, token_map: list[int]) -> EngramHasher:
        compressed_vocab = max(token_map) + 1
        if compressed_vocab != t.engram_compressed_vocab_size:
            raise ValueError(f"the tokenizer compresses to {compressed_vocab} ids but the config says "
                             f"engram_compressed_vocab_size = {t.engram_compressed_vocab_size}")
        primes = torch.tensor(table_primes(t.engram_vocab_size, len(t.engram_layer_ids),
                                           t.engram_max_ngram_size, t.engram_n_heads))
        flat = primes.flatten(1)
        offsets = torch.cumsum(flat, dim=1) - flat
        return cls(torch.tensor(token_map), hash_multipliers(t.engram_layer_ids, t.engram_max_ngram_size,
                                                             compressed_vocab),
                   primes, offsets, token_map[t.engram_pad_token_id])

    def __call__(self, ids: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        """ids [b, s]; live [b, s] False for tokens that break n-grams (image spans)."""
        compressed = self.token_map[ids]
        dead = torch.zeros_like(ids, dtype=torch.bool) if live is None else ~live
        max_ngram = self.multipliers.size(1)
        looked_back, blocked = [], torch.zeros_like(dead)
        for k in range(max_ngram):
            source = _shift_right(compressed, k)
            blocked = blocked | _shift_right(dead, k, fill=True)
            looked_back.append(torch.where(blocked, self.pad_id, source))
        products = torch.stack(looked_back, dim=-1).unsqueeze(2) * self.multipliers  # [b, s, layers, n]
        rolling, hashes = products[..., 0], []
        for k in range(1, max_ngram):
            rolling = torch.bitwise_xor(rolling, products[..., k])
            hashes.append(rolling.unsqueeze(-1) % self.primes[:, k - 1])
        return torch.cat(hashes, dim=-1) + self.offsets


def _shift_right(x: torch.Tensor, k: int, fill=0) -> torch.Tensor:
    """x shifted right by k along the sequence; the first k positions (before the start) get `fill`."""
    if k == 0:
        return x
    return torch.cat([torch.full_like(x[:, :k], fill), x[:, :-k]], dim=1)


class EngramTable(nn.Module):
    """FP8 rows with one E8M0 scale per 32 channels; rows are dequantized on lookup."""

    def __init__(self, rows: int, dim: int, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.scale = nn.Parameter(torch.empty(rows, dim // 32, dtype=torch.float8_e8m0fnu, device=device),
                                  requires_grad=False)

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        if self.scale is None:  # float master rows (training), looked up as they are
            return self.weight[row_ids]
        values = self.weight[row_ids].float().unflatten(-1, (-1, 32)) * self.scale[row_ids].float().unsqueeze(-1)
        return values.flatten(-2).to(torch.bfloat16)


class Engram(nn.Module):
    """Adds a gated value to each stream: the looked-up rows give one key per stream and one shared
    value; each stream's gate is a signed-sqrt sigmoid of its normalised dot with its key."""

    def __init__(self, t: TextConfig, table_index: int, device=None):
        super().__init__()
        self.table_index, self.dim, self.hc, self.eps = table_index, t.hidden_size, t.hc_mult, t.rms_norm_eps
        n_cols = (t.engram_max_ngram_size - 1) * t.engram_n_heads
        self.embed = EngramTable(t.engram_num_embeddings[table_index], t.engram_head_dim, device)
        self.wkv = Linear(n_cols * t.engram_head_dim, self.dim * (self.hc + 1), Storage.FP8, device)
        self.q_weight = nn.Parameter(torch.empty(self.hc, self.dim, dtype=torch.bfloat16, device=device),
                                     requires_grad=False)
        self.k_weight = nn.Parameter(torch.empty(self.hc, self.dim, dtype=torch.bfloat16, device=device),
                                     requires_grad=False)

    def forward(self, x: torch.Tensor, looked: torch.Tensor, live: torch.Tensor | None = None,
                sizes: list[int] | None = None) -> torch.Tensor:
        """x [b, s, hc, dim]; looked [b, s, n_cols, head_dim]: the rows `embed` looked up for this
        layer (here, or ahead of need by the engram component). `sizes`: the token counts of a
        batch's sequences along s, whose gates are then computed as alone (torch's sigmoid over
        hc-wide rows takes vector or scalar code by an element's place in the tensor, and the two
        differ in the last bit on some CPUs)."""
        kv = self.wkv(looked.flatten(-2))
        key, value = kv.split([self.hc * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc, self.dim))
        h = x.float()
        rstd = (numerics.elementwise(torch.rsqrt, numerics.wide(h).square().mean(-1).float() + self.eps)
                * numerics.elementwise(torch.rsqrt, numerics.wide(key).square().mean(-1).float() + self.eps))
        weight = self.q_weight.float() * self.k_weight.float()
        dot = numerics.wide(h * weight * key).sum(-1).float() * rstd * self.dim**-0.5
        signed_root = torch.copysign(numerics.elementwise(torch.sqrt, dot.abs().clamp_min(1e-6)), dot)
        if sizes is None:
            gate = numerics.elementwise(torch.sigmoid, signed_root)
        elif len(set(sizes)) == 1:  # equal sequences (a decode step): one call, each as alone
            gate = numerics.elementwise_runs(torch.sigmoid, signed_root, sizes[0] * self.hc)
        else:
            gate = torch.cat([numerics.elementwise(torch.sigmoid, part) for part in signed_root.split(sizes, dim=1)],
                             dim=1)
        if live is not None:
            gate = gate.masked_fill(~live.unsqueeze(-1), 0)
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(x.dtype)
