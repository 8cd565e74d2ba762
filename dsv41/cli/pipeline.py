"""`dsv41 run | serve | component | status | keys | pipeline`: start, check and talk to pipelines.

The command line around `dsv41.pipelines` (loading, launching, the client) and the component host;
the work happens there. Modules that load torch are imported inside the commands that need them, so
help, `pipeline validate` and `keys` answer at once.
"""

from __future__ import annotations

import json
import math
import signal
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import zmq

from dsv41.cli.model import model_option, open_model
from dsv41.components.security import SecurityError, generate_keys
from dsv41.pipelines.schema import (
    BUILTIN_PIPELINES,
    COMPONENTS,
    MAX_TEMPERATURE,
    PIPELINE_DIR,
    Pipeline,
    PipelineError,
    load_pipeline,
    placement_of,
    resolve_endpoints,
)

if TYPE_CHECKING:
    from dsv41 import messages as m
    from dsv41.components.runtime import ComponentError
    from dsv41.pipelines.launch import Supervisor

PIPELINE_HELP = f"Built-in pipeline ({', '.join(BUILTIN_PIPELINES)}) or path to a pipeline YAML file."

runtime_dir_option = click.option(
    "--runtime-dir", type=click.Path(file_okay=False, resolve_path=True, path_type=Path),
    help="Directory for the ipc sockets and component logs (default: the pipeline's runtime_dir, else "
         "$XDG_RUNTIME_DIR/dsv41-UID/NAME, or /tmp/dsv41-UID/NAME without XDG_RUNTIME_DIR).")
pipeline_model_option = model_option(
    "Run this model directory (config.json, weights, optional tokenizer.json) instead of the pipeline's "
    "model section; the engram component reads its tables from the weight file that holds them.")
store_option = click.option(
    "--store", type=click.Path(file_okay=False, resolve_path=True, path_type=Path), envvar="DSV41_STORE",
    show_envvar=True, help='Folder of the persistent KV store, replacing store.path; "{pipeline}" in it becomes '
                           "the pipeline name.")


class FiniteFloatRange(click.FloatRange):
    """A FloatRange that also refuses nan, which compares false with both bounds and would pass."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        number = super().convert(value, param, ctx)
        if math.isnan(number):
            self.fail(f"{value!r} is not a number", param, ctx)
        return number


TEMPERATURE = FiniteFloatRange(0.0, MAX_TEMPERATURE)
TOP_P = FiniteFloatRange(0.0, 1.0, min_open=True)


def checked_text(text: str, param_hint: str) -> str:
    """`text` if it is valid Unicode that encodes as UTF-8. Bytes that are not UTF-8 reach a command
    line argument as lone surrogates (surrogateescape), which no message can carry: they are refused
    here, before anything starts."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        raise click.BadParameter(f"not valid UTF-8 text ({what} at character {exc.start})",
                                 param_hint=param_hint) from None
    return text


# --- shared helpers ------------------------------------------------------------------------------


def _pipeline(source: str, store: Path | None = None, model: Path | None = None) -> Pipeline:
    """The pipeline `source` names, with --store and --model applied; a bad file or model directory
    is a user error listing every problem."""
    try:
        pipeline = load_pipeline(source)
    except PipelineError as exc:
        raise click.ClickException(_problems(f"invalid pipeline {source}", exc)) from None
    overrides = {"store": {"path": str(store)}} if store is not None else {}
    if model is not None:
        overrides["model"] = {"checkpoint": str(model)}
    if overrides:
        from dsv41.pipelines.launch import with_overrides

        pipeline = with_overrides(pipeline, **overrides)
    if pipeline.model.checkpoint:
        open_model(pipeline.model.checkpoint)
    return pipeline


def _problems(headline: str, exc: PipelineError) -> str:
    return "\n  ".join([f"{headline}:", *exc.problems])


def _runtime_dir(pipeline: Pipeline, given: Path | None) -> Path:
    from dsv41.pipelines.launch import default_runtime_dir

    return given or default_runtime_dir(pipeline)


def _endpoints(pipeline: Pipeline, runtime_dir: Path) -> dict[str, str]:
    try:
        return resolve_endpoints(pipeline, runtime_dir)
    except PipelineError as exc:
        raise click.ClickException(_problems(f"cannot place {pipeline.name} in {runtime_dir}", exc)) from None


def _keys_dir(pipeline: Pipeline) -> Path | None:
    keys = pipeline.security.keys_dir
    return Path(keys).expanduser() if keys else None


def _component_problem(exc: ComponentError) -> str:
    return f"{exc.component} failed ({exc.code.name}): {exc.text}"


@contextmanager
def _running(pipeline: Pipeline, runtime_dir: Path | None) -> Iterator[Supervisor]:
    """A started supervisor, stopped however the block ends (Ctrl-C included)."""
    from dsv41.pipelines.launch import LaunchError, Supervisor

    directory = _runtime_dir(pipeline, runtime_dir)
    _endpoints(pipeline, directory)  # socket paths too long for this directory are a user error, not a traceback
    supervisor = Supervisor(pipeline, directory, log=lambda text: click.echo(f"{pipeline.name}: {text}", err=True))
    click.echo(f"starting {pipeline.name} ({_placements(pipeline)}) in {directory}", err=True)
    try:
        supervisor.start()
    except (LaunchError, SecurityError) as exc:
        raise click.ClickException(f"{pipeline.name} did not start: {exc}") from None
    try:
        yield supervisor
    finally:
        supervisor.stop()


def _placements(pipeline: Pipeline) -> str:
    """Where the components run, e.g. 'placement process' or 'placement process; thread: engram'."""
    groups: dict[str, list[str]] = {}
    for name in pipeline.components:
        groups.setdefault(placement_of(pipeline, name), []).append(name)
    main = max(groups, key=lambda placement: len(groups[placement]))
    others = [f"{placement}: {', '.join(names)}" for placement, names in groups.items() if placement != main]
    return "; ".join([f"placement {main}", *others])


# --- run -----------------------------------------------------------------------------------------


@click.command()
@click.argument("source", metavar="[PIPELINE]", default="local")
@click.option("--prompt", help="The prompt text.")
@click.option("--file", "prompt_file", type=click.File("r", encoding="utf-8"), metavar="FILE",
              help="Read the prompt from this file ('-' reads stdin).")
@click.option("--max-new-tokens", type=click.IntRange(1),
              help="Most tokens to generate (default: the pipeline's generation.max_new_tokens).")
@click.option("--temperature", type=TEMPERATURE,
              help="Sampling temperature; 0 is greedy (default: the pipeline's generation.temperature).")
@click.option("--top-p", type=TOP_P,
              help="Nucleus sampling mass (default: the pipeline's generation.top_p).")
@click.option("--seed", type=click.IntRange(0), default=0, show_default=True,
              help="Seed of sampling, so a sampled completion can be repeated.")
@click.option("--prefill-mode", type=click.Choice(["ced", "exact", "full"]),
              help="How the prompt is prefilled: compressed encoder-decoder, exact, or full attention "
                   "(default: the pipeline's generation.prefill_mode).")
@click.option("--dspark", "dspark_mode", type=click.Choice(["auto", "fixed", "off"]),
              help="Speculative decoding with the model's DSpark drafter: auto (the scheduler picks each step's "
                   "drafts), fixed (--dspark-length drafts per step) or off (default: the pipeline's "
                   "components.dspark.options.mode; unset, auto when the model has a drafter, else off).")
@click.option("--dspark-length", type=click.IntRange(1, 64),
              help="Drafts verified per step with --dspark fixed, the most with auto (at most the model's "
                   "dspark_block_size; default: the block size).")
@store_option
@runtime_dir_option
@pipeline_model_option
@click.option("--json", "as_json", is_flag=True, help="Print nothing while generating, then one JSON object on "
              "stdout: the text, the token ids and every statistic of the request.")
@click.option("--image", "images", multiple=True, type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="An image file (PNG, JPEG, ...) for a model with a vision tower; repeat for several. Each fills "
                   "one image placeholder token of the prompt, in order; a prompt without placeholders gets them "
                   "in front. The tokenizer component runs the ViT.")
def run(source: str, prompt: str | None, prompt_file, max_new_tokens: int | None, temperature: float | None,
        top_p: float | None, seed: int, prefill_mode: str | None, dspark_mode: str | None, dspark_length: int | None,
        store: Path | None, runtime_dir: Path | None, model_path: Path | None, as_json: bool,
        images: tuple[Path, ...]) -> None:
    """Start PIPELINE, complete one prompt, and stop it again.

    PIPELINE is a built-in name or a pipeline file (default: local). The completion streams to stdout
    as it is generated; progress and a summary go to stderr: time to first token, decode speed, and
    how much of the prompt came from the prefix store. With --json, stdout gets one object at the
    end instead: the text, the token ids and every statistic of the request.

    \b
    Examples:
      dsv41 run --prompt "Hello"
      dsv41 run inproc --file prompt.txt --max-new-tokens 128 --json
      cat prompt.txt | dsv41 run my.yaml --file - --temperature 0.7 --seed 3
      dsv41 run --prompt "def f(x):" --dspark fixed --dspark-length 3
    """
    text = _prompt(prompt, prompt_file)
    pipeline = with_dspark(_pipeline(source, store, model_path), dspark_mode, dspark_length)
    given = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
             "prefill_mode": prefill_mode}
    options = {k: getattr(pipeline.generation, k) if v is None else v for k, v in given.items()} | {"seed": seed}
    if images:
        options["images"] = _image_files(images)
    with _running(pipeline, runtime_dir) as supervisor:
        ids, completion, done = _complete(supervisor, text, options, stream=not as_json)
        # the result before the pipeline's shutdown, which takes a second or two
        if as_json:
            click.echo(json.dumps(_result(completion, ids, done)))
        else:
            click.echo("")
            click.echo(_summary(done), err=True)


def _image_files(paths: tuple[Path, ...]) -> list[bytes]:
    """The encoded bytes of --image files (checked and decoded by the pipeline's tokenizer)."""
    from dsv41.components.limits import MAX_REQUEST_IMAGE_BYTES
    from dsv41.model.image_processor import ImageError, image_bytes

    try:
        data = [image_bytes(path) for path in paths]
    except ImageError as exc:
        raise click.BadParameter(str(exc), param_hint="--image") from None
    if sum(map(len, data)) > MAX_REQUEST_IMAGE_BYTES:
        raise click.BadParameter(f"{sum(map(len, data))} bytes of images; one request takes at most "
                                 f"{MAX_REQUEST_IMAGE_BYTES}", param_hint="--image")
    return data


def with_dspark(pipeline: Pipeline, mode: str | None, length: int | None) -> Pipeline:
    """The pipeline with --dspark / --dspark-length put into the dspark component's options."""
    given = {key: value for key, value in (("mode", mode), ("length", length)) if value is not None}
    if not given:
        return pipeline
    import msgspec

    from dsv41.pipelines.launch import with_overrides

    spec = pipeline.components["dspark"]
    spec = msgspec.structs.replace(spec, options={**spec.options, **given})
    return with_overrides(pipeline, components={**pipeline.components, "dspark": spec})


def _prompt(prompt: str | None, prompt_file) -> str:
    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give the prompt with either --prompt TEXT or --file FILE")
    try:
        text = prompt if prompt is not None else prompt_file.read()
    except UnicodeDecodeError as exc:
        raise click.BadParameter(f"not valid UTF-8 text (byte 0x{exc.object[exc.start]:02x} at byte {exc.start})",
                                 param_hint="--file") from None
    if not text:
        raise click.BadParameter("the prompt is empty", param_hint="--prompt/--file")
    return checked_text(text, "--prompt")


def _complete(supervisor: Supervisor, prompt: str, options: dict[str, Any],
              stream: bool) -> tuple[list[int], str, m.Finished]:
    """Send one request to dspark; the token ids, the text and the closing `Finished`."""
    from dsv41 import messages as m
    from dsv41.components.runtime import ComponentError
    from dsv41.pipelines.client import generate

    ids, parts = [], []
    peer = supervisor.peer("dspark")
    try:
        for event in generate(peer, prompt, **options):
            if isinstance(event, m.TokenEvent):
                ids.append(event.token)
                parts.append(event.text)
                if stream:
                    click.echo(event.text, nl=False)
            else:
                done = event
    except ComponentError as exc:
        raise click.ClickException(_component_problem(exc)) from None
    finally:
        peer.close()
    return ids, "".join(parts), done


def _result(text: str, ids: list[int], done: m.Finished) -> dict[str, Any]:
    import msgspec

    fields = {k: v for k, v in msgspec.structs.asdict(done).items() if k != "version"}
    return {"text": text, "ids": ids, **fields, "reason": done.reason.name.lower()}


def _summary(done: m.Finished) -> str:
    """What the request cost and what it reused, for a person reading stderr."""
    decoded = done.generated_tokens - 1  # the first token comes out of the prefill
    speed = (f"{decoded / done.decode_s:.2f} tokens/s ({decoded} tokens in {done.decode_s:.3f} s)"
             if decoded > 0 and done.decode_s > 0 else "n/a (one token)")
    share = done.cached_tokens / done.prompt_tokens if done.prompt_tokens else 0.0
    rows = [("finished", done.reason.name.lower()),
            ("generated tokens", f"{done.generated_tokens:,}"),
            ("time to first token", f"{done.ttft_s * 1000:.1f} ms"),
            ("decode", speed),
            ("prompt tokens", f"{done.prompt_tokens:,}"),
            ("prefix hit (cached)", f"{done.cached_tokens:,} tokens ({share:.0%})"),
            ("replayed layer-tokens", f"{done.replayed_layer_tokens:,}"),
            ("encoder layer-tokens", f"{done.encoder_layer_tokens:,}"),
            ("Engram wait", f"{done.engram_wait_s * 1000:.1f} ms")]
    if done.lengths:
        rows.append(("DSpark", _dspark_summary(done)))
    return "\n".join(f"{label:<22} {value}" for label, value in rows)


def _dspark_summary(done: m.Finished) -> str:
    """Acceptance length (tokens per verification, the bonus token included), acceptance by draft
    position, the lengths the scheduler chose, and the drafter's share of the decode time."""
    v = done.verifications
    length = (done.accepted_tokens + v) / v if v else 0.0
    by_position = " ".join(f"{a / v:.0%}" for a in done.accepted_by_position) if v else "-"
    chosen = " ".join(f"{k}:{n}" for k, n in enumerate(done.lengths) if n)
    share = done.drafter_s / done.decode_s if done.decode_s > 0 else 0.0
    return (f"acceptance length {length:.2f} over {v} verifications; accepted by position {by_position}; "
            f"lengths chosen {chosen}; drafter {share:.0%} of decode time")


# --- serve and component -------------------------------------------------------------------------


@click.command()
@click.argument("source", metavar="[PIPELINE]", default="local")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address the HTTP API listens on. Anything but loopback needs an API key.")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535),
              help="TCP port of the HTTP API (0: any free port, printed at start).")
@click.option("--api-key", envvar="DSV41_API_KEY", show_envvar=True,
              help="Require `Authorization: Bearer KEY` on every request but /health, /metrics included "
                   "(compared in constant time).")
@click.option("--served-model-name", "model_name",
              help="The model's name in the API (default: the model directory's or config's name).")
@click.option("--max-body-mb", default=32, show_default=True, type=click.IntRange(1, 4096),
              help="Largest request body accepted, in MiB; a bigger one is answered 413.")
@click.option("--no-http", is_flag=True, help="Only keep the components up (clients speak dsv41's messages to "
              "dspark), without the HTTP API.")
@runtime_dir_option
@store_option
@pipeline_model_option
def serve(source: str, host: str, port: int, api_key: str | None, model_name: str | None, max_body_mb: int,
          no_http: bool, runtime_dir: Path | None, store: Path | None, model_path: Path | None) -> None:
    """Start PIPELINE and serve the OpenAI-compatible HTTP API until SIGINT (Ctrl-C) or SIGTERM.

    Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming with
    "stream": true), GET /health, GET /metrics (Prometheus). Any OpenAI client works against
    http://HOST:PORT/v1; docs/serving.md lists the parameters, errors and metrics. Components that
    die are restarted; a crash loop (see the pipeline's supervisor section) stops the pipeline, prints
    the component's last log lines and exits with status 1.

    \b
    Examples:
      dsv41 serve                                   the local pipeline on http://127.0.0.1:8000
      dsv41 serve my.yaml --port 9000 --runtime-dir /run/dsv41 --store /data/kv
      DSV41_API_KEY=... dsv41 serve local --host 0.0.0.0
    """
    from dsv41.components.security import is_loopback_host

    if not no_http and not api_key and not is_loopback_host(host):
        raise click.BadParameter(f"{host} is reachable from other machines: set --api-key (or DSV41_API_KEY) to "
                                 "serve beyond loopback", param_hint="--host")
    pipeline = _pipeline(source, store, model_path)
    sock = None
    if not no_http:
        from dsv41.serving.server import bind

        try:
            sock = bind(host, port)
        except OSError as exc:
            raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    try:
        with _running(pipeline, runtime_dir) as supervisor, _until_signal() as stop:
            endpoint = supervisor.endpoints["dspark"]
            check = f"dsv41 status {source}" + (f" --runtime-dir {runtime_dir}" if runtime_dir else "")
            if sock is None:
                click.echo(f"{pipeline.name} is up; clients connect to dspark at {endpoint}")
                if endpoint.startswith("inproc://"):
                    click.echo("note: inproc endpoints are reachable only from inside this process", err=True)
                click.echo(f"check it with `{check}`; stop it with Ctrl-C or SIGTERM", err=True)
                while not stop.wait(0.2):
                    if supervisor.failure:  # its log lines are already on stderr, through the supervisor's log
                        raise click.ClickException(f"{pipeline.name} stopped: {supervisor.failure.splitlines()[0]}")
            else:
                _serve_http(pipeline, supervisor, sock, stop, api_key, model_name, max_body_mb << 20, check)
    finally:
        if sock is not None:
            sock.close()
    click.echo(f"{pipeline.name} stopped", err=True)


def _serve_http(pipeline: Pipeline, supervisor: Supervisor, sock, stop: threading.Event, api_key: str | None,
                model_name: str | None, max_body_bytes: int, check: str) -> None:
    """uvicorn on `sock` in a thread until a signal or a crash loop ends it."""
    from dsv41.serving.server import build_app, uvicorn_server

    serving = build_app(pipeline, supervisor.endpoints, supervisor.runtime_dir, api_key, max_body_bytes, model_name)
    server = uvicorn_server(serving)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    click.echo(f"{pipeline.name} is up; OpenAI API at {url}/v1 (model {serving.settings.model}), metrics at "
               f"{url}/metrics")
    click.echo(f"check it with `{check}`; stop it with Ctrl-C or SIGTERM", err=True)
    try:
        while not stop.wait(0.2):
            if supervisor.failure:
                raise click.ClickException(f"{pipeline.name} stopped: {supervisor.failure.splitlines()[0]}")
            if not thread.is_alive():
                raise click.ClickException("the HTTP server stopped")
    finally:
        server.should_exit = True
        thread.join(10)
        serving.backend.close()


@contextmanager
def _until_signal() -> Iterator[threading.Event]:
    """An event that SIGINT and SIGTERM set, so either ends serving with a clean stop."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@click.command()
@click.argument("name", type=click.Choice(COMPONENTS))
@click.option("--pipeline", "source", required=True, metavar="PIPELINE", help=PIPELINE_HELP)
@runtime_dir_option
@store_option
@pipeline_model_option
def component(name: str, source: str, runtime_dir: Path | None, store: Path | None,
              model_path: Path | None) -> None:
    """Run one component of a pipeline in the foreground, until SIGINT or SIGTERM.

    For pipelines split across machines, or to watch one component in a debugger: it binds the
    endpoint the pipeline gives it, resolved as `dsv41 serve` resolves it, and finds the other
    components at theirs. Nothing restarts it when it dies.

    \b
    Example:
      dsv41 component engram --pipeline my.yaml
    """
    from dsv41.components.host import build_server, serve_forever
    from dsv41.components.runtime import EndpointInUse
    from dsv41.pipelines.launch import LaunchError, prepare_runtime_dir

    pipeline = _pipeline(source, store, model_path)
    directory = _runtime_dir(pipeline, runtime_dir)
    endpoint = _endpoints(pipeline, directory)[name]
    if endpoint.startswith("inproc://"):
        raise click.ClickException(f"{name} has thread placement in {pipeline.name}, so only threads of one process "
                                   "reach it; run the whole pipeline with `dsv41 serve`, or set its placement to "
                                   "process")
    click.echo(f"building {name} of {pipeline.name}...", err=True)
    try:
        prepare_runtime_dir(directory)
        server = build_server(name, pipeline, directory)
    except (LaunchError, EndpointInUse, SecurityError, zmq.ZMQError) as exc:
        raise click.ClickException(f"{name} cannot serve at {endpoint}: {exc}") from None
    click.echo(f"{name} serving at {endpoint}")
    serve_forever(server)


# --- status --------------------------------------------------------------------------------------


@click.command()
@click.argument("source", metavar="[PIPELINE]", default="local")
@runtime_dir_option
@click.option("--timeout", "timeout_s", type=click.FloatRange(0.05), default=1.0, show_default=True,
              help="Seconds each component has to answer.")
@click.option("--json", "as_json", is_flag=True,
              help="Print one JSON object on stdout: each component's state, endpoint, pid, uptime and counters.")
def status(source: str, runtime_dir: Path | None, timeout_s: float, as_json: bool) -> None:
    """Ping every component of a running PIPELINE; exit 1 if any is down.

    Components are found at the endpoints `dsv41 serve` gives them, so pass the same --runtime-dir.
    Each answer carries the component's pid, uptime and counters (requests, errors, cache hits, ...).
    Components of an inproc pipeline live inside the process that started them and always show down.
    """
    pipeline = _pipeline(source)
    directory = _runtime_dir(pipeline, runtime_dir)
    endpoints = _endpoints(pipeline, directory)
    keys_dir = _keys_dir(pipeline)
    with ThreadPoolExecutor(len(COMPONENTS)) as pool:
        rows = list(pool.map(lambda name: _ping(name, endpoints[name], keys_dir, timeout_s), COMPONENTS))
    if as_json:
        click.echo(json.dumps({"pipeline": pipeline.name, "runtime_dir": str(directory), "components": rows}))
    else:
        click.echo(_status_table(rows))
    down = [row["component"] for row in rows if row["state"] == "down"]
    if down:
        raise click.ClickException(f"{len(down)} of {len(rows)} components of {pipeline.name} down: {', '.join(down)}")


def _ping(name: str, endpoint: str, keys_dir: Path | None, timeout_s: float) -> dict[str, Any]:
    """One component's state; a peer that does not answer in time is down, with the reason."""
    from dsv41.components.runtime import ComponentError, Peer

    row: dict[str, Any] = {"component": name, "endpoint": endpoint}
    try:
        peer = Peer(endpoint, name, keys_dir, timeout_s=timeout_s)
    except SecurityError as exc:
        return {**row, "state": "down", "problem": str(exc)}
    try:
        pong = peer.ping(timeout_s)
    except ComponentError as exc:
        return {**row, "state": "down", "problem": exc.text}
    finally:
        peer.close()
    return {**row, "state": "up", "pid": pong.pid, "uptime_s": round(pong.uptime_s, 3), "counters": pong.counters}


def _status_table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'component':<10} {'state':<5} {'pid':>8} {'uptime':>9}  counters"]
    for row in rows:
        if row["state"] == "up":
            counters = " ".join(f"{k}={v}" for k, v in sorted(row["counters"].items())) or "-"
            lines.append(f"{row['component']:<10} up    {row['pid']:>8} {_duration(row['uptime_s']):>9}  {counters}")
        else:
            lines.append(f"{row['component']:<10} down  {'-':>8} {'-':>9}  {row['problem']}")
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


# --- keys ----------------------------------------------------------------------------------------


@click.command()
@click.argument("keys_dir", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Replace existing key files; peers holding the old keys stop working.")
def keys(keys_dir: Path, force: bool) -> None:
    """Write CURVE key pairs (server, client) into DIR, for tcp endpoints other machines can reach.

    A component bound to a non-loopback address is refused unless the pipeline names a keys
    directory. Components encrypt with the server pair and admit only clients whose public key
    (a *.key file) is in DIR; clients connect with the client pair.

    \b
    Example:
      dsv41 keys ~/.config/dsv41/keys
    """
    try:
        written = generate_keys(keys_dir, overwrite=force)
    except SecurityError as exc:
        raise click.ClickException(f"{exc}; --force replaces them") from None
    except OSError as exc:
        raise click.ClickException(f"cannot write keys into {keys_dir}: {exc.strerror}") from None
    for path in written:
        click.echo(f"wrote {path}")
    click.echo(f"\nTo use them, set in the pipeline file on every machine:\n\n  security:\n    keys_dir: {keys_dir}\n")
    click.echo(f"and copy {keys_dir} to the other machines over a trusted channel; the *.key_secret files must "
               "stay private (mode 600).")


# --- pipeline validate / show --------------------------------------------------------------------


@click.group("pipeline")
def pipeline_group() -> None:
    """Check pipeline files and print the built-in ones to start your own from.

    \b
    Examples:
      dsv41 pipeline show local > my.yaml
      dsv41 pipeline validate my.yaml
    """


@pipeline_group.command()
@click.argument("sources", metavar="FILE...", nargs=-1, required=True)
def validate(sources: tuple[str, ...]) -> None:
    """Check pipeline files (or built-in names) without starting anything; exit 1 if any is invalid.

    Every problem of a file is listed at once, each as FILE:LINE: key.path: problem, so one round of
    edits fixes them all: unknown or missing fields and component options, values out of range,
    endpoints that do not parse, placements that cannot reach their endpoints, two components on one
    endpoint or socket, '..' in socket paths and in the directories dsv41 writes, tcp without keys,
    a config, checkpoint or keys directory that does not exist. YAML anchors and aliases, nesting
    deeper than 16 levels and files over 1 MiB are refused before anything is read into memory.
    """
    invalid = 0
    for source in sources:
        try:
            pipeline = load_pipeline(source)
        except PipelineError as exc:
            invalid += 1
            click.echo(_problems(f"invalid: {source}", exc))
            continue
        where = "" if source == pipeline.name else f" from {source}"
        click.echo(f"ok: {pipeline.name} ({len(pipeline.components)} components, {_placements(pipeline)}){where}")
    if invalid:
        raise click.ClickException(f"{invalid} of {len(sources)} pipelines invalid")


@pipeline_group.command()
@click.argument("name", type=click.Choice(BUILTIN_PIPELINES))
def show(name: str) -> None:
    """Print the YAML of built-in pipeline NAME, with its comments, to copy and edit."""
    click.echo((PIPELINE_DIR / f"{name}.yaml").read_text(encoding="utf-8"), nl=False)


COMMANDS = (run, serve, component, status, keys, pipeline_group)
