"""DSpark, the speculative drafter (SPEC.md §8), stored as `mtp.0..2`.

Three mHC stages with SWA-only attention. The drafter reads the backbone through `main_hidden`,
the mean over the 4 stream copies entering each target layer (concatenated over the target
layers): stage 0 projects it (`main_proj`, `main_norm`) to `main_x`, and every stage keeps its own
W-slot ring of `kv_norm(wkv(main_x))` entries (RoPE at the backbone position, FP8), written only
from backbone states of accepted positions. A draft pass takes the token the backbone just chose
followed by block_size - 1 noise tokens at the next positions; their queries attend, in one
softmax with the sink, to the ring and to all draft rows of the block (bidirectional inside the
block; draft rows are never stored). After the last stage the streams are collapsed, normed and
sent through the shared head: base logits for block_size draft positions. The Markov head then
adds a low-rank bias from the previous token, one position at a time, and each draft token is
sampled from the biased logits before the next position's bias is computed. The confidence head
gives one raw logit per draft position from the collapsed pre-norm hidden state and the previous
token's Markov embedding: the drafter's estimate that this position will be accepted.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from dsv41.checkpoint import read_tensors
from dsv41.config import ModelConfig
from dsv41.kernels import dispatch
from dsv41.kernels.layouts import swa_format
from dsv41.kernels.torch_ops import sparse_attention
from dsv41.model import mhc, numerics
from dsv41.model.attention import Attention, ring_indices
from dsv41.model.blocks import Block
from dsv41.model.cache import EntryStore
from dsv41.model.layers import Embedding, Linear, RMSNorm, Storage
from dsv41.model.moe import MoE
from dsv41.model.quant import fp8_qdq
from dsv41.model.rope import rotate, table_for


class MarkovHead(nn.Module):
    """bias(token) = head(embed(token)): a rank-r bigram correction to the draft logits."""

    def __init__(self, vocab: int, rank: int, device=None):
        super().__init__()
        self.embed = Embedding(vocab, rank, device)
        self.head = Linear(rank, vocab, Storage.FP32, device)

    def bias(self, token_embedding: torch.Tensor) -> torch.Tensor:
        return numerics.linear(token_embedding.float(), self.head.weight)


class ConfidenceHead(nn.Module):
    def __init__(self, dim: int, rank: int, device=None):
        super().__init__()
        self.proj = Linear(dim + rank, 1, Storage.FP32, device)

    def forward(self, hidden: torch.Tensor, token_embedding: torch.Tensor) -> torch.Tensor:
        """Raw fp32 logit [...] from the collapsed pre-norm hidden and the Markov embedding."""
        joined = torch.cat([hidden, token_embedding.to(hidden.dtype)], dim=-1).float()
        return numerics.linear(joined, self.proj.weight)[..., 0]


class DSparkStage(Block):
    """A backbone-shaped mHC block (SWA-only attention, its own MoE size). Stage 0 also owns
    main_proj/main_norm, the last stage the final norm, the Markov head and the confidence head."""

    def __init__(self, config: ModelConfig, index: int, device=None):
        t = config.text_config
        spec = config.plan.layers[t.num_hidden_layers + index]
        super().__init__(t, spec, False, device)
        self.ffn = MoE(t.hidden_size, t.moe_intermediate_size, t.dspark_n_routed_experts,
                       t.dspark_num_experts_per_tok, t.routed_scaling_factor, t.scoring_func, t.swiglu_limit,
                       config.vision_config.num_hidden_layers > 0, device)  # bias_vl is stored but drafts are text
        self.index = index
        if index == 0:
            n_targets = len(t.dspark_target_layer_ids)
            self.main_proj = Linear(n_targets * t.hidden_size, t.hidden_size, Storage.FP8, device)
            self.main_norm = RMSNorm(t.hidden_size, t.rms_norm_eps, device)
        if index == t.num_nextn_predict_layers - 1:
            self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps, device)
            self.markov_head = MarkovHead(t.vocab_size, t.dspark_markov_rank, device)
            self.confidence_head = ConfidenceHead(t.hidden_size, t.dspark_markov_rank, device)

    def ring_entries(self, main_x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Unquantized post-RoPE ring entries [b, n, head_dim] of main_x [b, n, dim] at `table` rows."""
        return rotate(self.attn.kv_norm(self.attn.wkv(main_x)), table)

    def run(self, x: torch.Tensor, pre_mix: torch.Tensor, table: torch.Tensor,
            rings: list[torch.Tensor] | torch.Tensor,
            ring_idx: list[torch.Tensor] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft rows of several blocks x [n_blocks, s, hc, dim] (block i at rows table[i]
        [s, rope/2]) through the stage; block i attends to rings[i] (values [W, head_dim]) at
        ring_idx[i] ([W] slots, -1 unused) and to its own s rows. Stacked rings [n_blocks, W,
        head_dim] with ring_idx [n_blocks, W] run all blocks in one attention call."""
        attn_pre, attn_post, attn_comb = self.coefficients(x, "attn")
        attn_out = self._draft_attention(self.attn_norm(mhc.collapse(x, pre_mix)), table, rings, ring_idx)
        x, ffn_in, ffn_pre, ffn_post, ffn_comb = dispatch.mhc_update(
            x, attn_out, attn_post, attn_comb, attn_pre, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base,
            self.iters, self.hc_eps, self.eps)
        ffn_out = self.ffn(self.ffn_norm(ffn_in))
        return mhc.expand(ffn_out, x, ffn_post, ffn_comb), ffn_pre

    def _draft_attention(self, x, table, rings, ring_idx) -> torch.Tensor:
        attn: Attention = self.attn
        b, s, _ = x.shape
        flat = table.flatten(0, 1)  # one row per draft row of every block

        def heads(t: torch.Tensor, inverse: bool = False) -> torch.Tensor:  # [b, s, heads, d]
            return rotate(t.flatten(0, 1).unsqueeze(0), flat, inverse).view(t.shape)

        qr = attn.q_norm(attn.wq_a(x))
        q = heads(attn.wq_b(qr).unflatten(-1, (attn.n_heads, attn.head_dim)))
        kv = rotate(attn.kv_norm(attn.wkv(x)), table)
        if isinstance(rings, torch.Tensor):  # every block's window at once [b, W, head_dim]
            keys = torch.cat([rings, fp8_qdq(kv)], dim=1)
            own = rings.size(1) + torch.arange(s).expand(b, s)
            idx = torch.cat([ring_idx, own], dim=1).int().unsqueeze(1).expand(b, s, -1)
            outs = [sparse_attention(q, keys, attn.attn_sink, idx, attn.head_dim**-0.5)]
        else:
            outs = []
            for i in range(b):
                ring = rings[i]
                keys = torch.cat([ring, fp8_qdq(kv[i])], dim=0).unsqueeze(0)
                idx = torch.cat([ring_idx[i], ring.size(0) + torch.arange(s)]).int().expand(1, s, -1)
                outs.append(sparse_attention(q[i : i + 1], keys, attn.attn_sink, idx, attn.head_dim**-0.5))
        o = heads(torch.cat(outs), inverse=True).view(b, s, attn.n_groups, -1)
        wo_a = attn.wo_a.weight
        o = numerics.grouped_projection(o.to(wo_a.dtype), wo_a.view(attn.n_groups, attn.o_rank, -1))
        return attn.wo_b(o.flatten(2))


@dataclass
class DraftState:
    """One sequence's drafter state: a ring per stage, and how many backbone positions it has
    taken in (the next ring position)."""

    rings: list[EntryStore]
    length: int = 0

    def clone(self) -> DraftState:
        return DraftState([EntryStore(r.data.clone(), r.fmt, r.packed) for r in self.rings], self.length)


@dataclass
class Draft:
    """One draft pass of a batch of sequences."""

    tokens: torch.Tensor  # [b, block] drafted tokens for the positions after the input token
    logits: torch.Tensor  # [b, block, vocab] fp32: base logits + Markov bias (what the drafts came from)
    confidence: torch.Tensor  # [b, block] raw fp32 confidence logits


def new_state(config: ModelConfig, packed: bool = False) -> DraftState:
    t = config.text_config
    return DraftState([EntryStore.allocate(1, t.sliding_window, swa_format(t.head_dim), packed)
                       for _ in range(t.num_nextn_predict_layers)])


class Drafter:
    """The drafting procedure over a model whose `mtp` stages are loaded."""

    def __init__(self, model, drafter: DSpark):
        self.model = model  # the backbone: its embedding and head are shared
        t = model.config.text_config
        self.t, self.block, self.window = t, t.dspark_block_size, t.sliding_window
        self.stages: list[DSparkStage] = list(drafter.mtp)
        self.table = table_for(t, self.stages[0].spec.rope, t.max_position_embeddings + self.block + 1)

    @torch.inference_mode()
    def observe(self, state: DraftState, main_hidden: torch.Tensor) -> None:
        """Take in the backbone's main_hidden [n, n_targets * dim] of positions state.length..:
        each stage writes their ring entries (positions already accepted)."""
        n, start = main_hidden.size(0), state.length
        if n == 0:
            return
        first = self.stages[0]
        main_x = first.main_norm(first.main_proj(main_hidden.unsqueeze(0)))
        kept = torch.arange(max(0, n - self.window), n)
        rows = self.table[start + kept]
        for stage, ring in zip(self.stages, state.rings, strict=True):
            ring.write((start + kept) % self.window, stage.ring_entries(main_x[:, kept], rows))
        state.length += n

    def warm_up(self) -> None:
        """Observe and draft for a throwaway sequence. The first calls build what later calls reuse
        (the compiled loops loaded, weights dequantized, the allocator's blocks): about 0.35 s on
        the default model, which would otherwise land in a served request's first speculative round
        (a sixth of a 64-token `dsv41 run` on 2 cores)."""
        state = new_state(self.model.config)
        width = self.stages[0].main_proj.in_features
        self.observe(state, torch.ones(2, width, dtype=self.stages[0].attn_norm.weight.dtype))
        self.draft([state], [self.t.dspark_noise_token_id])

    @torch.inference_mode()
    def draft(self, states: list[DraftState], tokens: list[int], temperature: float = 0.0,
              generators: list[torch.Generator | None] | None = None) -> Draft:
        """One pass for each sequence: `tokens[i]` is the token chosen at position states[i].length
        (not yet taken in); drafts the block_size tokens after it. temperature 0 drafts the argmax,
        otherwise samples softmax(logits / temperature)."""
        idx = [ring_indices(st.length - 1, self.window)[0] if st.length else torch.full((self.window,), -1)
               for st in states]
        starts = torch.tensor([st.length for st in states])

        def rings_of(j: int):  # every sequence's ring of stage j, read in one call: one attention call for all
            rings = [st.rings[j] for st in states]
            if any((ring.packed, ring.fmt) != (rings[0].packed, rings[0].fmt) for ring in rings):
                return [ring.read()[0] for ring in rings], idx
            return rings[0].values(torch.cat([ring.data for ring in rings])), torch.stack(idx)

        hidden, base = self._blocks(torch.tensor(tokens), starts, rings_of)
        return self._markov(self.stages[-1], base, hidden, torch.tensor(tokens), temperature, generators)

    def _blocks(self, tokens: torch.Tensor, starts: torch.Tensor, rings_of) -> tuple[torch.Tensor, torch.Tensor]:
        """Blocks of tokens[i] then noise at positions starts[i].. through the stages (`rings_of(j)`:
        stage j's rings and slots, see DSparkStage.run): collapsed pre-norm hidden [b, block, dim]
        and base logits [b, block, vocab]."""
        s, hc = self.block, self.t.hc_mult
        ids = torch.cat([tokens.unsqueeze(1), torch.full((tokens.numel(), s - 1), self.t.dspark_noise_token_id)], 1)
        dtype = self.stages[0].attn_norm.weight.dtype  # bf16 served, fp32 in training
        x = self.model.embed(ids).to(dtype).unsqueeze(2).repeat(1, 1, hc, 1)
        pre_mix = mhc.first_pre_mix(x, hc)
        table = self.table[starts.unsqueeze(1) + torch.arange(s)]
        for j, stage in enumerate(self.stages):
            x, pre_mix = stage.run(x, pre_mix, table, *rings_of(j))
        hidden = mhc.collapse(x, pre_mix)
        return hidden, numerics.linear(self.stages[-1].norm(hidden).float(), self.model.head.weight)

    def teacher_forced(self, main_hidden: torch.Tensor, tokens: torch.Tensor, anchors: torch.Tensor,
                       previous: torch.Tensor) -> Draft:
        """The draft pass of many blocks at once, differentiable in the stages (training with the
        backbone frozen). main_hidden [n_seq, L, n_targets * dim] and tokens [n_seq, L] are accepted
        positions; anchors [n, 2] (sequence, position p) each draft after tokens[seq, p] with the
        ring of positions p-W..p-1, as `observe` up to p then `draft` would. previous [n, block]
        holds the token before each draft position (tokens[seq, p], then the target tokens): the
        Markov head reads it in place of the drafts (they are equal wherever acceptance can still
        reach). The confidence head sees its inputs detached, so it learns on top of the drafter
        without steering it. Draft.tokens are the argmax of the biased logits."""
        first, n_seq, length = self.stages[0], tokens.size(0), tokens.size(1)
        main_x = first.main_norm(first.main_proj(main_hidden.to(first.main_norm.weight.dtype)))
        table = self.table[:length].expand(n_seq, -1, -1)
        seq, p = anchors[:, 0], anchors[:, 1]
        window = p.unsqueeze(1) - self.window + torch.arange(self.window)  # oldest first, -1 in front
        idx = torch.where(window >= 0, torch.arange(self.window), -1)
        rows = window.clamp(min=0)

        def rings_of(j: int):
            entries = fp8_qdq(self.stages[j].ring_entries(main_x, table))
            return entries[seq.unsqueeze(1), rows], idx

        hidden, base = self._blocks(tokens[seq, p], p, rings_of)
        last = self.stages[-1]
        emb = last.markov_head.embed(previous)
        logits = base + last.markov_head.bias(emb)
        confidence = last.confidence_head(hidden.detach(), emb.detach())
        return Draft(logits.argmax(-1), logits, confidence)

    def _markov(self, last: DSparkStage, base, hidden, first, temperature, generators) -> Draft:
        b, s = base.shape[:2]
        previous = first
        out, logits, confidence = [], [], []
        for i in range(s):
            emb = last.markov_head.embed(previous)
            row = base[:, i] + last.markov_head.bias(emb)
            confidence.append(last.confidence_head(hidden[:, i], emb))
            logits.append(row)
            if temperature == 0:
                previous = row.argmax(-1)
            else:
                probs = torch.softmax(row / max(temperature, 1e-5), dim=-1)
                previous = torch.cat([torch.multinomial(probs[k : k + 1], 1, generator=(generators or [None] * b)[k])[0]
                                      for k in range(b)])
            out.append(previous)
        return Draft(torch.stack(out, 1), torch.stack(logits, 1), torch.stack(confidence, 1))


class DSpark(nn.Module):
    """The stages under their checkpoint names (`mtp.{j}.…`). The token embedding and the LM head
    are the backbone's (not stored under mtp.*)."""

    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        t = config.text_config
        if not (t.num_nextn_predict_layers and t.dspark_block_size):
            raise ValueError("this config has no DSpark stages (num_nextn_predict_layers / dspark_block_size)")
        self.config = config
        self.mtp = nn.ModuleList(DSparkStage(config, j, device) for j in range(t.num_nextn_predict_layers))


def build_dspark(config: ModelConfig, device: str | None = None) -> DSpark:
    with torch.device(device or "cpu"):
        return DSpark(config, device).eval()


def has_drafter(files: list[Path]) -> bool:
    """Whether the checkpoint files hold DSpark stages."""
    return any(name.startswith("mtp.") for file in files for name in _names(file))


def _names(file: Path) -> list[str]:
    with safe_open(str(file), "pt") as handle:
        return list(handle.keys())


@torch.no_grad()
def load_dspark(config: ModelConfig, files: list[Path]) -> DSpark:
    """The DSpark stages from the `mtp.*` tensors of checkpoint files (in their stored formats:
    FP8 + E8M0 tiles, I8-packed FP4 experts, BF16; wo_a dequantized and the two heads promoted to
    fp32 as the backbone's are). Every missing or mis-shaped tensor is named."""
    from dsv41.checkpoint import CheckpointError, _convert

    drafter = build_dspark(config)
    params = {name: p for name, p in drafter.named_parameters()}
    stored = read_tensors(files, [n for file in files for n in _names(file) if n.startswith("mtp.")])
    problems, used = [], set()

    def read(name: str) -> torch.Tensor | None:
        used.add(name)
        return stored.get(name)

    for name, param in params.items():
        value = read(name)
        if value is None:
            problems.append(f"{name}: missing from the checkpoint")
            continue
        if value.dtype == torch.bfloat16 and param.dtype == torch.float32:
            value = value.float()  # the Markov and confidence heads are held in fp32 (exact)
        value = _convert(name, value, param, read)
        if isinstance(value, str):
            problems.append(value)
        else:
            param.copy_(value)
    problems += [f"{name}: unexpected tensor (the drafter has no such parameter)"
                 for name in stored if name not in used]
    if problems:
        raise CheckpointError(", ".join(str(f) for f in files), problems)
    return drafter


def dspark_tensors(drafter: DSpark) -> dict[str, torch.Tensor]:
    """The stages' tensors by checkpoint name in their stored formats (wo_a back to FP8 tiles, the
    fp32-held heads back to BF16): what `export_model(extra=...)` writes."""
    from dsv41.model.quant import quantize_weight_fp8

    out = {}
    for name, p in drafter.state_dict().items():
        if name.endswith(".wo_a.weight"):
            values, scale = quantize_weight_fp8(p.float())
            out[name], out[name[: -len("weight")] + "scale"] = values, scale
        elif name.endswith(("markov_head.head.weight", "confidence_head.proj.weight")):
            out[name] = p.to(torch.bfloat16)
        else:
            out[name] = p.detach().clone()
    return out
