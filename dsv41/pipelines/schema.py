"""Pipeline files: the YAML that says which model runs, and where and how each component runs.

A pipeline names the model, the KV store, the generation defaults, the supervisor policy and one entry
per component with its placement (thread or process) and its ZeroMQ endpoint. Loading is strict and
reports every problem at once as `<file>:<line>: <key.path>: <problem>`, so a file is fixed in one
round. The YAML is only composed into nodes and read with the safe constructors of plain scalars, so
no tag can build objects or run code. Hostile files are bounded before they cost anything: at most
MAX_FILE_BYTES are read, anchors and aliases are refused (a "billion laughs" alias bomb expands
exponentially), nesting is capped at MAX_DEPTH (the composer recurses), and every number has a finite
range.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import msgspec
import yaml
from yaml.composer import ComposerError
from yaml.constructor import SafeConstructor

from dsv41.components.security import is_loopback_host
from dsv41.config import BUILTIN_CONFIGS

BUILTIN_PIPELINES = ("local", "inproc", "epd")
PIPELINE_DIR = Path(__file__).parent
COMPONENTS = ("tokenizer", "engram", "encoder", "decoder", "dspark", "kvstore")
# sun_path of a Unix socket holds 108 bytes including the closing NUL.
MAX_IPC_PATH = 107
# The built-in pipelines are about 3 KB and 4 levels deep (components.encoder.options.threads).
MAX_FILE_BYTES = 1 << 20
MAX_DEPTH = 16
MAX_THREADS = 1024
# Pages of 128 entries per pool: 2^24 pages hold 2^31 positions, 2048 sequences at the 1M-token context.
MAX_KV_PAGES = 1 << 24
MAX_SEED = (1 << 63) - 1
# Past this, tempered sampling is uniform over the top-p set anyway; inf would turn the logits into NaN.
MAX_TEMPERATURE = 100.0
DAY_S = 86_400.0

Placement = Literal["thread", "process"]
Issue = tuple[tuple[str, ...], str]


class PipelineError(ValueError):
    """A pipeline that cannot be used; `problems` lists every reason, one line each."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(problems))


class ModelSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    # built-in config name (official, mini, micro) or a path to a config.json
    config: str = "mini"
    # seed of the random weights when no checkpoint is given
    seed: Annotated[int, msgspec.Meta(ge=0, le=MAX_SEED)] = 0
    # directory of safetensors weights in the official format
    checkpoint: str | None = None


class StoreSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    # LMDB directory; "{pipeline}" is replaced by the pipeline name
    path: str = "~/.cache/dsv41/kv/{pipeline}"
    # most bytes the persistent KV store may hold, in GiB (the LMDB map is sized 1.3x this, within 64-bit
    # address space)
    capacity_gib: Annotated[float, msgspec.Meta(gt=0, le=16384)] = 4.0
    # tokens per stored KV block
    block_tokens: Annotated[int, msgspec.Meta(ge=16, le=65536, multiple_of=16)] = 256
    # memory for the sliding-window KV of recent requests, in GiB
    swa_pool_gib: Annotated[float, msgspec.Meta(ge=0, le=1024)] = 0.5
    # seconds an unused sliding-window entry is kept
    swa_ttl_s: Annotated[float, msgspec.Meta(gt=0, le=7 * DAY_S)] = 300.0


class GenerationSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    # tokens generated per request unless the request says otherwise
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] = 64
    # how a prompt is prefilled: compressed encoder-decoder, exact, or full attention
    prefill_mode: Literal["ced", "exact", "full"] = "ced"
    # prompt tokens per prefill step: the encoder serves the decode steps of running requests between two
    # steps, so this is the prefill's share of each step's token budget (a `full` prefill returns logits
    # for each, so it also bounds message sizes)
    chunk_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 512
    # sampling temperature; 0 is greedy
    temperature: Annotated[float, msgspec.Meta(ge=0, le=MAX_TEMPERATURE)] = 0.0
    # nucleus sampling mass
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    # seconds a request may take before it is abandoned
    request_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=DAY_S)] = 600.0


class SchedulingSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    # requests prefilling or decoding at once (each decoding request takes one token per batched step)
    max_running: Annotated[int, msgspec.Meta(ge=1, le=256)] = 64
    # requests waiting for a running slot or for KV pages, first come first served; when it is full a
    # new request is refused (CAPACITY; HTTP 429)
    max_waiting: Annotated[int, msgspec.Meta(ge=0, le=65536)] = 256
    # seconds an HTTP client refused for capacity is told to wait (Retry-After)
    retry_after_s: Annotated[int, msgspec.Meta(ge=1, le=3600)] = 1
    # batched decode steps out at once, the decoding requests split over them: the encoder computes
    # one batch's half of a step while the decoder computes another's
    steps_in_flight: Annotated[int, msgspec.Meta(ge=1, le=8)] = 2


class SupervisorSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    # seconds every component has to report ready after launch
    ready_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=DAY_S)] = 120.0
    # more restarts of one component than this within restart_window_s is a crash loop: give up
    max_restarts: Annotated[int, msgspec.Meta(ge=0, le=1000)] = 3
    # seconds over which restarts are counted
    restart_window_s: Annotated[float, msgspec.Meta(gt=0, le=DAY_S)] = 30.0
    # delay before the first restart, doubled for each further restart in the window
    backoff_s: Annotated[float, msgspec.Meta(ge=0, le=3600)] = 0.5


class SecuritySpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    # directory written by `dsv41 keys` (CURVE key pairs); required for tcp:// on a non-loopback host
    keys_dir: str | None = None


class CommonOptions(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """Options every component reads; an option left out is UNSET (options hold no nulls)."""

    # torch threads of the component's process (default: 1, half the cores for the encoder and decoder)
    threads: Annotated[int, msgspec.Meta(ge=1, le=MAX_THREADS)] | msgspec.UnsetType = msgspec.UNSET


class ModelOptions(CommonOptions, frozen=True, kw_only=True):
    """Options of the encoder and the decoder."""

    # pages of 128 global KV entries per page pool; unset: the pools grow with the requests
    kv_pages: Annotated[int, msgspec.Meta(ge=1, le=MAX_KV_PAGES)] | msgspec.UnsetType = msgspec.UNSET


class EngramOptions(CommonOptions, frozen=True, kw_only=True):
    """Options of the engram component (rows_timeout_s is read by the encoder, which waits for the rows)."""

    # push a prompt's rows ahead of the encoder's need; false: the encoder looks them up itself
    prefetch: bool = True
    # push each decode step's rows too (one token's: the encoder's own lookup costs less than the
    # messages, docs/system.md)
    prefetch_steps: bool = False
    # safetensors file of the Engram tables; needed with a checkpoint, written once for random weights
    tables: str = ""
    # seconds the encoder waits for pushed rows before looking them up itself
    rows_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=600)] = 5.0


class DSparkOptions(CommonOptions, frozen=True, kw_only=True):
    """Options of the dspark component: speculative decoding with the model's DSpark drafter."""

    # auto: the scheduler picks each request's verification length from the drafter's confidence and the
    # measured step cost; fixed: `length` drafts per request and step; off: one token per step. Unset:
    # auto when the model holds a drafter (mtp.* tensors), else off
    mode: Literal["auto", "fixed", "off"] | msgspec.UnsetType = msgspec.UNSET
    # drafts verified per request and step (fixed), or the most (auto); at most the model's
    # dspark_block_size. Unset: the block size
    length: Annotated[int, msgspec.Meta(ge=1, le=64)] | msgspec.UnsetType = msgspec.UNSET


# The options each component takes; any other key is refused.
OPTIONS: dict[str, type[CommonOptions]] = {
    "tokenizer": CommonOptions, "engram": EngramOptions, "encoder": ModelOptions, "decoder": ModelOptions,
    "dspark": DSparkOptions, "kvstore": CommonOptions,
}


class ComponentSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    # "auto", or inproc://NAME, ipc://PATH, tcp://HOST:PORT
    endpoint: str = "auto"
    # None takes the pipeline's placement
    placement: Placement | None = None
    # component-specific options, checked against OPTIONS (e.g. engram: {prefetch: true})
    options: dict[str, str | int | float | bool] = {}


class Pipeline(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    # pipeline name, used in socket, inproc and store names
    name: Annotated[str, msgspec.Meta(pattern=r"^[a-z0-9_-]{1,32}$")]
    # the model and its weights
    model: ModelSpec
    # placement of components that do not set their own
    placement: Placement = "process"
    # directory for ipc sockets and lock files; None: chosen at launch
    runtime_dir: str | None = None
    # the persistent KV store
    store: StoreSpec = StoreSpec()
    # generation defaults
    generation: GenerationSpec = GenerationSpec()
    # continuous batching: how many requests run at once and how many may wait
    scheduling: SchedulingSpec = SchedulingSpec()
    # restart policy of component processes
    supervisor: SupervisorSpec = SupervisorSpec()
    # keys for tcp endpoints reachable from other machines
    security: SecuritySpec = SecuritySpec()
    # one entry per component, all six required
    components: dict[str, ComponentSpec]


def placement_of(p: Pipeline, component: str) -> str:
    """Where `component` runs: its own placement, else the pipeline's."""
    return p.components[component].placement or p.placement


def resolve_endpoints(p: Pipeline, runtime_dir: Path) -> dict[str, str]:
    """The endpoint each component binds, once the launcher has chosen the runtime directory."""
    endpoints = {c: _concrete(p, c, runtime_dir) for c in p.components}
    issues = _long_sockets(p, endpoints) + _shared_sockets(endpoints)
    if issues:
        raise PipelineError([f"{'.'.join(path)}: {message}" for path, message in issues])
    return endpoints


def load_pipeline(source: str | Path) -> Pipeline:
    """Load a built-in pipeline by name (`local`, `inproc`, `epd`) or a pipeline file by path.

    Raises PipelineError listing every problem in the file, each with its line and key path.
    """
    text, label = _read(source)
    doc = _Doc(label)
    root = _compose(text, label)
    if root is None:
        raise PipelineError([f"{label}:1: root: the file is empty; expected a pipeline mapping"])
    doc.lines[()] = root.start_mark.line + 1
    data = _walk(root, (), doc)
    if not isinstance(data, dict):
        issues = [] if data is _DROP else [((), f"expected a mapping at the top level, got {_kind(data)}")]
        raise PipelineError(doc.report(issues))
    issues = _check_struct(Pipeline, data, (), doc)
    _prune(data, [path for path, _ in issues])
    try:
        pipeline = msgspec.convert({**_STAND_INS, **data}, Pipeline, strict=True)
    except msgspec.ValidationError as exc:
        raise PipelineError(doc.report(issues or [((), str(exc))])) from None
    problems = doc.report(issues + _cross_field_problems(pipeline))
    if problems:
        raise PipelineError(problems)
    return pipeline


# --- reading the YAML ------------------------------------------------------------------------------

_TAG = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_TAG + name for name in ("null", "bool", "int", "float", "str")}
# Take the place of required fields already reported missing or invalid, so the cross-field rules still
# run; a pipeline with any problem is never returned, so they never reach a caller.
_STAND_INS = {"name": "invalid", "model": {}, "components": {}}
# Stands for a value already reported as unreadable; it never reaches the typed pipeline.
_DROP = object()


@dataclass
class _Doc:
    """One file being loaded: its label, the line of each key path, and the problems found so far."""

    label: str
    lines: dict[tuple[str, ...], int] = field(default_factory=dict)
    dropped: set[tuple[str, ...]] = field(default_factory=set)
    found: list[tuple[int, str]] = field(default_factory=list)

    def line(self, path: tuple[str, ...]) -> int:
        """The line of `path`, or of its nearest ancestor written in the file."""
        while path not in self.lines:
            path = path[:-1]
        return self.lines[path]

    def add(self, path: tuple[str, ...], message: str, line: int | None = None) -> None:
        line = self.line(path) if line is None else line
        self.found.append((line, f"{self.label}:{line}: {'.'.join(path) or 'root'}: {message}"))

    def fail(self, node: yaml.Node, path: tuple[str, ...], message: str) -> object:
        """Record a value that cannot be read; the caller leaves it out of the data."""
        self.add(path, message, node.start_mark.line + 1)
        return _DROP

    def report(self, issues: list[Issue]) -> list[str]:
        """Every problem, in the order of the file."""
        for path, message in issues:
            self.add(path, message)
        return [text for _, text in sorted(self.found, key=lambda item: item[0])]


def _read(source: str | Path) -> tuple[str, str]:
    """The text of a pipeline and the label its problems start with; at most MAX_FILE_BYTES are read,
    so a huge file (or a device) costs no memory."""
    if isinstance(source, str) and source in BUILTIN_PIPELINES:
        path = PIPELINE_DIR / f"{source}.yaml"
        label = path.name
    else:
        path = Path(source)
        label = str(path)
    try:
        with path.open("rb") as file:
            data = file.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise PipelineError([f"{label}: the file is over {MAX_FILE_BYTES} bytes; a pipeline file is a few KB"])
        return data.decode("utf-8"), label
    except FileNotFoundError:
        names = ", ".join(BUILTIN_PIPELINES)
        raise PipelineError([f"{label}: no such file, and not a built-in pipeline name ({names})"]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PipelineError([f"{label}: cannot read the file: {exc}"]) from None


class _NodeLoader(yaml.SafeLoader):
    """Composes nodes and refuses anchors, aliases and deep nesting before they cost anything: an alias
    bomb is a few lines that expand exponentially once walked, and the composer recurses per level."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
            raise ComposerError(None, None, "anchors and aliases (&name, *name) are not supported; write the "
                                "values out", event.start_mark)
        if self.depth >= MAX_DEPTH:
            raise ComposerError(None, None, f"nested more than {MAX_DEPTH} levels deep", event.start_mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _compose(text: str, label: str) -> yaml.Node | None:
    """The node tree of a single YAML document; nothing is constructed yet."""
    try:
        return yaml.compose(text, Loader=_NodeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        reason = ", ".join(part for part in (exc.context, exc.problem) if part)
        raise PipelineError([f"{label}:{mark.line + 1}: invalid YAML: {reason}"]) from None
    except yaml.YAMLError as exc:
        raise PipelineError([f"{label}: invalid YAML: {exc}"]) from None


def _walk(node: yaml.Node, path: tuple[str, ...], doc: _Doc) -> Any:
    """Plain data for `node`, or _DROP when it cannot be read (the reason goes to `doc`). The tree has
    no aliases and at most MAX_DEPTH levels (the loader refused them), so this ends quickly."""
    if isinstance(node, yaml.MappingNode) and node.tag == _TAG + "map":
        return _walk_mapping(node, path, doc)
    if isinstance(node, yaml.SequenceNode) and node.tag == _TAG + "seq":
        items = (_walk(item, (*path, str(i)), doc) for i, item in enumerate(node.value))
        return [item for item in items if item is not _DROP]
    if isinstance(node, yaml.ScalarNode) and node.tag in _SCALAR_TAGS:
        return _scalar(node, path, doc)
    if isinstance(node, yaml.ScalarNode) and node.tag == _TAG + "timestamp":
        return node.value  # an unquoted date stays text; the field's type decides whether that fits
    return doc.fail(node, path, f"unsupported YAML tag '{_short(node.tag)}'; only plain mappings, lists and "
                                "scalars are allowed")


def _walk_mapping(node: yaml.MappingNode, path: tuple[str, ...], doc: _Doc) -> dict:
    data: dict[str, Any] = {}
    first_line: dict[str, int] = {}
    for key_node, value_node in node.value:
        line = key_node.start_mark.line + 1
        if not (isinstance(key_node, yaml.ScalarNode) and key_node.tag == _TAG + "str"):
            doc.add(path, _key_problem(key_node), line)
            continue
        key = key_node.value
        if key in first_line:
            doc.add((*path, key), f"duplicate key (first at line {first_line[key]})", line)
            continue
        first_line[key] = line
        doc.lines[(*path, key)] = line
        value = _walk(value_node, (*path, key), doc)
        if value is _DROP:
            doc.dropped.add((*path, key))
        else:
            data[key] = value
    return data


def _scalar(node: yaml.ScalarNode, path: tuple[str, ...], doc: _Doc) -> Any:
    try:
        return SafeConstructor().construct_object(node)
    except (ValueError, KeyError, yaml.YAMLError):
        return doc.fail(node, path, f"cannot read {node.value!r} as {_short(node.tag)}")


def _key_problem(node: yaml.Node) -> str:
    if node.tag == _TAG + "merge":
        return "merge keys (<<) are not supported; write the fields out"
    if isinstance(node, yaml.ScalarNode):
        return f"key {node.value!r} is not a plain string (YAML reads it as {_short(node.tag)}); quote it"
    return "mapping keys must be plain strings"


def _short(tag: str) -> str:
    return tag.replace(_TAG, "!!", 1)


# --- checking each field -----------------------------------------------------------------------------


def _check_struct(cls: type[msgspec.Struct], data: Any, path: tuple[str, ...], doc: _Doc) -> list[Issue]:
    """Unknown, missing and mistyped fields of one section, each converted on its own."""
    if not isinstance(data, dict):
        hint = " (write {} to take every default)" if data is None else ""
        return [(path, f"expected a mapping, got {_kind(data)}{hint}")]
    fields = {f.name: f for f in msgspec.structs.fields(cls)}
    issues: list[Issue] = []
    for key, value in data.items():
        if key in fields:
            issues += _check_value(fields[key].type, value, (*path, key), doc)
        else:
            issues.append(((*path, key), f"unknown field; expected one of {', '.join(cls.__struct_fields__)}"))
    for name, info in fields.items():
        if info.required and name not in data and (*path, name) not in doc.dropped:
            issues.append(((*path, name), "missing required field"))
    return issues


def _check_value(tp: Any, value: Any, path: tuple[str, ...], doc: _Doc) -> list[Issue]:
    """Problems of one value against its annotated type; sections and mappings are checked per entry."""
    if tp == dict[str, ComponentSpec]:
        return _check_components(value, path, doc)
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):
        return _check_struct(tp, value, path, doc)
    if get_origin(tp) is dict and isinstance(value, dict):
        item_type = get_args(tp)[1]
        return [issue for key, item in value.items() for issue in _check_value(item_type, item, (*path, key), doc)]
    try:
        msgspec.convert(value, tp, strict=True)
    except msgspec.ValidationError as exc:
        return [(path, _type_problem(str(exc), value, tp))]
    return []


def _check_components(value: Any, path: tuple[str, ...], doc: _Doc) -> list[Issue]:
    """Exactly the six components, each a valid ComponentSpec."""
    if not isinstance(value, dict):
        return [(path, f"expected a mapping of components, got {_kind(value)}")]
    names = ", ".join(COMPONENTS)
    issues: list[Issue] = []
    for name, spec in value.items():
        if name in COMPONENTS and isinstance(spec, dict) and isinstance(spec.get("options"), dict):
            issues += _check_struct(OPTIONS[name], spec["options"], (*path, name, "options"), doc)
            spec = {key: item for key, item in spec.items() if key != "options"}  # checked just above
        if name in COMPONENTS:
            issues += _check_struct(ComponentSpec, spec, (*path, name), doc)
        else:
            issues.append(((*path, name), f"unknown component; expected one of {names}"))
    for name in COMPONENTS:
        if name not in value and (*path, name) not in doc.dropped:
            issues.append(((*path, name), f"missing component; a pipeline lists all of {names}"))
    return issues


def _type_problem(message: str, value: Any, tp: Any) -> str:
    if message.startswith("Invalid enum value"):
        message = "expected one of " + ", ".join(repr(choice) for choice in _choices(tp))
    return f"{message[0].lower()}{message[1:]} (value {value!r})"


def _choices(tp: Any) -> list[Any]:
    """The values of the Literal types in `tp`."""
    if get_origin(tp) is Literal:
        return list(get_args(tp))
    return [choice for arg in get_args(tp) for choice in _choices(arg)]


def _kind(value: Any) -> str:
    """What a YAML value is, in the file's terms."""
    kinds = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}
    return kinds.get(type(value), f"a number ({value!r})")


def _prune(data: dict, paths: list[tuple[str, ...]]) -> None:
    """Drop the values already reported, so the cross-field rules still run on the rest."""
    for path in filter(None, paths):
        parent: Any = data
        for key in path[:-1]:
            parent = parent.get(key) if isinstance(parent, dict) else None
        if isinstance(parent, dict):
            parent.pop(path[-1], None)


# --- rules across fields ---------------------------------------------------------------------------------

_INPROC_NAME = re.compile(r"[A-Za-z0-9._-]+")
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*")
_PORT = re.compile(r"[0-9]{1,5}")


def _cross_field_problems(p: Pipeline) -> list[Issue]:
    issues = _endpoint_syntax(p)
    valid = {c: spec.endpoint for c, spec in p.components.items() if endpoint_problem(spec.endpoint) is None}
    return (issues + _placement_rules(p, valid) + _tcp_needs_keys(p, valid) + _duplicate_endpoints(valid)
            + _shared_sockets(_socket_paths(p, valid)) + _long_sockets(p, _known_sockets(p, valid))
            + _path_problems(p))


def _endpoint_syntax(p: Pipeline) -> list[Issue]:
    return [(("components", c, "endpoint"), f"Invalid endpoint '{spec.endpoint}': {reason}")
            for c, spec in p.components.items() if (reason := endpoint_problem(spec.endpoint))]


def _placement_rules(p: Pipeline, endpoints: dict[str, str]) -> list[Issue]:
    """Threads share the launcher's process, so they talk over inproc; processes cannot."""
    issues: list[Issue] = []
    for c, endpoint in endpoints.items():
        scheme = endpoint.partition("://")[0]
        if placement_of(p, c) == "thread" and endpoint != "auto" and scheme != "inproc":
            issues.append((("components", c, "endpoint"),
                           f"'{endpoint}' with thread placement: a thread-placed component uses 'auto' or inproc://"))
        if placement_of(p, c) == "process" and scheme == "inproc":
            issues.append((("components", c, "endpoint"), f"'{endpoint}' with process placement: inproc:// only "
                                                          "works inside one process; use 'auto', ipc:// or tcp://"))
    return issues


def _tcp_needs_keys(p: Pipeline, endpoints: dict[str, str]) -> list[Issue]:
    """Anything reachable from other machines must be encrypted and authenticated with CURVE."""
    if p.security.keys_dir is not None:
        return []
    return [(("components", c, "endpoint"),
             f"binding a non-loopback address ('{endpoint}') without CURVE keys is refused; create keys with "
             "`dsv41 keys` and set security.keys_dir, or use 127.0.0.1")
            for c, endpoint in endpoints.items()
            if endpoint.startswith("tcp://") and not is_loopback_host(_tcp_host(endpoint))]


def _duplicate_endpoints(endpoints: dict[str, str]) -> list[Issue]:
    """inproc and tcp endpoints used twice; ipc paths are compared once resolved (`_shared_sockets`)."""
    owner: dict[str, str] = {}
    issues: list[Issue] = []
    for c, endpoint in endpoints.items():
        if endpoint == "auto" or endpoint.startswith("ipc://"):
            continue
        if endpoint in owner:
            issues.append((("components", c, "endpoint"),
                           f"endpoint '{endpoint}' is also used by components.{owner[endpoint]}"))
        owner.setdefault(endpoint, c)
    return issues


def _socket_paths(p: Pipeline, endpoints: dict[str, str]) -> dict[str, str]:
    """The ipc endpoint of each process component, 'auto' and relative paths put under the runtime
    directory (a stand-in when it is chosen at launch)."""
    runtime_dir = Path(p.runtime_dir).expanduser() if p.runtime_dir is not None else Path("$RUNTIME_DIR")
    concrete = {c: _concrete(p, c, runtime_dir) for c in endpoints}
    return {c: endpoint for c, endpoint in concrete.items() if endpoint.startswith("ipc://")}


def _shared_sockets(endpoints: dict[str, str]) -> list[Issue]:
    """Two components on one ipc socket (paths normalised, so two spellings of one socket compare
    equal): the second bind would fail at launch, or take the first one's traffic if the first is down."""
    owner: dict[str, str] = {}
    issues: list[Issue] = []
    for c, endpoint in endpoints.items():
        if not endpoint.startswith("ipc://"):
            continue
        path = os.path.normpath(endpoint.removeprefix("ipc://"))
        if path in owner:
            issues.append((("components", c, "endpoint"), f"socket path {path} is also used by "
                                                          f"components.{owner[path]}"))
        owner.setdefault(path, c)
    return issues


def _path_problems(p: Pipeline) -> list[Issue]:
    """Directories dsv41 writes into must not climb out with '..'; the files and directories it reads
    must exist, so a typo is found by `validate` rather than by a component that fails to start."""
    issues: list[Issue] = [(key, "'..' is not allowed in a directory dsv41 creates and writes; write the path "
                                 "without it")
                           for key, path in ((("runtime_dir",), p.runtime_dir), (("store", "path"), p.store.path))
                           if path is not None and ".." in Path(path).parts]
    if p.model.config not in BUILTIN_CONFIGS and not Path(p.model.config).expanduser().is_file():
        issues.append((("model", "config"), f"no such config file {p.model.config!r}; a built-in config "
                                            f"({', '.join(BUILTIN_CONFIGS)}) or a config.json path"))
    from dsv41.checkpoint import builtin_models, resolve_model_dir

    if p.model.checkpoint is not None and not resolve_model_dir(p.model.checkpoint).is_dir():
        issues.append((("model", "checkpoint"), f"no such directory {p.model.checkpoint!r}; a model directory or a "
                                                f"built-in model ({', '.join(builtin_models())})"))
    if p.security.keys_dir is not None and not Path(p.security.keys_dir).expanduser().is_dir():
        issues.append((("security", "keys_dir"), f"no such directory {p.security.keys_dir!r}"))
    return issues


def _known_sockets(p: Pipeline, endpoints: dict[str, str]) -> dict[str, str]:
    """The concrete endpoints known before launch: all of them once runtime_dir is set, else absolute ipc."""
    if p.runtime_dir is not None:
        return {c: _concrete(p, c, Path(p.runtime_dir).expanduser()) for c in endpoints}
    return {c: endpoint for c, endpoint in endpoints.items() if endpoint.startswith("ipc:///")}


def _long_sockets(p: Pipeline, endpoints: dict[str, str]) -> list[Issue]:
    """Unix socket paths over the kernel's limit; `endpoints` holds concrete endpoints."""
    issues: list[Issue] = []
    for c, endpoint in endpoints.items():
        socket = endpoint.removeprefix("ipc://")
        size = len(socket.encode())
        if endpoint.startswith("ipc://") and size > MAX_IPC_PATH:
            configured = p.components[c].endpoint
            shown = "" if configured == endpoint else f" {socket}"
            issues.append((("components", c, "endpoint"), f"Invalid endpoint '{configured}': socket path{shown} is "
                           f"{size} bytes; Unix sockets allow at most {MAX_IPC_PATH}"))
    return issues


def _concrete(p: Pipeline, component: str, runtime_dir: Path) -> str:
    """The endpoint `component` binds: 'auto' and relative ipc paths resolved."""
    endpoint = p.components[component].endpoint
    if endpoint == "auto" and placement_of(p, component) == "thread":
        return f"inproc://dsv41-{p.name}-{component}"
    if endpoint == "auto":
        return f"ipc://{runtime_dir / f'{component}.sock'}"
    if endpoint.startswith("ipc://") and not endpoint.startswith("ipc:///"):
        return f"ipc://{runtime_dir / endpoint.removeprefix('ipc://')}"
    return endpoint


def endpoint_problem(endpoint: str) -> str | None:
    """Why `endpoint` is not a usable endpoint, or None."""
    if endpoint == "auto":
        return None
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in _SCHEMES:
        return "expected 'auto', inproc://NAME, ipc://PATH or tcp://HOST:PORT"
    return _SCHEMES[scheme](rest)


def _inproc_problem(name: str) -> str | None:
    return None if _INPROC_NAME.fullmatch(name) else "inproc names use only letters, digits, '.', '_' and '-'"


def _ipc_problem(path: str) -> str | None:
    if not path:
        return "empty socket path"
    if ".." in Path(path).parts:
        return "'..' in the socket path; a relative path stays inside the runtime directory"
    return "NUL byte in the socket path" if "\0" in path else None


def _tcp_problem(address: str) -> str | None:
    host, sep, port = address.rpartition(":")
    if not sep:
        return "expected tcp://HOST:PORT"
    if not (_PORT.fullmatch(port) and 1 <= int(port) <= 65535):
        return f"port must be a number in 1..65535, got '{port}'"
    return _host_problem(host)


def _host_problem(host: str) -> str | None:
    if host == "*":
        return None
    if host.startswith("[") and host.endswith("]"):
        return None if _ip_version(host[1:-1]) == 6 else f"'{host[1:-1]}' is not an IPv6 address"
    if ":" in host:
        return "write IPv6 addresses in brackets, e.g. tcp://[::1]:5555"
    if re.fullmatch(r"[0-9.]+", host):
        return None if _ip_version(host) == 4 else f"'{host}' is not an IPv4 address"
    return None if _HOSTNAME.fullmatch(host) else f"'{host}' is not a valid host name"


def _ip_version(text: str) -> int | None:
    try:
        return ipaddress.ip_address(text).version
    except ValueError:
        return None


def _tcp_host(endpoint: str) -> str:
    return endpoint.removeprefix("tcp://").rpartition(":")[0].removeprefix("[").removesuffix("]")


_SCHEMES = {"inproc": _inproc_problem, "ipc": _ipc_problem, "tcp": _tcp_problem}
