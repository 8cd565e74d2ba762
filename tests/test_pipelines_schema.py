from pathlib import Path

import pytest

from dsv41.config import BUILTIN_CONFIGS
from dsv41.pipelines.schema import (
    BUILTIN_PIPELINES,
    COMPONENTS,
    MAX_FILE_BYTES,
    GenerationSpec,
    PipelineError,
    SecuritySpec,
    StoreSpec,
    SupervisorSpec,
    load_pipeline,
    placement_of,
    resolve_endpoints,
)

# Line numbers the tests rely on: name 1, model 2, seed 3, components 4, tokenizer 5 ... kvstore 10.
VALID = """\
name: t
model:
  seed: 0
components:
  tokenizer: {}
  engram: {}
  encoder: {}
  decoder: {}
  dspark: {}
  kvstore: {}
"""


def problems(tmp_path: Path, text: str) -> list[str]:
    """The problems reported for a pipeline file holding `text`."""
    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(PipelineError) as info:
        load_pipeline(path)
    assert str(info.value) == "\n".join(info.value.problems)
    return info.value.problems


def with_lines(text: str, **replacements: str) -> str:
    """`text` with whole lines replaced, keyed by their first word (`encoder`, `seed`, ...)."""
    lines = text.splitlines()
    for key, line in replacements.items():
        index = next(i for i, old in enumerate(lines) if old.strip().startswith(f"{key}:"))
        lines[index] = line
    return "\n".join(lines) + "\n"


def endpoints(**by_component: str) -> str:
    return with_lines(VALID, **{c: f'  {c}: {{endpoint: "{e}"}}' for c, e in by_component.items()})


@pytest.mark.parametrize("name", BUILTIN_PIPELINES)
def test_builtin_pipelines_load_with_all_components(name):
    p = load_pipeline(name)
    assert p.name == name and tuple(p.components) == COMPONENTS
    assert p.model.checkpoint == "small"  # the trained default model, by its built-in name


def test_local_lists_every_default_and_runs_components_as_processes():
    p = load_pipeline("local")
    assert (p.store, p.generation, p.supervisor, p.security) == (StoreSpec(), GenerationSpec(), SupervisorSpec(),
                                                                 SecuritySpec())
    assert p.runtime_dir is None and {placement_of(p, c) for c in COMPONENTS} == {"process"}
    assert resolve_endpoints(p, Path("/run/d"))["encoder"] == "ipc:///run/d/encoder.sock"


def test_inproc_runs_threads_on_inproc_endpoints():
    p = load_pipeline("inproc")
    assert {placement_of(p, c) for c in COMPONENTS} == {"thread"}
    assert resolve_endpoints(p, Path("/unused")) == {c: f"inproc://dsv41-inproc-{c}" for c in COMPONENTS}


def test_epd_binds_distinct_loopback_ports_without_keys():
    p = load_pipeline("epd")
    assert p.security.keys_dir is None
    ports = {c: f"tcp://127.0.0.1:{port}" for c, port in zip(COMPONENTS, range(29310, 29316), strict=True)}
    assert resolve_endpoints(p, Path("/unused")) == ports


def test_unknown_field_names_its_path_line_and_the_known_fields(tmp_path):
    found = problems(tmp_path, with_lines(VALID, encoder="  encoder: {endpont: auto}"))
    assert found == [f"{tmp_path / 'p.yaml'}:7: components.encoder.endpont: unknown field; "
                     "expected one of endpoint, placement, options"]


def test_typo_in_a_component_name_is_unknown_and_leaves_one_missing(tmp_path):
    found = problems(tmp_path, with_lines(VALID, encoder="  encodr: {}"))
    assert len(found) == 2
    assert found[0].endswith("p.yaml:4: components.encoder: missing component; a pipeline lists all of "
                             "tokenizer, engram, encoder, decoder, dspark, kvstore")
    assert found[1].endswith("p.yaml:7: components.encodr: unknown component; expected one of tokenizer, engram, "
                             "encoder, decoder, dspark, kvstore")


def test_missing_component_is_reported_at_the_components_line(tmp_path):
    (found,) = problems(tmp_path, with_lines(VALID, kvstore=""))
    assert found.endswith("p.yaml:4: components.kvstore: missing component; a pipeline lists all of "
                          "tokenizer, engram, encoder, decoder, dspark, kvstore")


def test_wrong_type_names_the_expected_type_and_the_value(tmp_path):
    (found,) = problems(tmp_path, with_lines(VALID, seed="  seed: many"))
    assert found.endswith("p.yaml:3: model.seed: expected `int`, got `str` (value 'many')")


@pytest.mark.parametrize(("section", "key", "message"), [
    ("store: {block_tokens: 8}", "store.block_tokens", "expected `int` >= 16 (value 8)"),
    ("store: {block_tokens: 40}", "store.block_tokens", "expected `int` that's a multiple of 16 (value 40)"),
    ("generation: {top_p: 0}", "generation.top_p", "expected `float` > 0.0 (value 0)"),
    ("generation: {prefill_mode: fast}", "generation.prefill_mode",
     "expected one of 'ced', 'exact', 'full' (value 'fast')"),
    ("supervisor: {max_restarts: -1}", "supervisor.max_restarts", "expected `int` >= 0 (value -1)"),
    ("scheduling: {steps_in_flight: 0}", "scheduling.steps_in_flight", "expected `int` >= 1 (value 0)"),
])
def test_out_of_range_and_invalid_values_are_reported(tmp_path, section, key, message):
    (found,) = problems(tmp_path, VALID + section + "\n")
    assert found.endswith(f"p.yaml:11: {key}: {message}")


def test_pipeline_names_are_short_lowercase_words(tmp_path):
    (found,) = problems(tmp_path, with_lines(VALID, name="name: Not-Lowercase"))
    assert found.endswith("p.yaml:1: name: expected `str` matching regex '^[a-z0-9_-]{1,32}$' (value 'Not-Lowercase')")


def test_python_tags_are_refused_not_executed(tmp_path, capfd):
    text = VALID + 'security:\n  keys_dir: !!python/object/apply:os.system ["echo hi"]\n'
    (found,) = problems(tmp_path, text)
    assert found.endswith("p.yaml:12: security.keys_dir: unsupported YAML tag '!!python/object/apply:os.system'; "
                          "only plain mappings, lists and scalars are allowed")
    assert "hi" not in capfd.readouterr().out


def test_every_problem_of_a_file_is_reported_at_once_in_file_order(tmp_path):
    text = with_lines(VALID, seed="  seed: -1", engram="  engram: {options: {prefetch: [1], prefetch_steps: 2}}",
                      encoder="  encodr: {}", dspark='  dspark: {endpoint: "tcp://0.0.0.0:5555"}')
    text += "generation:\n  temprature: 0.5\n  temperature: 0.5\n  temperature: 1\n"
    found = [line.split("p.yaml:", 1)[1] for line in problems(tmp_path, text)]
    assert found == [
        "3: model.seed: expected `int` >= 0 (value -1)",
        "4: components.encoder: missing component; a pipeline lists all of tokenizer, engram, encoder, decoder, "
        "dspark, kvstore",
        "6: components.engram.options.prefetch: expected `bool`, got `array` (value [1])",
        "6: components.engram.options.prefetch_steps: expected `bool`, got `int` (value 2)",
        "7: components.encodr: unknown component; expected one of tokenizer, engram, encoder, decoder, dspark, "
        "kvstore",
        "9: components.dspark.endpoint: binding a non-loopback address ('tcp://0.0.0.0:5555') without CURVE keys is "
        "refused; create keys with `dsv41 keys` and set security.keys_dir, or use 127.0.0.1",
        "12: generation.temprature: unknown field; expected one of max_new_tokens, prefill_mode, chunk_size, "
        "temperature, top_p, request_timeout_s",
        "14: generation.temperature: duplicate key (first at line 13)",
    ]


@pytest.mark.parametrize("endpoint", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5555", "tcp://[::]:5555",
                                      "tcp://node7.cluster:5555"])
def test_non_loopback_tcp_needs_curve_keys(tmp_path, endpoint):
    (found,) = problems(tmp_path, endpoints(decoder=endpoint))
    assert "p.yaml:8: components.decoder.endpoint: binding a non-loopback address" in found
    assert "without CURVE keys is refused" in found and "`dsv41 keys`" in found
    path = tmp_path / "keys.yaml"
    path.write_text(endpoints(decoder=endpoint) + f"security: {{keys_dir: {tmp_path}}}\n")
    assert resolve_endpoints(load_pipeline(path), tmp_path)["decoder"] == endpoint


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:5555", "tcp://localhost:5555", "tcp://[::1]:5555"])
def test_loopback_tcp_needs_no_keys(tmp_path, endpoint):
    path = tmp_path / "p.yaml"
    path.write_text(endpoints(decoder=endpoint))
    assert load_pipeline(path).components["decoder"].endpoint == endpoint


@pytest.mark.parametrize(("endpoint", "reason"), [
    ("tcp://127.0.0.1", "expected tcp://HOST:PORT"),
    ("tcp://127.0.0.1:0", "port must be a number in 1..65535, got '0'"),
    ("tcp://127.0.0.1:65536", "port must be a number in 1..65535, got '65536'"),
    ("tcp://::1:5555", "write IPv6 addresses in brackets, e.g. tcp://[::1]:5555"),
    ("tcp://[1.2.3.4]:5555", "'1.2.3.4' is not an IPv6 address"),
    ("tcp://300.1.1.1:5555", "'300.1.1.1' is not an IPv4 address"),
    ("tcp://bad_host:5555", "'bad_host' is not a valid host name"),
    ("udp://127.0.0.1:5555", "expected 'auto', inproc://NAME, ipc://PATH or tcp://HOST:PORT"),
    ("ipc://", "empty socket path"),
    ("inproc://a b", "inproc names use only letters, digits, '.', '_' and '-'"),
])
def test_malformed_endpoints_are_explained(tmp_path, endpoint, reason):
    placement = "thread" if endpoint.startswith("inproc") else "process"
    text = with_lines(VALID, encoder=f'  encoder: {{endpoint: "{endpoint}", placement: {placement}}}')
    (found,) = problems(tmp_path, text)
    assert found.endswith(f"p.yaml:7: components.encoder.endpoint: Invalid endpoint '{endpoint}': {reason}")


def test_ipc_paths_over_107_bytes_are_refused(tmp_path):
    fits = "/" + "a" * 99 + "/x.sock"
    assert len(fits) == 107
    path = tmp_path / "fits.yaml"
    path.write_text(endpoints(encoder=f"ipc://{fits}"))
    assert load_pipeline(path).components["encoder"].endpoint == f"ipc://{fits}"
    (found,) = problems(tmp_path, endpoints(encoder=f"ipc://{fits}x"))
    assert found.endswith(f"p.yaml:7: components.encoder.endpoint: Invalid endpoint 'ipc://{fits}x': "
                          "socket path is 108 bytes; Unix sockets allow at most 107")


def test_a_long_runtime_dir_is_refused_for_auto_ipc_sockets(tmp_path):
    runtime_dir = "/" + "r" * 100
    found = problems(tmp_path, VALID + f"runtime_dir: {runtime_dir}\n")
    assert len(found) == 6
    assert found[2].endswith(f"p.yaml:7: components.encoder.endpoint: Invalid endpoint 'auto': socket path "
                             f"{runtime_dir}/encoder.sock is 114 bytes; Unix sockets allow at most 107")
    with pytest.raises(PipelineError, match=r"^components.tokenizer.endpoint: Invalid endpoint 'auto': socket path "):
        resolve_endpoints(load_pipeline("local"), Path(runtime_dir))


def test_inproc_needs_thread_placement_and_threads_need_inproc(tmp_path):
    thread_on_ipc = "  decoder: {endpoint: ipc://d.sock, placement: thread}"
    text = with_lines(endpoints(encoder="inproc://enc"), decoder=thread_on_ipc)
    found = problems(tmp_path, text)
    assert found == [
        f"{tmp_path / 'p.yaml'}:7: components.encoder.endpoint: 'inproc://enc' with process placement: inproc:// "
        "only works inside one process; use 'auto', ipc:// or tcp://",
        f"{tmp_path / 'p.yaml'}:8: components.decoder.endpoint: 'ipc://d.sock' with thread placement: a "
        "thread-placed component uses 'auto' or inproc://",
    ]
    path = tmp_path / "ok.yaml"
    path.write_text(with_lines(VALID, encoder="  encoder: {endpoint: inproc://enc, placement: thread}"))
    p = load_pipeline(path)
    assert placement_of(p, "encoder") == "thread" and placement_of(p, "decoder") == "process"


def test_two_components_on_one_endpoint_are_refused(tmp_path):
    (found,) = problems(tmp_path, endpoints(encoder="tcp://127.0.0.1:6000", dspark="tcp://127.0.0.1:6000"))
    assert found.endswith("p.yaml:9: components.dspark.endpoint: endpoint 'tcp://127.0.0.1:6000' is also used by "
                          "components.encoder")


def test_duplicate_yaml_keys_are_refused(tmp_path):
    found = problems(tmp_path, VALID + "name: u\n")
    assert found == [f"{tmp_path / 'p.yaml'}:11: name: duplicate key (first at line 1)"]


BOMB = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" for i in range(1, 10))


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("text", "line"), [
    (with_lines(VALID, model="model: &m", seed="  seed: *m"), 2),  # a recursive alias
    ("l0: &l0 [lol, lol]\n" + BOMB, 1),  # billion laughs: 2 * 9^9 strings once expanded
    (with_lines(VALID, seed="  seed: &s 1") + "other: *s\n", 3),  # an anchor is refused where it is set
])
def test_anchors_and_aliases_are_refused_before_anything_expands(tmp_path, text, line):
    (found,) = problems(tmp_path, text)
    assert found.endswith(f"p.yaml:{line}: invalid YAML: anchors and aliases (&name, *name) are not supported; "
                          "write the values out")


@pytest.mark.timeout(10)
@pytest.mark.parametrize("nested", ["[" * 5000 + "]" * 5000, "{a: " * 5000 + "1" + "}" * 5000,
                                    "".join(f"{'  ' * i}k:\n" for i in range(200)) + "  " * 200 + "k: 1"])
def test_deep_nesting_is_refused_without_recursing(tmp_path, nested):
    (found,) = problems(tmp_path, "name: " + nested + "\n" if nested[0] in "[{" else nested + "\n")
    assert "invalid YAML: nested more than 16 levels deep" in found


def test_a_file_over_the_size_limit_is_not_read(tmp_path):
    (found,) = problems(tmp_path, VALID + "#" * MAX_FILE_BYTES)
    assert found.endswith(f"p.yaml: the file is over {MAX_FILE_BYTES} bytes; a pipeline file is a few KB")


def test_component_options_are_checked_by_name_type_and_range(tmp_path):
    text = with_lines(VALID, encoder="  encoder: {options: {threads: -1, kv_pages: -5}}",
                      decoder="  decoder: {options: {kv_pages: 1099511627776, threads: 2.5}}",
                      engram="  engram: {options: {rows_timeout_s: .inf, colour: red, tables: null}}",
                      dspark="  dspark: {options: {kv_pages: 4}}")
    found = [line.split("p.yaml:", 1)[1] for line in problems(tmp_path, text)]
    assert found == [
        "6: components.engram.options.rows_timeout_s: expected `float` <= 600.0 (value inf)",
        "6: components.engram.options.colour: unknown field; expected one of threads, prefetch, prefetch_steps, "
        "tables, rows_timeout_s",
        "6: components.engram.options.tables: expected `str`, got `null` (value None)",
        "7: components.encoder.options.threads: expected `int` >= 1 (value -1)",
        "7: components.encoder.options.kv_pages: expected `int` >= 1 (value -5)",
        f"8: components.decoder.options.kv_pages: expected `int` <= {1 << 24} (value 1099511627776)",
        "8: components.decoder.options.threads: expected `int`, got `float` (value 2.5)",
        "9: components.dspark.options.kv_pages: unknown field; expected one of threads, mode, length",
    ]


def test_numbers_have_finite_ranges(tmp_path):
    text = VALID + ("store:\n  capacity_gib: 2305843009213693952\n  swa_pool_gib: .inf\n"
                    "generation:\n  temperature: .nan\n  top_p: .inf\n  request_timeout_s: .inf\n")
    found = [line.split("p.yaml:", 1)[1] for line in problems(tmp_path, text)]
    assert found == [
        "12: store.capacity_gib: expected `float` <= 16384.0 (value 2305843009213693952)",
        "13: store.swa_pool_gib: expected `float` <= 1024.0 (value inf)",
        "15: generation.temperature: expected `float` >= 0.0 (value nan)",
        "16: generation.top_p: expected `float` <= 1.0 (value inf)",
        "17: generation.request_timeout_s: expected `float` <= 86400.0 (value inf)",
    ]


def test_missing_config_checkpoint_and_keys_are_refused(tmp_path):
    text = with_lines(VALID, seed=f"  config: {tmp_path}/none.json\n  checkpoint: {tmp_path}/ckpt") + \
        f"security:\n  keys_dir: {tmp_path}/keys\n"
    found = [line.split("p.yaml:", 1)[1] for line in problems(tmp_path, text)]
    assert found == [
        f"3: model.config: no such config file '{tmp_path}/none.json'; a built-in config "
        f"({', '.join(BUILTIN_CONFIGS)}) or a config.json path",
        f"4: model.checkpoint: no such directory '{tmp_path}/ckpt'; a model directory or a built-in model (small)",
        f"13: security.keys_dir: no such directory '{tmp_path}/keys'",
    ]
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "keys").mkdir()
    (tmp_path / "none.json").write_text("{}")
    assert load_pipeline(tmp_path / "p.yaml").model.checkpoint == f"{tmp_path}/ckpt"
    (tmp_path / "builtin.yaml").write_text(text.replace(f"checkpoint: {tmp_path}/ckpt", "checkpoint: small"))
    assert load_pipeline(tmp_path / "builtin.yaml").model.checkpoint == "small"  # a built-in model's name


@pytest.mark.parametrize(("field", "line"), [("runtime_dir: /run/a/../b", 11), ("store: {path: ../kv}", 11)])
def test_dot_dot_is_refused_in_directories_dsv41_writes(tmp_path, field, line):
    (found,) = problems(tmp_path, VALID + field + "\n")
    assert found.endswith(f"p.yaml:{line}: {field.split(':')[0].replace('store', 'store.path')}: '..' is not "
                          "allowed in a directory dsv41 creates and writes; write the path without it")


@pytest.mark.parametrize("endpoint", ["ipc://../up.sock", "ipc://a/../../up.sock", "ipc:///run/x/../y.sock"])
def test_dot_dot_is_refused_in_ipc_paths(tmp_path, endpoint):
    (found,) = problems(tmp_path, endpoints(encoder=endpoint))
    assert found.endswith(f"p.yaml:7: components.encoder.endpoint: Invalid endpoint '{endpoint}': '..' in the "
                          "socket path; a relative path stays inside the runtime directory")


@pytest.mark.parametrize(("by_component", "shared"), [
    ({"encoder": "ipc://tokenizer.sock"}, "$RUNTIME_DIR/tokenizer.sock"),  # the tokenizer's auto socket
    ({"encoder": "ipc://a.sock", "dspark": "ipc://./a.sock"}, "$RUNTIME_DIR/a.sock"),
    ({"encoder": "ipc:///tmp/s.sock", "dspark": "ipc:///tmp//s.sock"}, "/tmp/s.sock"),
])
def test_two_components_on_one_ipc_socket_are_refused(tmp_path, by_component, shared):
    (found,) = problems(tmp_path, endpoints(**by_component))
    user = "encoder" if len(by_component) == 1 else "dspark"
    owner = "tokenizer" if len(by_component) == 1 else "encoder"
    assert found.endswith(f"components.{user}.endpoint: socket path {shared} is also used by components.{owner}")


def test_launch_refuses_two_components_on_one_socket_once_the_runtime_dir_is_known(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(endpoints(dspark="ipc:///run/t/encoder.sock"))
    with pytest.raises(PipelineError, match=r"components\.dspark\.endpoint: socket path /run/t/encoder\.sock is "
                                            r"also used by components\.encoder"):
        resolve_endpoints(load_pipeline(path), Path("/run/t"))


def test_keys_yaml_reads_as_non_strings_are_refused(tmp_path):
    (found,) = problems(tmp_path, VALID + "yes: 1\n")
    assert found.endswith("p.yaml:11: root: key 'yes' is not a plain string (YAML reads it as !!bool); quote it")


@pytest.mark.parametrize(("text", "message"), [
    ("", "p.yaml:1: root: the file is empty; expected a pipeline mapping"),
    ("# only a comment\n", "p.yaml:1: root: the file is empty; expected a pipeline mapping"),
    ("- local\n", "p.yaml:1: root: expected a mapping at the top level, got a list"),
    ("name: [t\n", "p.yaml:2: invalid YAML: while parsing a flow sequence"),
    (VALID + "---\n" + VALID, "p.yaml:11: invalid YAML: expected a single document in the stream, but found another"),
])
def test_unusable_files_get_one_clear_problem(tmp_path, text, message):
    (found,) = problems(tmp_path, text)
    assert message in found


def test_unknown_source_names_the_built_in_pipelines():
    with pytest.raises(PipelineError, match=r"^nowhere\.yaml: no such file, and not a built-in pipeline name "
                                            r"\(local, inproc, epd\)$"):
        load_pipeline("nowhere.yaml")


def test_resolve_endpoints_puts_auto_and_relative_ipc_under_the_runtime_dir(tmp_path):
    text = with_lines(VALID, encoder="  encoder: {endpoint: ipc://enc.sock}",
                      decoder="  decoder: {placement: thread}", dspark='  dspark: {endpoint: "ipc:///tmp/ds.sock"}')
    path = tmp_path / "p.yaml"
    path.write_text(text)
    assert resolve_endpoints(load_pipeline(path), Path("/run/t")) == {
        "tokenizer": "ipc:///run/t/tokenizer.sock",
        "engram": "ipc:///run/t/engram.sock",
        "encoder": "ipc:///run/t/enc.sock",
        "decoder": "inproc://dsv41-t-decoder",
        "dspark": "ipc:///tmp/ds.sock",
        "kvstore": "ipc:///run/t/kvstore.sock",
    }
