"""The OpenAI-compatible HTTP front end: the official `openai` client against a served pipeline on
loopback, every error path with its status and body, reasoning and tool calls (against a scripted
dspark that stands in for a model that writes them), cancellation and the metrics."""

from __future__ import annotations

import http.client
import json
import shutil
import threading
import time
from pathlib import Path

import openai
import pytest
import zmq

from dsv41 import messages as m
from dsv41.components.runtime import make_socket
from dsv41.model.tokenizer import byte_tokenizer
from dsv41.pipelines.launch import Supervisor, with_overrides
from dsv41.pipelines.schema import resolve_endpoints
from dsv41.serving.server import HTTPServer, build_app
from tests.helpers.pipelines import pipeline_for, short_dir

pytestmark = pytest.mark.timeout(300)
LONG = "The quick brown fox jumps over the lazy dog. " * 3  # 135 byte tokens: two 64-token blocks


def post(url: str, path: str, body: bytes | dict, headers: dict | None = None) -> tuple[int, dict, dict]:
    """Status, JSON body and headers of one raw HTTP request (what a client that is not `openai` sees)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    raw = response.read()
    conn.close()
    return response.status, json.loads(raw), dict(response.getheaders())


def get(url: str, path: str, headers: dict | None = None) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("GET", path, headers=headers or {})
    response = conn.getresponse()
    text = response.read().decode()
    conn.close()
    return response.status, text


def metric(text: str, name: str, labels: str = "") -> float:
    for line in text.splitlines():
        if line.startswith(name + ("{" if labels or "{" in line.split(" ")[0] else " ")) and labels in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{{{labels}}} not in the metrics")


def wait_for(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def served():
    """The micro model in threads, served on loopback; 64-token blocks, so only the prompts meant to hit
    the prefix cache do (a hit's bounded replay changes the numbers a little)."""
    root = short_dir()
    pipeline = with_overrides(pipeline_for("thread", root, block_tokens=64),
                              generation={"request_timeout_s": 60.0, "chunk_size": 16})
    supervisor = Supervisor(pipeline, root / "run").start()
    server = HTTPServer(build_app(pipeline, supervisor.endpoints, root / "run"))
    try:
        yield server, supervisor
    finally:
        server.stop()
        supervisor.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_chat_streaming_and_completions_through_the_openai_client(client):
    assert [model.id for model in client.models.list()] == ["micro"]
    messages = [{"role": "user", "content": "Say hello."}]
    reply = client.chat.completions.create(model="micro", messages=messages, max_tokens=8, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason in ("length", "stop") and isinstance(choice.message.content, str)
    assert reply.usage.completion_tokens == 8 if choice.finish_reason == "length" else reply.usage.completion_tokens
    # "<｜begin▁of▁sentence｜><｜User｜>Say hello.<｜Assistant｜></think>" in byte tokens
    assert reply.usage.prompt_tokens == 1 + len("<｜User｜>Say hello.<｜Assistant｜></think>".encode())
    chunks = list(client.chat.completions.create(model="micro", messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        choice.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == reply.usage.completion_tokens
    completion = client.completions.create(model="micro", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert completion.choices[0].finish_reason in ("length", "stop") and completion.usage.prompt_tokens == 17
    streamed = client.completions.create(model="micro", prompt="Once upon a time", max_tokens=5, temperature=0,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text


def test_a_repeated_prompt_reports_cached_tokens(client):
    first = client.completions.create(model="micro", prompt=LONG, max_tokens=2, temperature=0)
    second = client.completions.create(model="micro", prompt=LONG, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == 136
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 128  # two blocks; the last token always runs


def test_stop_strings_and_seeded_sampling(client):
    base = client.completions.create(model="micro", prompt="abc", max_tokens=12, temperature=0)
    text = base.choices[0].text
    if len(text) >= 4:
        stop = text[2:4]
        cut = client.completions.create(model="micro", prompt="abc", max_tokens=12, temperature=0, stop=[stop])
        assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[: text.index(stop)]
    sampled = [client.completions.create(model="micro", prompt="abc", max_tokens=6, temperature=1.0, seed=seed)
               .choices[0].text for seed in (5, 5)]
    assert sampled[0] == sampled[1]


@pytest.mark.parametrize(("body", "param", "text"), [
    ({"n": 2}, "n", "n=2 is not supported"),
    ({"logit_bias": {"1": 5}}, "logit_bias", "not supported"),
    ({"logprobs": True}, "logprobs", "not supported"),
    ({"presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({"bogus": 1}, "bogus", "Unrecognized request argument supplied: bogus"),
    ({"temperature": -1}, "temperature", "temperature must be a number in [0.0, 100.0]"),
    ({"top_p": 0}, "top_p", "top_p must be a number in (0.0, 1.0]"),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be an integer in [1, 4096]"),
    ({"stop": 3}, "stop", "stop must be a string or a list"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed with stream: true"),
    ({"tool_choice": "required"}, "tool_choice", "not supported"),
    ({"messages": []}, "messages", "messages must be a non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0]", "role is one of"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "image URLs are not fetched"),
    ({"reasoning_effort": "medium", "thinking": {"type": "enabled"}}, "reasoning_effort", "reasoning_effort must be"),
    ({"thinking": {"type": "on"}}, "thinking", "thinking must be"),
])
def test_bad_chat_parameters_are_refused_by_name(served, body, param, text):
    status, answer, _ = post(served[0].url, "/v1/chat/completions",
                             {"model": "micro", "messages": [{"role": "user", "content": "hi"}], **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param and text in answer["error"]["message"]
    assert answer["error"]["type"] == "invalid_request_error"


def test_error_paths_have_openai_bodies(served):
    url = served[0].url
    status, answer, _ = post(url, "/v1/chat/completions", b'{"model": "micro", "messages": [')
    assert status == 400 and answer["error"]["code"] == "invalid_json"
    assert "not valid JSON" in answer["error"]["message"]
    status, answer, _ = post(url, "/v1/completions", b"[1, 2]")
    assert status == 400 and answer["error"]["message"] == "the request body must be a JSON object"
    status, answer, _ = post(url, "/v1/completions", {"model": "micro", "prompt": "x" * (33 << 20)})
    assert status == 413 and answer["error"]["code"] == "request_too_large"
    status, answer, _ = post(url, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert status == 404 and answer["error"]["code"] == "model_not_found" and "`micro`" in answer["error"]["message"]
    status, answer, _ = post(url, "/v1/completions", {"model": "micro", "prompt": "x" * 4000, "max_tokens": 200})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"
    assert "maximum context length is 4096 tokens" in answer["error"]["message"]
    assert "4201 tokens (4001 in the prompt, 200 in the completion)" in answer["error"]["message"]
    status, answer, _ = post(url, "/v1/completions", {"model": "micro", "prompt": ["a", "b"]})
    assert status == 400 and answer["error"]["param"] == "prompt"
    assert "one prompt per request" in answer["error"]["message"]
    status, answer, _ = post(url, "/v1/completions", {"model": "micro", "prompt": [5, 320]})
    assert status == 400 and "token ids must be in [0, 320)" in answer["error"]["message"]
    status, answer, _ = post(url, "/v1/nothing", {})
    assert status == 404 and answer["error"]["message"] == "Not Found"
    assert get(url, "/health")[0] == 200


def test_health_and_requests_answer_503_when_the_pipeline_is_down():
    root = short_dir()
    pipeline = with_overrides(pipeline_for("process", root), name="down")
    endpoints = resolve_endpoints(pipeline, root)  # ipc sockets that nothing has bound
    with HTTPServer(build_app(pipeline, endpoints, root)) as server:
        status, body = get(server.url, "/health")
        assert status == 503 and "components down: kvstore, tokenizer, decoder, encoder, engram, dspark" in body
        status, answer, _ = post(server.url, "/v1/completions", {"model": "micro", "prompt": "hi", "max_tokens": 2})
        assert status == 503 and answer["error"]["code"] == "service_unavailable"
        assert "dspark: not reachable" in answer["error"]["message"]
        status, text = get(server.url, "/metrics")
        assert status == 200 and metric(text, "dsv41_component_up", 'component="dspark"') == 0
    shutil.rmtree(root, ignore_errors=True)


def test_the_api_key_is_required_on_every_route_but_health_when_set(served):
    _, supervisor = served
    root = short_dir()
    with HTTPServer(build_app(supervisor.pipeline, supervisor.endpoints, root, api_key="s3cret")) as server:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for path in ("/v1/completions", "/v1/chat/completions", "/nothing"):
                status, answer, _ = post(server.url, path, {"model": "micro", "prompt": "hi"}, headers)
                assert status == 401 and answer["error"]["code"] == "invalid_api_key", (path, headers)
            for path in ("/metrics", "/v1/models"):
                assert get(server.url, path, headers)[0] == 401, (path, headers)
        status, text = get(server.url, "/metrics", {"Authorization": "Bearer s3cret"})
        assert status == 200 and "vllm:num_requests_running" in text
        ok = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert ok.completions.create(model="micro", prompt="hi", max_tokens=1).usage.completion_tokens == 1
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
        assert get(server.url, "/health")[0] == 200  # probes need no key
    shutil.rmtree(root, ignore_errors=True)


def test_a_client_that_disconnects_has_its_request_cancelled_and_pages_freed(served):
    server, supervisor = served
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"model": "micro", "prompt": LONG + "!", "max_tokens": 2000,
                                                        "stream": True, "temperature": 0}),
                 {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    response.fp.readline()  # the first event: the request is decoding
    _, text = get(server.url, "/metrics")
    assert metric(text, "vllm:num_requests_running") == 1
    assert metric(text, "dsv41_kv_pages_in_use", 'component="encoder"') > 0
    conn.sock.shutdown(2)
    conn.close()

    def idle() -> bool:
        text = get(server.url, "/metrics")[1]
        return (metric(text, "vllm:num_requests_running") == 0
                and metric(text, "dsv41_kv_pages_in_use", 'component="encoder"') == 0
                and metric(text, "dsv41_kv_pages_in_use", 'component="decoder"') == 0)

    wait_for(idle)
    text = get(server.url, "/metrics")[1]
    assert metric(text, "vllm:request_success_total", 'finished_reason="abort"') >= 1
    peer = supervisor.peer("dspark")
    try:
        counters = peer.ping().counters
    finally:
        peer.close()
    assert counters["cancelled"] >= 1 and counters["running"] == 0 and counters.get("waiting", 0) == 0


def test_a_full_queue_answers_429_with_retry_after_and_loses_nothing():
    """One running slot and one waiting place: a third request, streaming or not, is refused with 429,
    the configured Retry-After and the OpenAI error body (the official client raises RateLimitError);
    the queued request is still served once the running one goes away."""
    root = short_dir()
    pipeline = with_overrides(pipeline_for("thread", root, block_tokens=64), name="full-queue",
                              generation={"request_timeout_s": 60.0, "chunk_size": 16},
                              scheduling={"max_running": 1, "max_waiting": 1, "retry_after_s": 7})
    supervisor = Supervisor(pipeline, root / "run").start()
    server = HTTPServer(build_app(pipeline, supervisor.endpoints, root / "run"))
    try:
        host, port = server.url.removeprefix("http://").split(":")
        running = http.client.HTTPConnection(host, int(port), timeout=60)
        running.request("POST", "/v1/completions", json.dumps({"model": "micro", "prompt": LONG + "!",
                                                               "max_tokens": 2000, "stream": True,
                                                               "temperature": 0}),
                        {"Content-Type": "application/json"})
        response = running.getresponse()
        assert response.status == 200
        response.fp.readline()  # decoding: the one running slot is taken
        queued = {}
        waiter = threading.Thread(target=lambda: queued.update(answer=post(
            server.url, "/v1/completions", {"model": "micro", "prompt": "hi", "max_tokens": 3, "temperature": 0})))
        waiter.start()
        wait_for(lambda: metric(get(server.url, "/metrics")[1], "vllm:num_requests_waiting") == 1)

        for stream in (False, True):
            status, answer, headers = post(server.url, "/v1/completions",
                                           {"model": "micro", "prompt": "hey", "max_tokens": 3, "stream": stream})
            assert status == 429 and headers["retry-after"] == "7", (stream, status, headers)
            assert answer["error"]["type"] == "rate_limit_error" and answer["error"]["code"] == "rate_limit_exceeded"
            assert "the queue is full: 1 requests wait" in answer["error"]["message"]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError) as refused:
            client.chat.completions.create(model="micro", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert refused.value.response.headers["retry-after"] == "7"
        assert waiter.is_alive()  # still queued behind the running request

        running.sock.shutdown(2)  # the running client goes away: its slot frees and the queued one runs
        running.close()
        waiter.join(60)
        status, answer, _ = queued["answer"]
        assert status == 200 and answer["usage"]["completion_tokens"] == 3
        text = get(server.url, "/metrics")[1]
        assert metric(text, "vllm:num_requests_running") == 0 and metric(text, "vllm:num_requests_waiting") == 0
    finally:
        server.stop()
        supervisor.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_a_prompt_that_can_never_fit_the_kv_pages_answers_429():
    """Pools of 8 pages of 128 entries: a 1,500-token prompt cannot fit even alone, so it is refused at
    once (429, not queued forever); a short prompt is served afterwards."""
    root = short_dir()
    pages = {"encoder": {"kv_pages": 8}, "decoder": {"kv_pages": 8}}
    pipeline = with_overrides(pipeline_for("thread", root, block_tokens=64, **pages), name="few-pages",
                              generation={"request_timeout_s": 60.0, "chunk_size": 16})
    supervisor = Supervisor(pipeline, root / "run").start()
    server = HTTPServer(build_app(pipeline, supervisor.endpoints, root / "run"))
    try:
        prompt = [(7 * i) % 300 + 10 for i in range(1500)]
        status, answer, headers = post(server.url, "/v1/completions", {"model": "micro", "prompt": prompt,
                                                                       "max_tokens": 2})
        assert status == 429 and headers["retry-after"] == "1"
        assert answer["error"]["type"] == "rate_limit_error" and answer["error"]["code"] == "rate_limit_exceeded"
        assert "main KV page pool is full" in answer["error"]["message"] and "of 8 pages" in answer["error"]["message"]
        status, answer, _ = post(server.url, "/v1/completions", {"model": "micro", "prompt": "hi", "max_tokens": 2})
        assert status == 200 and answer["usage"]["completion_tokens"] == 2
        # The refused prompt's partly taken pages went back, and the short one's once its release reached
        # each component (dspark sends a finished request's Release after its reply, through the encoder).
        def pages_back() -> bool:
            text = get(server.url, "/metrics")[1]
            return all(metric(text, "dsv41_kv_pages_in_use", f'component="{c}"') == 0 for c in ("encoder", "decoder"))

        wait_for(pages_back, timeout_s=15.0)
    finally:
        server.stop()
        supervisor.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_metrics_use_the_vllm_names(served, client):
    client.completions.create(model="micro", prompt=LONG, max_tokens=3, temperature=0)
    status, text = get(served[0].url, "/metrics")
    assert status == 200
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:request_success_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_bucket", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "dsv41_replayed_layer_tokens_total", "dsv41_kv_pages_in_use",
                 "dsv41_swa_pool_entries", "dsv41_swa_pool_bytes", "dsv41_swa_pool_ttl_evictions_total",
                 "dsv41_store_read_bytes_total", "dsv41_store_written_bytes_total", "dsv41_store_size_bytes",
                 "dsv41_store_reader_slots_freed_total",
                 "dsv41_engram_wait_seconds_bucket", "dsv41_spec_decode_mean_acceptance_length",
                 "vllm:spec_decode_num_accepted_tokens_total"):
        assert f"\n{name}" in text, name
    assert metric(text, "vllm:prefix_cache_hits_total") >= 128  # the repeated prompt above
    assert metric(text, "vllm:prefix_cache_queries_total") > metric(text, "vllm:prefix_cache_hits_total")
    assert metric(text, "dsv41_store_written_bytes_total") > 0 and metric(text, "dsv41_store_size_bytes") > 0
    assert metric(text, "dsv41_store_read_bytes_total") > 0 and metric(text, "dsv41_swa_pool_entries") > 0
    assert metric(text, "dsv41_spec_decode_mean_acceptance_length") == 0


# --- a scripted dspark: what a model that reasons and calls tools sends back ---------------------------

class ScriptedDspark:
    """A ROUTER at dspark's endpoint that answers every Generate with a script's text one character per
    token, then Finished (EOS), and records the prompts it was sent: script[1] once a tool result is in
    the prompt, else script[0]."""

    def __init__(self, endpoint: str, script: list[str]):
        self.script, self.prompts = script, []
        self.sock = make_socket(zmq.Context.instance(), zmq.ROUTER, endpoint, bind=True)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        tok = byte_tokenizer(320)
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            identity, *parts = self.sock.recv_multipart()
            message, _ = m.decode(parts)
            if not isinstance(message, m.Generate):
                continue
            ids = m.unpack_ids(message.ids)
            self.prompts.append(tok.decode(ids, skip_special_tokens=False))
            text = self.script[-1 if "<tool_result>" in self.prompts[-1] else 0]
            for ch in text:
                self.sock.send_multipart([identity, *m.encode(m.TokenEvent(request_id=message.request_id, token=7,
                                                                           text=ch))])
            self.sock.send_multipart([identity, *m.encode(m.TokenEvent(request_id=message.request_id, token=1,
                                                                       text=""))])
            self.sock.send_multipart([identity, *m.encode(m.Finished(
                request_id=message.request_id, reason=m.FinishReason.EOS, prompt_tokens=len(ids),
                generated_tokens=len(text) + 1, cached_tokens=0, replayed_layer_tokens=0, encoder_layer_tokens=0,
                ttft_s=0.0, decode_s=0.0))])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close(0)


CALL = ('I will look it up.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>')
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}


@pytest.fixture
def scripted():
    root = short_dir()
    pipeline = with_overrides(pipeline_for("thread", root), name="scripted")
    endpoints = resolve_endpoints(pipeline, root)

    def serve(script: list[str]):
        stand_in = ScriptedDspark(endpoints["dspark"], script)
        server = HTTPServer(build_app(pipeline, endpoints, root))
        served.append((stand_in, server))
        return stand_in, openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

    served = []
    yield serve
    for stand_in, server in served:
        server.stop()
        stand_in.close()
    shutil.rmtree(root, ignore_errors=True)


def test_reasoning_content_in_thinking_mode(scripted):
    stand_in, client = scripted(["Two and two make four.</think>4"])
    messages = [{"role": "user", "content": "What is 2+2?"}]
    reply = client.chat.completions.create(model="micro", messages=messages,
                                           extra_body={"thinking": {"type": "enabled"}})
    message = reply.choices[0].message
    assert message.content == "4" and message.reasoning_content == "Two and two make four."
    assert reply.choices[0].finish_reason == "stop"
    assert stand_in.prompts[0] == (
        "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the value, the more "
        "thorough the reasoning)<｜User｜>What is 2+2?<｜Assistant｜><think>")
    chunks = list(client.chat.completions.create(model="micro", messages=messages, stream=True, reasoning_effort=33,
                                                 extra_body={"chat_template_kwargs": {"thinking": True}}))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Two and two make four."
    assert "".join(d.content or "" for d in deltas) == "4"
    assert all("</" not in (d.content or "") + (getattr(d, "reasoning_content", None) or "") for d in deltas)
    assert "Reasoning Effort: 33 " in stand_in.prompts[1]
    plain = client.chat.completions.create(model="micro", messages=messages)  # chat mode: all of it is content
    assert plain.choices[0].message.content == "Two and two make four.</think>4"
    assert stand_in.prompts[2].endswith("<｜Assistant｜></think>")


def test_a_tool_call_round_trip(scripted):
    stand_in, client = scripted([CALL, "It will be sunny."])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
    reply = client.chat.completions.create(model="micro", messages=messages, tools=[WEATHER])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will look it up."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    assert "\n\n## Tools\n\n" in stand_in.prompts[0] and '{"name": "get_weather"' in stand_in.prompts[0]
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    final = client.chat.completions.create(model="micro", messages=messages, tools=[WEATHER])
    assert final.choices[0].message.content == "It will be sunny." and final.choices[0].finish_reason == "stop"
    assert stand_in.prompts[1].endswith(
        '<｜Assistant｜></think>I will look it up.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
        '</｜DSML｜ calls><｜end▁of▁sentence｜><｜User｜><tool_result>sunny, 24 C</tool_result><｜Assistant｜></think>')
    streamed = list(client.chat.completions.create(model="micro", messages=messages[:2], tools=[WEATHER],
                                                   stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in streamed)
    calls = [tc for c in streamed for tc in c.choices[0].delta.tool_calls or []]
    assert content == "I will look it up." and [tc.function.name for tc in calls] == ["get_weather"]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    # without tools in the request the DSML block is left as text
    assert "<｜DSML｜ calls>" in client.chat.completions.create(model="micro", messages=messages[:2]
                                                               ).choices[0].message.content


def test_dsv41_serve_runs_the_api_and_stops_on_sigterm(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    import msgspec

    root = short_dir()
    pipeline = with_overrides(pipeline_for("thread", root), name="clitest")
    (tmp_path / "p.yaml").write_bytes(msgspec.yaml.encode(pipeline))
    dsv41 = str(Path(sys.executable).parent / "dsv41")
    command = [dsv41, "serve", str(tmp_path / "p.yaml"), "--port", "0", "--runtime-dir", str(root / "run")]
    proc = subprocess.Popen(command,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DSV41_API_KEY": ""})
    try:
        line = proc.stdout.readline()
        assert "OpenAI API at http://127.0.0.1:" in line and "(model micro)" in line, (line, proc.stderr.read())
        url = line.split("OpenAI API at ")[1].split("/v1")[0]
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        assert client.completions.create(model="micro", prompt="hi", max_tokens=3).usage.completion_tokens == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "clitest stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
        shutil.rmtree(root, ignore_errors=True)


def test_serving_beyond_loopback_needs_an_api_key():
    from click.testing import CliRunner

    from dsv41.cli.main import cli

    result = CliRunner().invoke(cli, ["serve", "inproc", "--host", "0.0.0.0"], env={"DSV41_API_KEY": ""})
    assert result.exit_code == 2 and "set --api-key (or DSV41_API_KEY) to serve beyond loopback" in result.output
