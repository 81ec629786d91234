"""Prometheus metrics, prefix minillm_, label model. Engine-wide numbers are read from the engine's
stats at scrape time; per-request histograms are observed as requests finish."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.llm_engine import EngineStats
from engine.outputs import RequestTimes

# Milliseconds to minutes: TTFT on a GPU is ms, a long CPU generation is minutes.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
RATE_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


class _EngineCollector(Collector):
    def __init__(self, model: str, stats: Callable[[], EngineStats | None]) -> None:
        self.model, self.stats = model, stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if s is None:  # still loading
            return
        labels = [self.model]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"minillm_{name}", doc, labels=["model"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"minillm_{name}", doc, labels=["model"])
            c.add_metric(labels, value)
            return c

        capacity = s.kv_blocks_total * s.kv_bytes_per_block
        yield gauge("requests_running", "Sequences in the running batch.", s.running)
        yield gauge("requests_waiting", "Sequences waiting for the engine: being tokenized, queued or preempted (what --max-queue bounds).", s.waiting)
        yield gauge("kv_cache_used_bytes", "KV-cache bytes held by sequences.", s.kv_blocks_used * s.kv_bytes_per_block)
        yield gauge("kv_cache_capacity_bytes", "KV-cache bytes in the pool.", capacity)
        yield gauge("kv_cache_usage_ratio", "Share of KV-cache blocks in use (0-1).",
                    s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0)
        yield counter("prompt_tokens", "Prompt tokens of requests received.", s.prompt_tokens)
        yield counter("tokens_generated", "Tokens generated.", s.generation_tokens)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield counter("preemptions", "Sequences preempted for lack of KV blocks.", s.preemptions)
        yield counter("constrained_requests", "Requests whose output a grammar constrains (structured output, tools).",
                      s.constrained_requests)
        yield counter("grammar_mask_seconds", "Host seconds spent computing grammar token masks.", s.grammar_mask_seconds)
        if s.speculative_method is not None:  # acceptance rate: accepted / draft tokens
            for name, doc, value in (
                    ("spec_draft_tokens", "Speculative draft tokens verified.", s.draft_tokens),
                    ("spec_accepted_tokens", "Draft tokens the target's samples confirmed.", s.accepted_draft_tokens),
                    ("spec_emitted_tokens", "Tokens emitted by steps with drafts: the accepted drafts and the "
                                            "target's sample after them.", s.speculative_tokens)):
                c = CounterMetricFamily(f"minillm_{name}", doc, labels=["model", "method"])
                c.add_metric([self.model, s.speculative_method], value)
                yield c


class Metrics:
    """One registry per app (so tests can run several servers in one process)."""

    def __init__(self, model: str, stats: Callable[[], EngineStats | None]) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(model, stats))
        ProcessCollector(registry=self.registry)  # process_resident_memory_bytes &c.: what a soak watches for leaks

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(f"minillm_{name}", doc, ["model"], buckets=buckets, registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Time from arrival to the first token.", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between streamed outputs of a request.", LATENCY_BUCKETS)
        self.latency = hist("request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Time waiting before the first step.", LATENCY_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "First step to first token.", LATENCY_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token to the last.", LATENCY_BUCKETS)
        self.prompt_len = hist("request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS)
        self.output_len = hist("request_generation_tokens", "Generated tokens of finished requests.", TOKEN_BUCKETS)
        self.tok_s = hist("request_tokens_per_second", "Generated tokens per second of decode, per request.",
                          RATE_BUCKETS)
        self.finished = Counter("minillm_requests_finished", "Finished samples by finish reason.",
                                ["model", "finish_reason"], registry=self.registry)
        self.http = Counter("minillm_http_requests", "HTTP responses by status code (499: the client left first).",
                            ["model", "status"], registry=self.registry)
        self.http_active = Gauge("minillm_http_requests_active", "HTTP requests being served, probes aside "
                                 "(--max-connections caps them).", ["model"], registry=self.registry).labels(model)

    def observe_finished(self, times: RequestTimes | None, latency: float, ttft: float | None, prompt_tokens: int,
                         output_tokens: int, finish_reasons: list[str]) -> None:
        """A request is over. times is None when it was aborted before the engine finished it."""
        m = self.model
        self.latency.labels(m).observe(latency)
        if times is not None:
            self.queue.labels(m).observe(times.queue)
            self.prefill.labels(m).observe(times.prefill)
            self.decode.labels(m).observe(times.decode)
        if ttft is not None:
            self.ttft.labels(m).observe(ttft)
        self.prompt_len.labels(m).observe(prompt_tokens)
        self.output_len.labels(m).observe(output_tokens)
        if times is not None and times.decode > 0 and output_tokens > 1:
            self.tok_s.labels(m).observe((output_tokens - 1) / times.decode)
        for reason in finish_reasons:
            self.finished.labels(m, reason).inc()

    def observe_itl(self, seconds: float) -> None:
        self.itl.labels(self.model).observe(seconds)

    def observe_status(self, status: int) -> None:
        self.http.labels(self.model, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
