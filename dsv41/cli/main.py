"""`dsv41`: the command line front door."""

from __future__ import annotations

import time
from pathlib import Path

import click

from dsv41.cli.kv import kv
from dsv41.cli.model import convert, generator, model_config, model_option
from dsv41.cli.pipeline import COMMANDS, TEMPERATURE, TOP_P, checked_text
from dsv41.cli.train import train
from dsv41.config import BUILTIN_CONFIGS, ConfigError, ModelConfig

CONFIG_HELP = f"Built-in config name ({', '.join(BUILTIN_CONFIGS)}) or path to a config.json."
MODEL_HELP = "A model directory (config.json, weights, optional tokenizer.json), instead of --config."


def _load(name: str) -> ModelConfig:
    from dsv41.checkpoint import load_named_config  # (torch: imported only by commands that load a config)

    try:
        return load_named_config(name)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def cli() -> None:
    """dsv41: inference runtime for DeepSeek-V4.1-Flash-architecture models.

    A pipeline (a YAML file, or a built-in one: local, inproc, epd) says which model runs and
    where each of its six components runs. Every command takes -h/--help.

    \b
    Examples:
      dsv41 run --prompt "Hello"                    start local, complete one prompt, stop
      dsv41 run inproc --file prompt.txt --json     the same in one process, as JSON
      dsv41 serve local                             the OpenAI API on http://127.0.0.1:8000
      dsv41 status local                            ping every component of it
      dsv41 pipeline show local > my.yaml           start your own pipeline from a built-in one
      dsv41 pipeline validate my.yaml               check it without starting anything
      dsv41 keys ~/.config/dsv41/keys               CURVE keys for tcp endpoints
      dsv41 info --config official                  parameters and KV bytes of the full model
    """


@cli.command()
@click.option("--config", "config_name", help=f"{CONFIG_HELP}  [default: mini]")
@model_option(MODEL_HELP)
def info(config_name: str | None, model_path: Path | None) -> None:
    """Show the layer plan, parameter counts by part and global KV bytes per token.

    The model is built on the meta device, so even the official 750B-parameter config is
    inspected without allocating weights.
    """
    from dsv41.cli.report import info_report

    click.echo(info_report(model_config(config_name, model_path, _load, "mini")))


@cli.command("kv-budget")
@click.option("--config", "config_name", help=f"{CONFIG_HELP}  [default: mini]")
@model_option(MODEL_HELP)
@click.option("--context", "contexts", multiple=True, type=click.IntRange(1),
              default=(4096, 32768, 131072, 1_000_000, 1_048_576), show_default=True,
              help="Context length(s) in tokens to total; repeat the option for several.")
def kv_budget(config_name: str | None, model_path: Path | None, contexts: tuple[int, ...]) -> None:
    """KV-cache bytes per token by group and part, and per-sequence totals by context length.

    Global KV (main + indexer, in the packed formats) grows with the context; SWA is bounded by
    the window. The V4-Flash figure from the technical report is printed beside it.
    """
    from dsv41.cli.report import kv_budget_report

    click.echo(kv_budget_report(model_config(config_name, model_path, _load, "mini"), list(contexts)))


@cli.command()
@click.option("--config", "config_name", help=f"{CONFIG_HELP}  [default: official]")
@model_option(MODEL_HELP)
@click.option("--context", "contexts", default="4096,1048576", show_default=True,
              help="Comma-separated context lengths.")
def flops(config_name: str | None, model_path: Path | None, contexts: str) -> None:
    """Precision-weighted FLOPs of one decode token (BF16 1, FP8 0.5, FP4 0.25) by part.

    The last column compares each context with the first, next to the technical report's
    "about +1/4 from 4K to 1M".
    """
    from dsv41.engine.flops import decode_token_flops

    try:
        lengths = [int(c) for c in contexts.split(",")]
    except ValueError:
        raise click.BadParameter(f"{contexts!r} is not a comma-separated list of integers",
                                 param_hint="--context") from None
    if any(n < 1 for n in lengths):
        raise click.BadParameter("context lengths must be at least 1", param_hint="--context")
    config = model_config(config_name, model_path, _load, "official")
    rows = [decode_token_flops(config, n) for n in lengths]
    parts = list(dict.fromkeys(p for r in rows for p in r.parts))
    click.echo(f"{'part (GFLOP, weighted)':<34}" + "".join(f"{r.context:>14,}" for r in rows))
    for part in parts:
        click.echo(f"{part:<34}" + "".join(f"{r.parts.get(part, 0) / 1e9:>14.3f}" for r in rows))
    click.echo(f"{'total':<34}" + "".join(f"{r.total / 1e9:>14.3f}" for r in rows))
    base = rows[0].total
    click.echo(f"{'vs first context':<34}" + "".join(f"{r.total / base - 1:>+14.1%}" for r in rows))
    click.echo('technical report: "about +1/4" from 4K to 1M context')


@cli.command()
@click.argument("prompt")
@click.option("--config", "config_name", help=f"{CONFIG_HELP}  [default: mini]")
@model_option(f"{MODEL_HELP} Its weights, tokenizer and EOS ids (generation_config.json) are used.")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(1, 4096),
              help="Tokens to generate.")
@click.option("--temperature", default=0.0, show_default=True, type=TEMPERATURE,
              help="0 means greedy decoding.")
@click.option("--top-p", default=1.0, show_default=True, type=TOP_P,
              help="Nucleus sampling mass.")
@click.option("--seed", default=0, show_default=True, help="Seed of the random weights and of sampling.")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="An image file for a model with a vision tower (repeat for several). Each fills one image "
                   "placeholder token of PROMPT, in order; a PROMPT without placeholders gets them in front.")
def generate(prompt: str, config_name: str | None, model_path: Path | None, max_new_tokens: int, temperature: float,
             top_p: float, seed: int, images: tuple[str, ...]) -> None:
    """Generate a continuation of PROMPT in-process with the reference model.

    With --config the weights are seeded random values, so the output is not meaningful language:
    this exercises the full forward end to end and reports its speed. With --model the directory's
    weights and tokenizer are loaded.
    """
    from dsv41.model.reference import Sampling
    from dsv41.model.reference import generate as run
    from dsv41.model.tokenizer import decode, encode

    checked_text(prompt, "PROMPT")
    source = generator(config_name, model_path, seed, _load)
    config, tok = source.config, source.tokenizer
    ids = encode(tok, prompt)
    expanded = None
    if images:
        from dsv41.model.image_processor import ImageError, expand_prompt, load_images

        if config.vision_config.num_hidden_layers == 0:
            raise click.ClickException("this model has no vision tower (vision_config.num_hidden_layers is 0)")
        if config.image_token_id not in ids:
            ids = [config.image_token_id] * len(images) + ids
        try:
            expanded = expand_prompt(ids, load_images(list(images), config.vision_config), config.image_token_id)
        except ImageError as e:
            raise click.ClickException(str(e)) from None
        ids = expanded.ids
    limit = config.text_config.max_position_embeddings
    if len(ids) + max_new_tokens > limit:
        raise click.ClickException(f"prompt ({len(ids)} tokens) + --max-new-tokens ({max_new_tokens}) exceeds the "
                                   f"context limit of {limit} tokens")
    click.echo(f"{source.what}...", err=True)
    model = source.build()
    sampling = Sampling(temperature=temperature, top_p=top_p, seed=seed)
    start, out = time.perf_counter(), []
    spans = None
    if expanded is not None:
        from dsv41.model.vision import encode_images

        spans = encode_images(model, expanded)
    for token in run(model, ids, max_new_tokens, sampling, stop_ids=source.stop_ids, spans=spans):
        out.append(token)
        click.echo(f"\r{len(out)}/{max_new_tokens} tokens", nl=False, err=True)
    elapsed = time.perf_counter() - start
    click.echo("", err=True)
    click.echo(prompt + decode(tok, out))
    click.echo(f"{len(out)} tokens in {elapsed:.2f} s: {len(out) / elapsed:.2f} tokens/s "
               f"(reference path: every step re-runs all {len(ids) + len(out)} positions)", err=True)


@cli.command()
@click.argument("folders", nargs=-1, type=click.Path(exists=True, file_okay=False))
@click.option("--decode-mode", type=click.Choice(["official", "design"]), default="official", show_default=True,
              help="official: reproduce the official decode path's shared index-key slot (bit-exact parity); "
                   "design: each group's own keys at every step (dsv41's default behaviour).")
@click.option("--packed", is_flag=True, help="Keep the caches in their packed byte formats and decode through the "
              "packed-cache kernels (Triton on CUDA, their torch twins elsewhere).")
@click.option("--details", is_flag=True, help="List every compared tensor, not only the group summary.")
def parity(folders: tuple[str, ...], decode_mode: str, packed: bool, details: bool) -> None:
    """Compare dsv41 against recorded official outputs in each FOLDER.

    FOLDER holds an official-format checkpoint (config.json, weights.safetensors, tokenizer) and the
    official implementation's recorded outputs (io.safetensors, units.safetensors). Integer, bool
    and quantized tensors must be exact; other floats pass within 2^-6 of the tensor's largest
    magnitude (fp32 summation order differs between CPUs; docs/parity.md). Bit-exact counts are
    reported as information. A choice that flips (argmax, expert) is named with the gap that
    decided it. Exits non-zero when any tensor fails.

    A FOLDER recorded on the vision path (index.json with image plans, as reference/golden_vision)
    is compared from the resize planner through the ViT, the aligner and the image spans to prefill,
    decode and DSpark (docs/vision.md). Without FOLDER: ../shared/reference/golden, and
    ../shared/reference/golden_vision when it exists.
    """
    from dsv41 import parity_vision
    from dsv41.parity import not_compared, report, run_parity

    if not folders:
        default = Path("../shared/reference")
        folders = tuple(str(default / name) for name in ("golden", "golden_vision") if (default / name).is_dir())
    caches = "packed" if packed else "bf16"
    rows = []
    for folder in folders:
        vision = parity_vision.is_vision_golden(folder)
        click.echo(f"running parity against {folder} (decode mode: {decode_mode}, {caches} caches)...", err=True)
        run = parity_vision.run_vision_parity if vision else run_parity
        found = run(folder, decode_mode, packed)
        rows += found
        click.echo(report(found))
        if details:
            for row in found:
                status = "exact" if row.exact else "ok" if row.passed else "FAIL"
                click.echo(f"{status:<5} {row.group:<20} {row.name:<40} abs {row.max_abs:.3g} rel {row.rel:.3g} "
                           f"ulp {row.max_ulp} {row.note}")
        for why in (parity_vision.not_compared if vision else not_compared)(folder):
            click.echo(f"not compared: {why}")
    if not rows:
        raise click.ClickException("no golden folder given and none found at ../shared/reference")
    failed = [r for r in rows if not r.passed]
    if failed:
        raise click.ClickException(f"{len(failed)} of {len(rows)} tensors differ; first: {failed[0].group} "
                                   f"{failed[0].name} {failed[0].note}")
    click.echo(f"parity: all {len(rows)} compared tensors pass ({sum(r.exact for r in rows)} bit-exact)")


cli.add_command(kv)
cli.add_command(convert)
cli.add_command(train)
for command in COMMANDS:
    cli.add_command(command)
