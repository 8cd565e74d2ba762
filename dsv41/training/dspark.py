"""Training the DSpark drafter with the backbone frozen (self-distillation).

The drafter must predict what the served backbone will choose, so it learns from the backbone's
own greedy continuations: prompts cut from the corpus are continued greedily by the served model
(inference numerics, the engine's batched decode), and every generated position keeps its
`main_hidden`, the drafter's only view of the backbone. A training step drafts blocks after random
generated positions p, with the ring of positions p-W..p-1, exactly as `Drafter.observe` then
`Drafter.draft` would at that point of greedy decoding (`Drafter.teacher_forced`, the same stages
and code, differentiable). Targets are the backbone's greedy tokens at p+1..p+block: cross-entropy
of the drafted logits (base + Markov bias from the previous target token), plus a binary
cross-entropy that teaches the confidence head whether each draft equals its target. With
teacher-forced previous tokens that label is the acceptance of draft i given drafts < i were
accepted, which is what the scheduler multiplies into prefix survivals.

Optimiser, schedule, clipping, router balancing, logging and the run loop are the backbone
trainer's (`dsv41.training.loop`). Validation reads held-out continuations: the teacher-forced
loss and per-position top-1 agreement of the training form, and the acceptance of the drafter as
it is exported (masters through the stored formats and `load_dspark`, drafting with the inference
path), with the confidence head's calibration.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tokenizers import Tokenizer

from dsv41.config import ModelConfig, config_from_dict, config_to_dict
from dsv41.engine.core import InferenceCore
from dsv41.model.dspark import Drafter, DSpark, build_dspark, dspark_tensors, load_dspark, new_state
from dsv41.model.random_init import init_random
from dsv41.model.transformer import Transformer
from dsv41.training.data import Corpus, sample_batch
from dsv41.training.loop import KEEP_CHECKPOINTS, RouterBalance, TrainOptions, learning_rate, read_checkpoint
from dsv41.training.master import inference_state, to_training

DSPARK_FORMAT = "dsv41-dspark-train-1"
DISTILL_FORMAT = "dsv41-dspark-distill-1"
GENERATION_BATCH = 32  # continuations decoded as one engine batch (a batch of 32 costs far less than 32 steps)


@dataclass(frozen=True)
class DraftOptions(TrainOptions):
    """TrainOptions for the drafter: seq_len is the length of each greedy continuation sample
    (prompt included), batch the samples per step."""

    prompt_len: int = 64  # corpus tokens before each greedy continuation
    samples: int = 128  # training continuations (the distillation set)
    val_samples: int = 16  # held-out continuations
    anchors: int = 16  # blocks drafted per sample per step
    confidence_weight: float = 1.0
    val_anchors: int = 8  # blocks per held-out sample drafted through the exported drafter


@dataclass
class DistillSet:
    tokens: torch.Tensor  # [n, L] prompt then the backbone's greedy tokens
    hidden: torch.Tensor  # [n, L, n_targets * dim] main_hidden of each position (the last is unused)


@dataclass
class DraftStep:
    step: int
    loss: float  # cross-entropy against the backbone's greedy tokens, nats/token
    confidence_loss: float  # BCE of the confidence head
    agreement: float  # drafts equal to their target, all positions
    lr: float
    grad_norm: float


@torch.inference_mode()
def greedy_continuations(model: Transformer, prompts: torch.Tensor, length: int, batch: int = GENERATION_BATCH,
                         progress: Callable[[int], None] | None = None) -> DistillSet:
    """Continue each prompt [n, P] greedily to `length` tokens with the served backbone (batched
    engine steps), keeping main_hidden of every position. `progress(k)`: k more samples are done."""
    core = InferenceCore(model)
    tokens, hidden = [], []
    for chunk in prompts.split(batch):
        ids = [row.tolist() for row in chunk]
        seqs = [core.new_sequence(row, length + 1)[0] for row in ids]
        x, pre_mix = core.encode_tokens_batch(seqs, ids)
        logits, states = core.decode_streams_batch(seqs, x, pre_mix, [0] * len(ids), [len(r) for r in ids])
        parts = [[h] for h in states]
        while len(ids[0]) < length:
            for row, lg in zip(ids, logits, strict=True):
                row.append(int(lg[-1].argmax()))
            if len(ids[0]) == length:
                break
            starts = [len(r) - 1 for r in ids]
            x, pre_mix = core.encode_tokens_batch(seqs, [[r[-1]] for r in ids])
            logits, states = core.decode_streams_batch(seqs, x, pre_mix, starts, [1] * len(ids))
            for part, h in zip(parts, states, strict=True):
                part.append(h)
        for seq in seqs:
            core.release(seq)
        tokens.append(torch.tensor(ids))
        hidden += [torch.cat(p + [p[-1][-1:]]) for p in parts]  # the last position is never a ring entry
        if progress is not None:
            progress(len(ids))
    return DistillSet(torch.cat(tokens), torch.stack(hidden))


def distill_prompts(corpus: Corpus, opts: DraftOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """Training prompts at seeded random starts of the training text; held-out prompts evenly
    spaced over the held-out text."""
    gen = torch.Generator().manual_seed(opts.seed + 1)
    train = sample_batch(corpus.train, opts.samples, opts.prompt_len - 1, gen)
    span = corpus.val.numel() - opts.prompt_len
    if span < 0:
        raise ValueError(f"the held-out text has {corpus.val.numel()} tokens, fewer than --prompt-len")
    starts = torch.linspace(0, span, opts.val_samples).long()
    return train, torch.stack([corpus.val[s : s + opts.prompt_len] for s in starts.tolist()])


def backbone_fingerprint(model: Transformer) -> str:
    """sha256 over the backbone's tensors by name (what a drafter checkpoint was trained against)."""
    digest = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def new_drafter(config: ModelConfig, seed: int) -> DSpark:
    """Seeded random stages in trainable form (fp32 masters, router biases at 0)."""
    drafter = to_training(init_random(build_dspark(config), seed))
    for name, p in drafter.named_parameters():
        if name.endswith(("gate.bias", "gate.bias_vl")):
            p.data.zero_()
    return drafter


def served_drafter(masters: DSpark) -> DSpark:
    """The drafter as the exported checkpoint holds it: masters in their storage formats, written
    as the mtp.* tensors and read back by load_dspark."""
    config = masters.config
    stored = build_dspark(config)
    stored.load_state_dict(inference_state(masters, build_dspark(config, "meta")))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "mtp.safetensors"
        save_file(dspark_tensors(stored), str(path))
        return load_dspark(config, [path])


def block_targets(tokens: torch.Tensor, anchors: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets [n, block] = tokens at p+1..p+block, previous [n, block] = tokens at p..p+block-1)."""
    offsets = anchors[:, 1:] + torch.arange(block + 1)
    window = tokens[anchors[:, :1], offsets]
    return window[:, 1:], window[:, :-1]


def accepted_prefix(correct: torch.Tensor) -> torch.Tensor:
    """Drafts accepted per block [n] from per-position correctness [n, k]: the leading run of Trues."""
    return correct.long().cumprod(dim=1).sum(dim=1)


class DraftTrainer:
    """The drafter's training state over a frozen served backbone; drives `loop.run`."""

    def __init__(self, backbone: Transformer, tokenizer: Tokenizer, corpus: Corpus, opts: DraftOptions,
                 out_dir: Path, data: tuple[DistillSet, DistillSet] | None = None,
                 progress: Callable[[int], None] | None = None):
        self.backbone, self.config, self.tokenizer = backbone.eval(), backbone.config, tokenizer
        for p in backbone.parameters():
            p.requires_grad_(False)
        self.opts, self.out = opts, Path(out_dir)
        t = self.config.text_config
        self.block = t.dspark_block_size
        if opts.seq_len < opts.prompt_len + self.block + 1:
            raise ValueError(f"seq_len {opts.seq_len} leaves no block after a {opts.prompt_len}-token prompt")
        self.fingerprint = backbone_fingerprint(backbone)
        self.train_set, self.val_set = data or self._distill_set(corpus, progress)
        self.model = new_drafter(self.config, opts.seed)
        self.drafter = Drafter(backbone, self.model)
        self.balance = RouterBalance(self.model, opts.balance_rate)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            [{"params": [p for p in trained if p.ndim >= 2], "weight_decay": opts.weight_decay},
             {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0}],
            lr=opts.lr, betas=(0.9, 0.95), eps=1e-8)
        self.gen = torch.Generator().manual_seed(opts.seed)
        self.step = 0
        self.metrics: dict = {}

    def _distill_set(self, corpus: Corpus, progress: Callable[[int], None] | None) -> tuple[DistillSet, DistillSet]:
        """The greedy continuations, cached in the output folder (deterministic for the backbone,
        the options and the thread count, so a resumed run reads the same set; a batch's rows are
        each what they would be alone, so the generation batch does not matter)."""
        opts = self.opts
        key = {"backbone": self.fingerprint, "seed": opts.seed, "prompt_len": opts.prompt_len,
               "seq_len": opts.seq_len, "samples": opts.samples, "val_samples": opts.val_samples,
               "val_fraction": opts.val_fraction, "train_tokens": corpus.train.numel(),
               "val_tokens": corpus.val.numel()}
        path = self.out / "distill.pt"
        if path.exists():
            saved = torch.load(path, map_location="cpu", weights_only=True)
            if saved.get("format") == DISTILL_FORMAT and saved["key"] == key:
                return DistillSet(*saved["train"]), DistillSet(*saved["val"])
        train_prompts, val_prompts = distill_prompts(corpus, opts)
        sets = (greedy_continuations(self.backbone, train_prompts, opts.seq_len, progress=progress),
                greedy_continuations(self.backbone, val_prompts, opts.seq_len, progress=progress))
        self.out.mkdir(parents=True, exist_ok=True)
        _atomic_save({"format": DISTILL_FORMAT, "key": key, "train": [sets[0].tokens, sets[0].hidden],
                      "val": [sets[1].tokens, sets[1].hidden]}, path)
        return sets

    def _anchors(self, n_samples: int, per_sample: int, gen: torch.Generator | None) -> torch.Tensor:
        """[n_samples * per_sample, 2] (sample, p) with p a generated position that has a full block after it."""
        low, high = self.opts.prompt_len, self.opts.seq_len - self.block
        if gen is None:  # evenly spaced, for validation
            p = torch.linspace(low, high - 1, per_sample).long().repeat(n_samples)
        else:
            p = torch.randint(low, high, (n_samples * per_sample,), generator=gen)
        return torch.stack([torch.arange(n_samples).repeat_interleave(per_sample), p], dim=1)

    def _losses(self, data: DistillSet, anchors: torch.Tensor):
        targets, previous = block_targets(data.tokens, anchors, self.block)
        draft = self.drafter.teacher_forced(data.hidden, data.tokens, anchors, previous)
        ce = F.cross_entropy(draft.logits.flatten(0, 1), targets.flatten())
        correct = draft.tokens == targets
        bce = F.binary_cross_entropy_with_logits(draft.confidence, correct.float())
        return ce, bce, correct

    def train_step(self) -> DraftStep:
        opts = self.opts
        lr = learning_rate(self.step, opts)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        rows = torch.randint(0, self.train_set.tokens.size(0), (opts.batch,), generator=self.gen)
        data = DistillSet(self.train_set.tokens[rows], self.train_set.hidden[rows])
        ce, bce, correct = self._losses(data, self._anchors(opts.batch, opts.anchors, self.gen))
        (ce + opts.confidence_weight * bce).backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), opts.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.balance.update()
        self.step += 1
        return DraftStep(self.step, ce.item(), bce.item(), correct.float().mean().item(), lr, norm.item())

    @torch.no_grad()
    def validate(self) -> float:
        """Teacher-forced loss on the held-out continuations (returned); `self.metrics` gets the
        training form's per-position agreement and the exported drafter's acceptance."""
        val = self.val_set
        ce, _, correct = self._losses(val, self._anchors(val.tokens.size(0), self.opts.anchors, None))
        self.metrics = {"val_agreement": [round(v, 4) for v in correct.float().mean(0).tolist()],
                        "val_acceptance_length": 1 + accepted_prefix(correct).float().mean().item()}
        self.metrics |= {f"served_{k}": v for k, v in acceptance(self.backbone, served_drafter(self.model), val,
                                                                 self.opts.prompt_len, self.opts.val_anchors).items()}
        return ce.item()

    def save(self) -> Path:
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"dspark-{self.step:06d}.pt"
        _atomic_save({
            "format": DSPARK_FORMAT, "step": self.step, "options": asdict(self.opts),
            "config": config_to_dict(self.config), "backbone": self.fingerprint,
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "sampler_rng": self.gen.get_state(), "torch_rng": torch.get_rng_state(),
        }, path)
        for old in sorted(self.out.glob("dspark-*.pt"))[:-KEEP_CHECKPOINTS]:
            old.unlink()
        return path

    def load(self, path: Path) -> None:
        """Continue from a checkpoint of a run with the same schedule options and backbone."""
        state = load_checkpoint(path)
        saved = DraftOptions(**state["options"]).schedule()
        differing = sorted(k for k, v in self.opts.schedule().items() if saved[k] != v)
        if differing:
            raise ValueError(f"{path} was written with other options: " +
                             ", ".join(f"{k}={saved[k]!r}" for k in differing))
        if config_from_dict(state["config"]) != self.config or state["backbone"] != self.fingerprint:
            raise ValueError(f"{path} was trained against another backbone")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.gen.set_state(state["sampler_rng"])
        torch.set_rng_state(state["torch_rng"])
        self.step = state["step"]


def load_checkpoint(path: str | Path) -> dict:
    return read_checkpoint(path, DSPARK_FORMAT, "DSpark training")


def _atomic_save(state: dict, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


@torch.inference_mode()
def acceptance(backbone: Transformer, drafter: DSpark, data: DistillSet, prompt_len: int,
               per_sample: int) -> dict:
    """The inference drafter on greedy continuations: at `per_sample` evenly spaced generated
    positions p of each sample, observe positions < p, draft a block after the token at p and
    compare with the backbone's tokens at p+1... Returns the acceptance length at the full block
    (accepted drafts + the bonus token), the conditional acceptance by draft position (draft i
    accepted given drafts < i were), and the confidence head's mean prediction for the same."""
    d = Drafter(backbone, drafter)
    n, length = data.tokens.shape
    positions = torch.linspace(prompt_len, length - d.block - 1, per_sample).long().tolist()
    accepted, correct, predicted = [], [], []
    for i in range(n):
        state = new_state(backbone.config)
        for p in positions:
            d.observe(state, data.hidden[i, state.length : p])
            draft = d.draft([state], [int(data.tokens[i, p])])
            hits = draft.tokens[0] == data.tokens[i, p + 1 : p + 1 + d.block]
            accepted.append(int(accepted_prefix(hits.unsqueeze(0))))
            correct.append(hits)
            predicted.append(torch.sigmoid(draft.confidence[0]))
    correct, predicted = torch.stack(correct).float(), torch.stack(predicted)
    reached = torch.cat([torch.ones(len(correct), 1), correct.cumprod(1)[:, :-1]], dim=1)  # prefix accepted
    conditional = ((correct * reached).sum(0) / reached.sum(0).clamp(min=1)).tolist()
    confidence = ((predicted * reached).sum(0) / reached.sum(0).clamp(min=1)).tolist()
    return {"acceptance_length": 1 + sum(accepted) / len(accepted),
            "acceptance_by_position": [round(v, 4) for v in conditional],
            "confidence_by_position": [round(v, 4) for v in confidence]}


def write_drafter(drafter: DSpark, model_dir: str | Path) -> dict:
    """Write the drafter's mtp.* tensors (stored formats) into the single weights file of a model
    directory in place: every other tensor is copied byte for byte (checked after the write), an
    earlier drafter is replaced. Returns the file's size and the counts of tensors."""
    path = Path(model_dir) / "model.safetensors"
    if not path.is_file():
        raise ValueError(f"{model_dir} has no single model.safetensors to write the drafter into")
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
        backbone = {name: handle.get_tensor(name) for name in list(handle.keys()) if not name.startswith("mtp.")}
    stored = build_dspark(drafter.config)
    stored.load_state_dict(inference_state(drafter, build_dspark(drafter.config, "meta")))
    mtp = dspark_tensors(stored)
    tmp = path.with_suffix(".tmp")
    save_file(backbone | mtp, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    with safe_open(str(path), "pt") as handle:
        changed = [name for name, t in backbone.items() if not _same_bytes(handle.get_tensor(name), t)]
    if changed:
        raise RuntimeError(f"backbone tensors changed while writing the drafter: {', '.join(changed)}")
    return {"bytes": path.stat().st_size, "backbone_tensors": len(backbone), "mtp_tensors": len(mtp)}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


def drafter_from_checkpoint(path: str | Path) -> DSpark:
    """The fp32 masters of a `dsv41 train --dspark` checkpoint (for write_drafter)."""
    state = load_checkpoint(path)
    drafter = new_drafter(config_from_dict(state["config"]), 0)
    drafter.load_state_dict(state["model"])
    return drafter.eval()
