"""`dsv41 train`: train a model from a config and a corpus on the CPU."""

from __future__ import annotations

from pathlib import Path

import click

from dsv41.config import BUILTIN_CONFIGS, ConfigError, load_config

CONFIG_HELP = f"Built-in config name ({', '.join(BUILTIN_CONFIGS)}) or path to a config.json."


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--config", "config_name", help=CONFIG_HELP + " Required unless --dspark trains on --model.")
@click.option("--corpus", "corpora", required=True, multiple=True,
              type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="UTF-8 text file; repeat the option for several.")
@click.option("--steps", required=True, type=click.IntRange(1), help="Optimizer steps (the schedule's length).")
@click.option("--seq-len", required=True, type=click.IntRange(2), help="Tokens per training window.")
@click.option("--batch", required=True, type=click.IntRange(1), help="Windows per step.")
@click.option("--out", "out_dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Folder for checkpoints (ckpt-STEP.pt, the latest 3 kept) and train_log.jsonl.")
@click.option("--lr", default=3e-3, type=click.FloatRange(0, min_open=True), help="Peak learning rate.")
@click.option("--min-lr-ratio", default=0.1, type=click.FloatRange(0, 1), help="Final lr as a fraction of --lr.")
@click.option("--warmup", default=None, type=click.IntRange(0), help="Linear warm-up steps [default: 5% of steps].")
@click.option("--weight-decay", default=0.1, type=click.FloatRange(0), help="AdamW decay of matrices.")
@click.option("--clip", default=1.0, type=click.FloatRange(0, min_open=True), help="Max gradient norm.")
@click.option("--dense-steps", default=None, type=click.IntRange(0),
              help="Indexer warm-up steps attending every visible entry [default: 20% of steps].")
@click.option("--kl-weight", default=1.0, type=click.FloatRange(0), help="Weight of the indexer KL term.")
@click.option("--balance-rate", default=1e-3, type=click.FloatRange(0), help="Router bias step per training step.")
@click.option("--seed", default=0, help="Seed of the initial weights and of batch sampling.")
@click.option("--val-fraction", default=0.02, type=click.FloatRange(0, 1, min_open=True, max_open=True),
              help="Tail of each corpus file held out for validation.")
@click.option("--eval-every", default=0, type=click.IntRange(0), help="Validate every N steps (0: at the end).")
@click.option("--eval-batches", default=4, type=click.IntRange(1), help="Held-out batches per validation.")
@click.option("--save-every", default=0, type=click.IntRange(0), help="Checkpoint every N steps (0: at the end).")
@click.option("--time-limit", default=None, type=click.FloatRange(0, min_open=True),
              help="Stop (validate and save) after this many seconds of training.")
@click.option("--threads", default=1, type=click.IntRange(1),
              help="Torch CPU threads (small GEMMs gain little from more; a resumed run needs the same count "
                   "to continue bit for bit).")
@click.option("--resume", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="Continue from a checkpoint written with the same options.")
@click.option("--tokenizer", "tokenizer_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="tokenizer.json [default: the byte-level tokenizer of the config's vocabulary].")
@click.option("--dspark", is_flag=True,
              help="Train the DSpark drafter (mtp.* stages) of a frozen backbone instead of a model: --seq-len is "
                   "the length of each greedy continuation sample, --batch the samples per step.")
@click.option("--model", "model_name",
              help="With --dspark: the backbone, a model directory or a built-in model name [default: small; "
                   "with --config, random weights of that config seeded by --seed].")
@click.option("--prompt-len", default=64, type=click.IntRange(1),
              help="With --dspark: corpus tokens before each greedy continuation.")
@click.option("--samples", default=128, type=click.IntRange(1),
              help="With --dspark: greedy continuations of training prompts (the distillation set).")
@click.option("--val-samples", default=16, type=click.IntRange(1),
              help="With --dspark: greedy continuations of held-out prompts.")
@click.option("--anchors", default=16, type=click.IntRange(1),
              help="With --dspark: blocks drafted per sample per step.")
@click.option("--confidence-weight", default=1.0, type=click.FloatRange(0),
              help="With --dspark: weight of the confidence head's binary cross-entropy.")
@click.option("--write-drafter", "write_into", type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="With --dspark: after training, write the drafter's mtp.* tensors into this model directory's "
                   "model.safetensors (every backbone tensor is kept byte for byte).")
def train(config_name: str | None, corpora: tuple[Path, ...], steps: int, seq_len: int, batch: int, out_dir: Path,
          lr: float, min_lr_ratio: float, warmup: int | None, weight_decay: float, clip: float,
          dense_steps: int | None, kl_weight: float, balance_rate: float, seed: int, val_fraction: float,
          eval_every: int, eval_batches: int, save_every: int, time_limit: float | None, threads: int,
          resume: Path | None, tokenizer_path: Path | None, dspark: bool, model_name: str | None,
          prompt_len: int, samples: int, val_samples: int, anchors: int, confidence_weight: float,
          write_into: Path | None) -> None:
    """Train a model of CONFIG on the text of --corpus files, on the CPU.

    The network is dsv41's own (dsv41/model), in training mode: every weight is an fp32 master
    used directly by forward, while the SWA, main-KV and index Q/K roundings stay in the forward
    with straight-through gradients. AdamW, linear warm-up then cosine decay, gradient clipping.
    Routers are balanced by their selection bias (no auxiliary loss). The indexer learns from a KL
    term toward the main attention: first --dense-steps steps attend every visible entry, then
    the real Top-k. docs/training.md has the details.

    Checkpoints hold the float masters, optimizer state, step and RNG states; --resume continues
    bit for bit. Runs are deterministic for a --seed and thread count.

    With --dspark the backbone (--model) is frozen and only its DSpark drafter is trained, by
    distillation from the backbone's greedy continuations of corpus prompts; docs/dspark.md.

    \b
    Examples:
      dsv41 train --config small --corpus shakespeare.txt --corpus lib.txt \\
          --tokenizer tokenizer.json --steps 2000 --seq-len 512 --batch 8 --out runs/small
      dsv41 train --dspark --model small --corpus shakespeare.txt --corpus lib.txt \\
          --steps 900 --seq-len 192 --batch 8 --out runs/dspark --write-drafter dsv41/models/small
    """
    import torch

    torch.set_num_threads(threads)
    if dspark:
        from dsv41.training.dspark import DraftOptions

        opts = DraftOptions(
            steps=steps, seq_len=seq_len, batch=batch, lr=lr, min_lr_ratio=min_lr_ratio,
            warmup=round(0.05 * steps) if warmup is None else warmup, weight_decay=weight_decay, clip=clip,
            balance_rate=balance_rate, seed=seed, val_fraction=val_fraction, eval_every=eval_every,
            eval_batches=eval_batches, save_every=save_every, prompt_len=prompt_len, samples=samples,
            val_samples=val_samples, anchors=anchors, confidence_weight=confidence_weight)
        _train_dspark(config_name, model_name, tokenizer_path, corpora, opts, out_dir, resume, time_limit, write_into)
        return
    if config_name is None:
        raise click.UsageError("--config is required (or --dspark with --model)")
    from tokenizers import Tokenizer
    from tqdm import tqdm

    from dsv41.model.tokenizer import byte_tokenizer
    from dsv41.training.data import load_corpus
    from dsv41.training.loop import Trainer, TrainOptions, jsonl_logger, run

    try:
        config = load_config(config_name)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    t = config.text_config
    if seq_len > t.max_position_embeddings:
        raise click.BadParameter(f"exceeds the config's {t.max_position_embeddings} positions", param_hint="--seq-len")
    tokenizer = Tokenizer.from_file(str(tokenizer_path)) if tokenizer_path else byte_tokenizer(t.vocab_size)
    if tokenizer.get_vocab_size(with_added_tokens=True) > t.vocab_size:
        raise click.ClickException(f"the tokenizer has more ids than the config's vocab_size {t.vocab_size}")
    opts = TrainOptions(
        steps=steps, seq_len=seq_len, batch=batch, lr=lr, min_lr_ratio=min_lr_ratio,
        warmup=round(0.05 * steps) if warmup is None else warmup, weight_decay=weight_decay, clip=clip,
        dense_steps=round(0.2 * steps) if dense_steps is None else dense_steps, kl_weight=kl_weight,
        balance_rate=balance_rate, seed=seed, val_fraction=val_fraction, eval_every=eval_every,
        eval_batches=eval_batches, save_every=save_every)
    click.echo(f"tokenizing {len(corpora)} file(s)...", err=True)
    try:
        corpus = load_corpus(list(corpora), tokenizer, val_fraction)
        trainer = Trainer(config, tokenizer, corpus, opts, out_dir)
        if resume is not None:
            trainer.load(resume)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    n_params = sum(p.numel() for p in trainer.model.parameters())
    click.echo(f"{config_name}: {n_params:,} parameters; {corpus.train.numel():,} training and "
               f"{corpus.val.numel():,} held-out tokens; {steps} steps of {batch} x {seq_len} tokens "
               f"(dense indexer warm-up: {opts.dense_steps} steps)", err=True)
    log = jsonl_logger(out_dir / "train_log.jsonl")

    def log_and_echo(record: dict) -> None:
        log(record)
        if record["kind"] != "step":
            bar.write(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))

    with tqdm(total=steps, initial=trainer.step, unit="step", dynamic_ncols=True) as bar:
        def progress(result, rate: float) -> None:
            bar.set_postfix(loss=f"{result.loss:.3f}", kl=f"{result.index_kl:.3f}", tok_s=f"{rate:.0f}",
                            phase="dense" if result.dense else "sparse", refresh=False)
            bar.update(1)

        run(trainer, log_and_echo, time_limit, progress)


def _backbone(config_name: str | None, model_name: str | None, tokenizer_path: Path | None, seed: int):
    """The frozen backbone and its tokenizer: a model directory (or built-in name), or seeded
    random weights of a config."""
    from tokenizers import Tokenizer

    from dsv41.checkpoint import CheckpointError, load_model, open_model_dir, resolve_model_dir
    from dsv41.model.reference import random_model
    from dsv41.model.tokenizer import byte_tokenizer

    if config_name is not None and model_name is not None:
        raise click.UsageError("--config and --model exclude each other")
    if config_name is not None:
        try:
            config = load_config(config_name)
        except ConfigError as exc:
            raise click.ClickException(str(exc)) from None
        tokenizer = (Tokenizer.from_file(str(tokenizer_path)) if tokenizer_path
                     else byte_tokenizer(config.text_config.vocab_size))
        return random_model(config, seed, tokenizer), tokenizer
    try:
        model_dir = open_model_dir(resolve_model_dir(model_name or "small"))
        model, _ = load_model(model_dir)
    except (CheckpointError, ConfigError, FileNotFoundError) as exc:
        raise click.ClickException(str(exc)) from None
    path = tokenizer_path or model_dir.tokenizer_path
    if path is None:
        raise click.ClickException(f"{model_dir.path} has no tokenizer.json; pass --tokenizer")
    return model, Tokenizer.from_file(str(path))


def _train_dspark(config_name, model_name, tokenizer_path, corpora, opts, out_dir: Path, resume: Path | None,
                  time_limit: float | None, write_into: Path | None) -> None:
    from tqdm import tqdm

    from dsv41.training.data import load_corpus
    from dsv41.training.dspark import DraftTrainer, write_drafter
    from dsv41.training.loop import jsonl_logger, run

    backbone, tokenizer = _backbone(config_name, model_name, tokenizer_path, opts.seed)
    t = backbone.config.text_config
    if not (t.num_nextn_predict_layers and t.dspark_block_size):
        raise click.ClickException("the backbone's config has no DSpark stages (num_nextn_predict_layers)")
    if opts.seq_len > t.max_position_embeddings:
        raise click.BadParameter(f"exceeds the config's {t.max_position_embeddings} positions", param_hint="--seq-len")
    click.echo(f"tokenizing {len(corpora)} file(s)...", err=True)
    try:
        corpus = load_corpus(list(corpora), tokenizer, opts.val_fraction)
        click.echo(f"greedy continuations: {opts.samples} training and {opts.val_samples} held-out samples of "
                   f"{opts.seq_len} tokens (cached in {out_dir / 'distill.pt'})...", err=True)
        with tqdm(total=opts.samples + opts.val_samples, unit="sample", desc="continuations",
                  dynamic_ncols=True) as generated:
            trainer = DraftTrainer(backbone, tokenizer, corpus, opts, out_dir, progress=generated.update)
        if resume is not None:
            trainer.load(resume)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    n_params = sum(p.numel() for p in trainer.model.parameters())
    click.echo(f"DSpark drafter: {n_params:,} parameters, backbone frozen; {opts.steps} steps of {opts.batch} "
               f"samples x {opts.anchors} blocks of {trainer.block}", err=True)
    log = jsonl_logger(out_dir / "train_log.jsonl")

    def log_and_echo(record: dict) -> None:
        if record["kind"] == "validation":
            record = {**record, **trainer.metrics}
        log(record)
        if record["kind"] != "step":
            bar.write(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()))

    with tqdm(total=opts.steps, initial=trainer.step, unit="step", dynamic_ncols=True) as bar:
        def progress(result, rate: float) -> None:
            bar.set_postfix(loss=f"{result.loss:.3f}", conf=f"{result.confidence_loss:.3f}",
                            agree=f"{result.agreement:.3f}", refresh=False)
            bar.update(1)

        run(trainer, log_and_echo, time_limit, progress)
    if write_into is not None:
        try:
            written = write_drafter(trainer.model, write_into)
        except ValueError as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(f"wrote {written['mtp_tensors']} mtp.* tensors into {write_into}/model.safetensors "
                   f"({written['bytes'] / 1e6:.1f} MB; {written['backbone_tensors']} backbone tensors unchanged)",
                   err=True)
