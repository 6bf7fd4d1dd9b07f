"""Prometheus metrics with vLLM's names (the family SMG, AIPerf and InferenceX's collector all parse).

Every series carries `model_name`. Two sources:
- engine state, read at scrape time from AsyncEngine.stats() (the engine thread's latest snapshot):
  running/waiting gauges, KV usage, prefix-cache query/hit token counters (device tier, and the host
  tier as vLLM's "external" cache), prompt/generation token counters, preemptions, spec decoding;
- per-request histograms, observed on the engine thread when each request ends (`observe`): TTFT,
  inter-token latency, e2e, queue / prefill / decode / inference time, prompt and generation lengths,
  and request_success_total{finished_reason}.
Plus `http_requests_total{handler,method,status}` from the HTTP middleware.

Disaggregated prefill/decode (serving.disagg), from the same snapshot: prefix-cache hits by tier
(`vllm:prefix_cache_hits_by_tier{tier=device|host|shared}`), KV transfer bytes
(`vllm:kv_transfer_bytes{direction=sent|received}`), transfers by outcome, transfer latency (decode:
reservation to installed state) and decode queue time (arrival to reservation) as summaries, and the
hand-off queues (prefill: finished prompts held for their decode partner; decode: requests awaiting
memory or their KV). On a prefill worker `vllm:request_queue_time_seconds` is the prefill queue time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, SummaryMetricFamily

from serving.async_engine import RequestRecord

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vLLM's bucket boundaries (seconds), so dashboards built for vLLM read ours the same way
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000, 500000,
                 1000000)


class Metrics:
    def __init__(self, model_name: str, stats_source):
        """stats_source: a callable returning the latest Engine.stats() dict (AsyncEngine.stats)."""
        self.model_name = model_name
        self.registry = CollectorRegistry()
        label = ["model_name"]

        def hist(name, doc, buckets):
            return Histogram(name, doc, label, buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between consecutive output chunks.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Time waiting before first scheduled.", LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "First scheduled to first token.", LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "First token to finish.", LATENCY_BUCKETS)
        self.inference = hist("vllm:request_inference_time_seconds", "First scheduled to finish.", LATENCY_BUCKETS)
        self.prompt_len = hist("vllm:request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS)
        self.gen_len = hist("vllm:request_generation_tokens", "Output length of finished requests.", TOKEN_BUCKETS)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=self.registry)
        self.http_requests = Counter("http_requests", "HTTP requests by handler, method and status.",
                                     ["handler", "method", "status"], registry=self.registry)
        self.registry.register(_EngineCollector(model_name, stats_source))

    def observe(self, record: RequestRecord) -> None:
        """A listener of AsyncEngine (engine thread): one finished or aborted request."""
        t = record.timing
        self.success.labels(self.model_name, record.finish_reason).inc()
        if t.finish is not None:
            self.e2e.observe(t.finish - t.arrival)
        if t.scheduled is not None:
            self.queue.observe(t.scheduled - t.arrival)
            if t.finish is not None:
                self.inference.observe(t.finish - t.scheduled)
        if t.first_token is not None:
            self.ttft.observe(t.first_token - t.arrival)
            if t.scheduled is not None:
                self.prefill.observe(t.first_token - t.scheduled)
            if t.finish is not None:
                self.decode.observe(t.finish - t.first_token)
        for earlier, later in zip(t.token_times, t.token_times[1:]):
            self.itl.observe(later - earlier)
        self.prompt_len.observe(record.prompt_tokens)
        self.gen_len.observe(len(record.output_ids))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StatsCollector:
    """A Prometheus collector whose series are read from a stats snapshot at scrape time
    (`stats_source()`); every series carries `model_name`. Subclasses implement `collect`."""

    def __init__(self, model_name: str, stats_source):
        self.model_name = model_name
        self.stats_source = stats_source

    def describe(self):
        return []  # collected lazily; nothing to check at registration


class _EngineCollector(StatsCollector):
    """Gauges and counters read from the engine's stats snapshot at scrape time."""

    def collect(self):
        s = self.stats_source() or {}
        m = [self.model_name]

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, float(value))
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, float(value))
            return c

        query = s.get("prefix_query_tokens", 0)
        hits = s.get("prefix_hit_tokens", 0)
        host_hits = s.get("prefix_hit_tokens_host", 0)
        device_hits = hits - host_hits
        has_host_tier = bool(s.get("host_cache"))
        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.get("running", 0))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", s.get("waiting", 0))
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache pages in use (0-1).", s.get("kv_usage", 0.0))
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", query)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the device prefix cache.", device_hits)
        # the host tier plays vLLM's external (KV connector) cache: queried for what the device missed
        yield counter("vllm:external_prefix_cache_queries", "Prompt tokens looked up in the host tier.",
                      query - device_hits if has_host_tier else 0)
        yield counter("vllm:external_prefix_cache_hits", "Prompt tokens found in the host tier.", host_hits)
        yield counter("vllm:prompt_tokens", "Prompt tokens received.", s.get("prompt_tokens", 0))
        yield counter("vllm:generation_tokens", "Tokens generated.", s.get("generation_tokens", 0))
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Prompt tokens by where their KV came from.",
                                        labels=["model_name", "source"])
        by_source.add_metric([*m, "local_compute"], float(max(s.get("prompt_tokens", 0) - hits, 0)))
        by_source.add_metric([*m, "local_cache_hit"], float(device_hits))
        by_source.add_metric([*m, "external_kv_transfer"], float(host_hits))
        yield by_source
        yield counter("vllm:num_preemptions", "Requests preempted.", s.get("preemptions", 0))
        by_tier = CounterMetricFamily("vllm:prefix_cache_hits_by_tier", "Prompt tokens found in the prefix cache, by tier.",
                                      labels=["model_name", "tier"])
        for tier, tokens in (s.get("prefix_hit_tokens_by_tier") or {"device": device_hits}).items():
            by_tier.add_metric([*m, tier], float(tokens))
        yield by_tier
        d = s.get("disagg") or {}
        if d:
            yield from _disagg_metrics(m, d)
        if s.get("spec_verifies"):
            yield counter("vllm:spec_decode_num_drafts", "Speculative verify steps.", s["spec_verifies"])
            yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", s.get("spec_draft_tokens", 0))
            yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          s.get("spec_accepted_tokens", 0))


def _disagg_metrics(m: list[str], d: dict):
    """P/D families from Engine.stats()["disagg"] (a prefill or a decode worker's)."""
    sent, received = d.get("kv_transfer_bytes_sent", 0), d.get("kv_transfer_bytes_received", 0)
    nbytes = CounterMetricFamily("vllm:kv_transfer_bytes", "KV-transfer payload bytes.", labels=["model_name", "direction"])
    nbytes.add_metric([*m, "sent"], float(sent))
    nbytes.add_metric([*m, "received"], float(received))
    yield nbytes
    outcomes = CounterMetricFamily("vllm:kv_transfers", "KV transfers by outcome.", labels=["model_name", "outcome"])
    if "handoff_sent" in d:  # prefill side
        outcomes.add_metric([*m, "sent"], float(d["handoff_sent"]))
        outcomes.add_metric([*m, "expired"], float(d.get("handoff_expired", 0)))
        held = GaugeMetricFamily("vllm:num_requests_held_for_decode",
                                 "Finished prompts whose KV waits for the decode worker.", labels=["model_name"])
        held.add_metric(m, float(d.get("held", 0)))
        yield held
    else:  # decode side
        outcomes.add_metric([*m, "received"], float(d.get("kv_transfers", 0)))
        outcomes.add_metric([*m, "failed"], float(d.get("kv_transfer_failures", 0)))
        waiting = GaugeMetricFamily("vllm:num_requests_awaiting_kv",
                                    "Requests waiting for decode memory or for their KV transfer.", labels=["model_name"])
        waiting.add_metric(m, float(d.get("awaiting", 0) + d.get("transferring", 0)))
        yield waiting
        latency = SummaryMetricFamily("vllm:kv_transfer_latency_seconds", "Reservation to installed KV, per transfer.",
                                      labels=["model_name"])
        latency.add_metric(m, count_value=float(d.get("kv_transfers", 0)), sum_value=float(d.get("kv_transfer_seconds_sum", 0.0)))
        yield latency
        queue = SummaryMetricFamily("vllm:request_decode_queue_time_seconds",
                                    "Arrival to decode memory reserved (P/D decode worker).", labels=["model_name"])
        queue.add_metric(m, count_value=float(d.get("decode_queue_count", 0)), sum_value=float(d.get("decode_queue_seconds_sum", 0.0)))
        yield queue
    yield outcomes


__all__ = ["CONTENT_TYPE", "Metrics"]
