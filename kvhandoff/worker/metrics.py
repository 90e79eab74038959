"""Prometheus metrics for one serving instance, on a private registry.

A private CollectorRegistry (not the global default) so several apps can live in one process (tests,
a router next to a worker) without duplicate-name errors. Latencies come from the engine's own
per-request timings, so /metrics and the `timings` object in responses agree. Pool and queue gauges
are read from the engine loop at scrape time rather than pushed on every step.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvhandoff.engine.request import FinishReason, RequestOutput
from kvhandoff.wire.http import LATENCY_BUCKETS

class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        # status: the finish reason (stop, length, abort, error) for requests the engine ran, or the
        # HTTP status code (400, 404, 500, ...) for requests rejected before reaching it.
        self.requests = Counter("kvhandoff_requests", "Requests by endpoint and outcome",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("kvhandoff_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("kvhandoff_prompt_cached_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.generation_tokens = Counter("kvhandoff_generation_tokens", "Generated tokens", registry=r)
        self.queue_time = Histogram("kvhandoff_queue_time_seconds", "Arrival to first scheduling",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("kvhandoff_time_to_first_token_seconds", "Arrival to first output token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("kvhandoff_time_per_output_token_seconds", "Mean inter-token time after the first",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("kvhandoff_e2e_request_latency_seconds", "Arrival to last token (completed requests)",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.blocks_used = Gauge("kvhandoff_kv_blocks_used", "KV blocks in use", registry=r)
        self.blocks_free = Gauge("kvhandoff_kv_blocks_free", "KV blocks free", registry=r)
        self.blocks_total = Gauge("kvhandoff_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.running = Gauge("kvhandoff_num_requests_running", "Requests holding KV blocks", registry=r)
        self.waiting = Gauge("kvhandoff_num_requests_waiting", "Requests queued", registry=r)

    def rejected(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def finished(self, endpoint: str, out: RequestOutput) -> None:
        """Record a request's final output. Called from the engine thread (prometheus-client is thread-safe)."""
        self.requests.labels(endpoint, out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(out.num_prompt_tokens)
        self.cached_tokens.inc(out.num_cached_tokens)
        self.generation_tokens.inc(out.num_output_tokens)
        t = out.timings or {}
        if t.get("queue_ms") is not None:
            self.queue_time.observe(t["queue_ms"] / 1e3)
        if t.get("ttft_ms") is not None:
            self.ttft.observe(t["ttft_ms"] / 1e3)
        if t.get("decode_ms") is not None and out.num_output_tokens > 1:
            self.tpot.observe(t["decode_ms"] / 1e3 / (out.num_output_tokens - 1))
        # Aborted requests' latency is the client's choice, not ours: keep them out of e2e.
        if t.get("total_ms") is not None and out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.e2e.observe(t["total_ms"] / 1e3)

    def render(self, stats: dict) -> bytes:
        """Text exposition, with the gauges refreshed from the engine loop's stats()."""
        total, free = stats.get("num_blocks", 0), stats.get("num_free_blocks", 0)
        self.blocks_total.set(total)
        self.blocks_free.set(free)
        self.blocks_used.set(total - free)
        self.running.set(stats.get("num_running", 0))
        self.waiting.set(stats.get("num_waiting", 0))
        return generate_latest(self.registry)
