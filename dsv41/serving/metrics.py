"""Prometheus metrics of a served pipeline, named as vLLM names them where vLLM has the quantity.

Two sources: the front end records every request it serves (tokens, latencies, prefix-cache hits
from each request's `Finished`), and at each scrape the components are pinged and their counters
(queue lengths, KV pages, the SWA pool, the store) become gauges and counters. A component that does
not answer shows `dsv41_component_up 0` and leaves its series out of that scrape.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
FINISH_REASONS = ("stop", "length", "tool_calls", "abort", "error")


class RequestMetrics:
    """What the front end measures itself, per request."""

    def __init__(self, registry: CollectorRegistry, model: str):
        labels = ["model_name"]
        self.model = model
        self.success = Counter("vllm:request_success", "Requests finished, by finish reason.",
                               [*labels, "finished_reason"], registry=registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", labels, registry=registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between two generated tokens of a request.",
                             labels, buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency, arrival to last token.", labels,
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.cache_queries = Counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                     labels, registry=registry)
        self.cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", labels,
                                  registry=registry)
        self.replayed = Counter("dsv41_replayed_layer_tokens", "Layer-tokens recomputed by bounded replay "
                                "(encoder replay on a prefix hit plus decoder replay).", labels, registry=registry)
        self.engram_wait = Histogram("dsv41_engram_wait_seconds", "Time a request's encoder waited for Engram rows.",
                                     labels, buckets=LATENCY_BUCKETS, registry=registry)
        for reason in FINISH_REASONS:  # every reason shows, at 0, from the first scrape
            self.success.labels(model, reason)

    def first_token(self, seconds: float) -> None:
        self.ttft.labels(self.model).observe(seconds)

    def next_token(self, seconds: float) -> None:
        self.itl.labels(self.model).observe(seconds)

    def finished(self, reason: str, prompt_tokens: int, generated: int, cached: int, replayed: int,
                 engram_wait_s: float, e2e_s: float) -> None:
        model = self.model
        self.success.labels(model, reason).inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(generated)
        self.cache_queries.labels(model).inc(prompt_tokens)
        self.cache_hits.labels(model).inc(cached)
        self.replayed.labels(model).inc(replayed)
        self.engram_wait.labels(model).observe(engram_wait_s)
        self.e2e.labels(model).observe(e2e_s)


# (metric, help, component, counter name, kind)
COMPONENT_SERIES = (
    ("vllm:num_requests_running", "Requests prefilling or decoding.", "dspark", "running", "gauge"),
    ("vllm:num_requests_waiting", "Requests queued for a running slot or KV pages.", "dspark", "waiting", "gauge"),
    ("dsv41_requests_prefilling", "Requests whose prefill is in the encoder.", "dspark", "prefilling", "gauge"),
    ("dsv41_swa_pool_entries", "Encoder SWA snapshots held in the host pool.", "kvstore", "swa_pool_entries",
     "gauge"),
    ("dsv41_swa_pool_bytes", "Bytes of the SWA snapshots in the host pool.", "kvstore", "swa_pool_bytes", "gauge"),
    ("dsv41_swa_pool_ttl_evictions", "SWA snapshots dropped when their TTL ran out.", "kvstore", "swa_pool_expired",
     "counter"),
    ("dsv41_swa_pool_capacity_evictions", "SWA snapshots dropped to make room.", "kvstore", "swa_pool_evicted",
     "counter"),
    ("dsv41_store_read_bytes", "Global KV bytes read from the persistent prefix store.", "kvstore",
     "store_read_bytes", "counter"),
    ("dsv41_store_written_bytes", "Global KV bytes written to the persistent prefix store.", "kvstore",
     "store_written_bytes", "counter"),
    ("dsv41_store_size_bytes", "Bytes held by the persistent prefix store.", "kvstore", "store_size_bytes", "gauge"),
    ("dsv41_store_reader_slots_freed", "Store reader slots given back after their process died holding them.",
     "kvstore", "store_reader_slots_freed", "counter"),
    ("vllm:spec_decode_num_drafts", "Drafts verified by speculative decoding.", "dspark", "spec_drafts", "counter"),
    ("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", "dspark", "spec_draft_tokens", "counter"),
    ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", "dspark", "spec_accepted_tokens", "counter"),
)


class ComponentCollector:
    """Pings every component at scrape time; `ping(name)` returns its counters or None when it is down."""

    def __init__(self, components: tuple[str, ...], ping: Callable[[str], dict[str, int] | None], model: str):
        self.components, self.ping, self.model = components, ping, model

    def collect(self):
        with ThreadPoolExecutor(len(self.components)) as pool:
            counters = dict(zip(self.components, pool.map(self.ping, self.components), strict=True))
        up = GaugeMetricFamily("dsv41_component_up", "1 if the component answered the scrape's ping.",
                               labels=["component"])
        for name, values in counters.items():
            up.add_metric([name], 0 if values is None else 1)
        yield up
        for metric, text, kind in (("dsv41_kv_pages_in_use", "Global KV pages (128 entries) held by live "
                                    "sequences.", "pages_in_use"),
                                   ("dsv41_sequences", "Live request sequences.", "sequences")):
            family = GaugeMetricFamily(metric, text, labels=["component"])
            for name in ("encoder", "decoder"):
                if counters.get(name) is not None:
                    family.add_metric([name], counters[name].get(kind, 0))
            yield family
        for metric, text, component, key, kind in COMPONENT_SERIES:
            values = counters.get(component)
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(
                metric.removesuffix("_total"), text, labels=["model_name"])
            if values is not None:
                family.add_metric([self.model], values.get(key, 0))
            yield family
        yield from self._speculative(counters.get("dspark") or {})

    def _speculative(self, dspark: dict[str, int]):
        """DSpark: acceptance length, acceptance by draft position, the lengths chosen, the drafter's
        share of the time (from dspark's counters)."""
        drafts = dspark.get("spec_drafts", 0)
        mean = GaugeMetricFamily("dsv41_spec_decode_mean_acceptance_length", "Tokens emitted per verification "
                                 "step, the target's bonus token included (0 until speculative decoding runs).",
                                 labels=["model_name"])
        mean.add_metric([self.model], (dspark.get("spec_accepted_tokens", 0) + drafts) / drafts if drafts else 0.0)
        yield mean
        by_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, "
                                          "by position in the drafted block.", labels=["model_name", "position"])
        lengths = CounterMetricFamily("dsv41_spec_decode_lengths", "Verification steps of a request by the number "
                                      "of drafts the scheduler chose.", labels=["model_name", "length"])
        for key, value in sorted(dspark.items()):
            if key.startswith("spec_accepted_pos_"):
                by_position.add_metric([self.model, key.removeprefix("spec_accepted_pos_")], value)
            elif key.startswith("spec_length_"):
                lengths.add_metric([self.model, key.removeprefix("spec_length_")], value)
        yield by_position
        yield lengths
        share = GaugeMetricFamily("dsv41_spec_decode_drafter_time_share", "Drafter time over drafter plus "
                                  "batched step time in dspark (0 until speculative decoding runs).",
                                  labels=["model_name"])
        drafter, steps = dspark.get("spec_drafter_us", 0), dspark.get("step_us", 0)
        share.add_metric([self.model], drafter / (drafter + steps) if drafter + steps else 0.0)
        yield share
