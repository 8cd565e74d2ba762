"""The training loop: AdamW on fp32 masters, warm-up + cosine schedule, clipping, router balancing,
the indexer's dense warm-up then sparse phase, validation, checkpoints and exact resume."""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from dsv41.config import ModelConfig, config_from_dict, config_to_dict
from dsv41.model.engram import token_map_from_tokenizer
from dsv41.model.moe import Gate
from dsv41.model.random_init import init_random
from dsv41.model.transformer import Transformer, build_model
from dsv41.training.data import Corpus, sample_batch, validation_batches
from dsv41.training.indexer_loss import indexer_kl
from dsv41.training.master import to_training

CHECKPOINT_FORMAT = "dsv41-train-1"
KEEP_CHECKPOINTS = 3


@dataclass(frozen=True)
class TrainOptions:
    steps: int
    seq_len: int
    batch: int
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # the cosine ends at lr * min_lr_ratio
    warmup: int = 0  # linear warm-up steps
    weight_decay: float = 0.1
    clip: float = 1.0  # max global gradient norm
    dense_steps: int = 0  # indexer warm-up: steps that attend every visible entry
    kl_weight: float = 1.0
    balance_rate: float = 1e-3  # router bias step (aux-loss-free balancing)
    seed: int = 0
    val_fraction: float = 0.02
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 4
    save_every: int = 0  # 0: only at the end

    def schedule(self) -> dict:
        """The fields a resumed run must share with the run it continues."""
        fixed = ("eval_every", "eval_batches", "save_every")
        return {k: v for k, v in asdict(self).items() if k not in fixed}


def learning_rate(step: int, opts: TrainOptions) -> float:
    """Linear warm-up to lr over `warmup` steps, then cosine down to lr * min_lr_ratio at `steps`."""
    if step < opts.warmup:
        return opts.lr * (step + 1) / opts.warmup
    progress = (step - opts.warmup) / max(1, opts.steps - opts.warmup)
    floor = opts.lr * opts.min_lr_ratio
    return floor + (opts.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


class RouterBalance:
    """Aux-loss-free load balancing (DeepSeek-V3): the selection-only bias of each router moves by
    rate * sign(mean load - load) after every step, so overloaded experts are picked less."""

    def __init__(self, model: Transformer, rate: float):
        self.rate = rate
        self.gates = [m for m in model.modules() if isinstance(m, Gate)]
        self.loads = {id(g): torch.zeros(g.bias.numel()) for g in self.gates}
        for gate in self.gates:
            gate.register_forward_hook(self._record)

    def _record(self, gate: Gate, inputs, output) -> None:
        if torch.is_grad_enabled():  # training steps only, not validation
            self.loads[id(gate)] += torch.bincount(output[1].flatten(), minlength=gate.bias.numel())

    @torch.no_grad()
    def update(self) -> None:
        for gate in self.gates:
            load = self.loads[id(gate)]
            gate.bias += self.rate * torch.sign(load.mean() - load)
            load.zero_()


def new_model(config: ModelConfig, tokenizer: Tokenizer, seed: int) -> Transformer:
    """Seeded random weights in trainable form, router biases at 0."""
    token_map, _ = token_map_from_tokenizer(tokenizer)
    model = to_training(init_random(build_model(config, token_map), seed))
    for gate in model.modules():
        if isinstance(gate, Gate):
            gate.bias.data.zero_()
    return model


@dataclass
class StepResult:
    step: int  # 1-based number of the step just taken
    loss: float  # LM loss, nats/token
    index_kl: float
    lr: float
    grad_norm: float
    dense: bool


def read_checkpoint(path: str | Path, fmt: str, what: str) -> dict:
    """A checkpoint's state dict (tensors and plain values only: nothing is unpickled), refused
    with a clear error when it is not a torch file or not of format `fmt`."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # not a torch file, or one holding more than tensors and plain values
        raise ValueError(f"{path} is not a {what} checkpoint: {exc}") from None
    if not isinstance(state, dict) or state.get("format") != fmt:
        raise ValueError(f"{path} is not a {what} checkpoint (format {fmt})")
    return state


class Trainer:
    def __init__(self, config: ModelConfig, tokenizer: Tokenizer, corpus: Corpus, opts: TrainOptions,
                 out_dir: Path):
        self.config, self.tokenizer, self.corpus, self.opts, self.out = config, tokenizer, corpus, opts, Path(out_dir)
        self.model = new_model(config, tokenizer, opts.seed)
        self.balance = RouterBalance(self.model, opts.balance_rate)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        decayed = [p for p in trained if p.ndim >= 2]
        self.optimizer = torch.optim.AdamW(
            [{"params": decayed, "weight_decay": opts.weight_decay},
             {"params": [p for p in trained if p.ndim < 2], "weight_decay": 0.0}],
            lr=opts.lr, betas=(0.9, 0.95), eps=1e-8)
        self.gen = torch.Generator().manual_seed(opts.seed)
        self.step = 0
        self.val = validation_batches(corpus.val, opts.batch, opts.seq_len, opts.eval_batches)

    def dense(self) -> bool:
        return self.step < self.opts.dense_steps

    def train_step(self) -> StepResult:
        opts = self.opts
        lr = learning_rate(self.step, opts)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batch = sample_batch(self.corpus.train, opts.batch, opts.seq_len, self.gen)
        dense, targets = self.dense(), []
        out = self.model(batch[:, :-1], dense_index=dense, index_targets=targets)
        lm = F.cross_entropy(out.logits.flatten(0, 1), batch[:, 1:].flatten())
        kl = torch.stack([indexer_kl(*t) for t in targets]).mean() if targets else lm.new_zeros(())
        (lm + opts.kl_weight * kl).backward()
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), opts.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.balance.update()
        self.step += 1
        return StepResult(self.step, lm.item(), kl.item(), lr, norm.item(), dense)

    @torch.no_grad()
    def validate(self) -> float:
        """Mean LM loss (nats/token) over the held-out batches, in the current indexer phase."""
        total, count = 0.0, 0
        for batch in self.val:
            logits = self.model(batch[:, :-1], dense_index=self.dense()).logits
            total += F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
            count += batch[:, 1:].numel()
        return total / count

    def save(self) -> Path:
        """Masters, optimizer state, step, sampler RNG, config and tokenizer; written atomically."""
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"ckpt-{self.step:06d}.pt"
        state = {
            "format": CHECKPOINT_FORMAT, "step": self.step, "options": asdict(self.opts),
            "config": config_to_dict(self.config), "tokenizer": self.tokenizer.to_str(),
            "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
            "sampler_rng": self.gen.get_state(), "torch_rng": torch.get_rng_state(),
        }
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        for old in sorted(self.out.glob("ckpt-*.pt"))[:-KEEP_CHECKPOINTS]:
            old.unlink()
        return path

    def load(self, path: Path) -> None:
        """Continue from a checkpoint of a run with the same schedule options."""
        state = read_checkpoint(path, CHECKPOINT_FORMAT, "dsv41 training")
        saved = TrainOptions(**state["options"]).schedule()
        differing = sorted(k for k, v in self.opts.schedule().items() if saved[k] != v)
        if differing:
            raise ValueError(f"{path} was written with other options: " +
                             ", ".join(f"{k}={saved[k]!r}" for k in differing))
        if config_from_dict(state["config"]) != self.config:
            raise ValueError(f"{path} holds a model of another config")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.gen.set_state(state["sampler_rng"])
        torch.set_rng_state(state["torch_rng"])
        self.step = state["step"]


def run(trainer: Trainer, log: Callable[[dict], None], time_limit: float | None = None,
        progress: Callable[[StepResult, float], None] | None = None) -> list[StepResult]:
    """Train to opts.steps (or until time_limit seconds have passed), validating and saving on
    schedule and at the end. `log` receives one JSON-able record per step and per validation;
    `progress` the step and its tokens/s."""
    opts, results, began = trainer.opts, [], time.monotonic()
    while trainer.step < opts.steps:
        t0 = time.perf_counter()
        result = trainer.train_step()
        rate = opts.batch * opts.seq_len / (time.perf_counter() - t0)
        results.append(result)
        log({"kind": "step", **asdict(result), "tokens_per_s": rate})
        if progress is not None:
            progress(result, rate)
        stopping = time_limit is not None and time.monotonic() - began > time_limit
        last = trainer.step == opts.steps or stopping
        if (opts.eval_every and trainer.step % opts.eval_every == 0) or last:
            log({"kind": "validation", "step": trainer.step, "val_loss": trainer.validate()})
        if (opts.save_every and trainer.step % opts.save_every == 0) or last:
            log({"kind": "checkpoint", "step": trainer.step, "path": str(trainer.save())})
        if stopping:
            break
    return results


def jsonl_logger(path: Path) -> Callable[[dict], None]:
    """Appends each record as one JSON line (a resumed run continues the same file)."""
    path.parent.mkdir(parents=True, exist_ok=True)

    def write(record: dict) -> None:
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    return write
