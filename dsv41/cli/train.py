"""`dsv41 train`: train a model from a config and a corpus on the CPU."""

from __future__ import annotations

from pathlib import Path

import click

from dsv41.config import BUILTIN_CONFIGS, ConfigError, load_config

CONFIG_HELP = f"Built-in config name ({', '.join(BUILTIN_CONFIGS)}) or path to a config.json."


@click.command(context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option("--config", "config_name", required=True, help=CONFIG_HELP)
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
def train(config_name: str, corpora: tuple[Path, ...], steps: int, seq_len: int, batch: int, out_dir: Path,
          lr: float, min_lr_ratio: float, warmup: int | None, weight_decay: float, clip: float,
          dense_steps: int | None, kl_weight: float, balance_rate: float, seed: int, val_fraction: float,
          eval_every: int, eval_batches: int, save_every: int, time_limit: float | None, threads: int,
          resume: Path | None, tokenizer_path: Path | None) -> None:
    """Train a model of CONFIG on the text of --corpus files, on the CPU.

    The network is dsv41's own (dsv41/model), in training mode: every weight is an fp32 master
    used directly by forward, while the SWA, main-KV and index Q/K roundings stay in the forward
    with straight-through gradients. AdamW, linear warm-up then cosine decay, gradient clipping.
    Routers are balanced by their selection bias (no auxiliary loss). The indexer learns from a KL
    term toward the main attention: first --dense-steps steps attend every visible entry, then
    the real Top-k. docs/training.md has the details.

    Checkpoints hold the float masters, optimizer state, step and RNG states; --resume continues
    bit for bit. Runs are deterministic for a --seed and thread count.

    \b
    Example:
      dsv41 train --config small --corpus shakespeare.txt --corpus lib.txt \\
          --tokenizer tokenizer.json --steps 2000 --seq-len 512 --batch 8 --out runs/small
    """
    import torch
    from tokenizers import Tokenizer
    from tqdm import tqdm

    from dsv41.model.tokenizer import byte_tokenizer
    from dsv41.training.data import load_corpus
    from dsv41.training.loop import Trainer, TrainOptions, jsonl_logger, run

    torch.set_num_threads(threads)
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
