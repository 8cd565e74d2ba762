"""`--model DIR` for the commands that take a model, and `dsv41 convert`.

A model directory is what `dsv41.checkpoint.open_model_dir` reads (docs/checkpoint.md). It is
checked here, before anything starts, so a missing shard or config is one readable error rather
than a component that fails to come up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import click

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from dsv41.checkpoint import ModelDir
    from dsv41.config import ModelConfig
    from dsv41.model.transformer import Transformer

F = TypeVar("F", bound=Callable)


def _model_dir(ctx: click.Context, param: click.Parameter, value: str | None) -> Path | None:
    """--model's directory as an absolute path; a built-in model's name (`small`) names its folder."""
    from dsv41.checkpoint import resolve_model_dir

    return None if value is None else resolve_model_dir(value).resolve()


def model_option(help_text: str) -> Callable[[F], F]:
    return click.option("--model", "model_path", metavar="DIR", callback=_model_dir,
                        help=f"{help_text} A built-in model's name (small) works too.")


def open_model(path: Path) -> ModelDir:
    """The checked model directory, or a user error listing its problems."""
    from dsv41.checkpoint import CheckpointError, open_model_dir
    from dsv41.config import ConfigError

    try:
        return open_model_dir(path)
    except (CheckpointError, ConfigError) as exc:
        raise click.ClickException(str(exc)) from None


def model_config(config_name: str | None, model_path: Path | None, load: Callable[[str], ModelConfig],
                 default: str) -> ModelConfig:
    """The config of --model DIR, else of --config NAME (default `default`); not both."""
    if model_path is not None and config_name is not None:
        raise click.UsageError("give either --config or --model, not both")
    return open_model(model_path).config if model_path is not None else load(config_name or default)


@dataclass(frozen=True)
class Generator:
    """What `dsv41 generate` runs: known before the (slow) model build, so a prompt that does not
    fit is refused first."""

    config: ModelConfig
    tokenizer: Tokenizer
    stop_ids: tuple[int, ...]
    what: str  # for the progress line
    build: Callable[[], Transformer]


def generator(config_name: str | None, model_path: Path | None, seed: int,
              load: Callable[[str], ModelConfig]) -> Generator:
    """A model directory's weights, tokenizer and EOS ids; else a config with seeded random weights."""
    config = model_config(config_name, model_path, load, "mini")
    if model_path is not None:
        from dsv41.checkpoint import CheckpointError, load_model

        model_dir = open_model(model_path)

        def build() -> Transformer:
            try:
                return load_model(model_dir)[0]
            except CheckpointError as exc:
                raise click.ClickException(str(exc)) from None

        tokenizer = _tokenizer(model_dir.path, config.text_config.vocab_size)
        return Generator(config, tokenizer, model_dir.generation.eos_token_ids, f"loading {model_path}", build)
    name = config_name or "mini"
    if name == "official":
        raise click.ClickException("the official config is too large to materialise here; use mini or micro")
    from dsv41.model.reference import random_model

    tokenizer = _tokenizer(name, config.text_config.vocab_size)
    return Generator(config, tokenizer, (config.eos_token_id,), f"building {name} with random weights (seed {seed})",
                     lambda: random_model(config, seed, tokenizer))


def _tokenizer(model: str | Path, vocab_size: int) -> Tokenizer:
    from dsv41.model.tokenizer import load_tokenizer

    try:
        return load_tokenizer(model, vocab_size)
    except ValueError as exc:  # a tokenizer.json of another size than the config's vocabulary
        raise click.ClickException(str(exc)) from None


@click.command("convert")
@click.argument("source", type=click.Path(exists=True, path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--max-shard-size", metavar="SIZE", help="Write model-0000i-of-0000n.safetensors shards of at most "
              "SIZE (e.g. 5GB, 500MiB) with model.safetensors.index.json; default: one model.safetensors.")
def convert(source: Path, out: Path, max_shard_size: str | None) -> None:
    """Rewrite the model directory SOURCE as OUT in the release's Hugging Face layout.

    SOURCE may hold either config format (config.json nested, or the flat inference one), one
    safetensors file or shards; every weight is checked by loading it. SOURCE may also be a
    `dsv41 train` checkpoint (ckpt-*.pt): its fp32 weights are quantised to the release's storage
    formats (FP8 with E8M0 32x32 scales, MXFP4 experts, FP8 Engram rows). OUT gets config.json,
    generation_config.json, tokenizer.json (if SOURCE has one) and the weights under their official
    names and on-disk dtypes. OUT must not exist or be empty.

    \b
    Examples:
      dsv41 convert ../shared/reference/golden golden-hf --max-shard-size 1MB
      dsv41 convert runs/small/ckpt-000450.pt my-small
    """
    from dsv41 import export
    from dsv41.checkpoint import CheckpointError
    from dsv41.config import ConfigError

    if max_shard_size is not None:
        try:
            export.parse_size(max_shard_size)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--max-shard-size") from None
    try:
        if source.is_file():
            from dsv41.training.export import export_trained

            written, _ = export_trained(source, out, max_shard_size=max_shard_size)
        else:
            open_model(source)
            written, _ = export.convert(source, out, max_shard_size=max_shard_size)  # loaded weights store exactly
    except (CheckpointError, ConfigError, FileExistsError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    files = ", ".join(f.name for f in written.weights_files)
    click.echo(f"wrote {written.path}: {files}" + (", tokenizer.json" if written.tokenizer_path else ""))
