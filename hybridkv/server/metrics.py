"""Prometheus metrics (vLLM's names under ``hybridkv:``) and the periodic throughput log line.

Everything here is written by the engine thread only; prometheus-client's values are lock-protected, so
``/metrics`` reads them from the event loop safely.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

log = logging.getLogger("hybridkv.server")

LOG_INTERVAL_S = 10.0
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0)


@dataclass(slots=True)
class Interval:
    """Counts since the last log line."""

    start: float = field(default_factory=time.monotonic)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0

    @property
    def active(self) -> bool:
        return bool(self.prompt_tokens or self.generation_tokens)


@dataclass(slots=True)
class _Seen:
    """Engine-side cumulative counters as of the last update, to turn them into counter increments."""

    query_tokens: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    host: tuple[int, int, int] = (0, 0, 0)  # host tier: hit tokens, bytes written, bytes read


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self._kv_usage = Gauge("hybridkv:kv_cache_usage_perc", "Share of KV cache blocks in use (0-1)",
                               labels + ["attention_type"], registry=reg)
        self.running = Gauge("hybridkv:num_requests_running", "Requests in model execution batches",
                             labels, registry=reg).labels(model_name)
        self.waiting = Gauge("hybridkv:num_requests_waiting", "Requests waiting to be scheduled",
                             labels, registry=reg).labels(model_name)
        self.preemptions = Counter("hybridkv:num_preemptions", "Cumulative preemptions", labels,
                                   registry=reg).labels(model_name)
        self.prefix_queries = Counter("hybridkv:prefix_cache_queries", "Prefix cache queries, in tokens",
                                      labels, registry=reg).labels(model_name)
        self.prefix_hits = Counter("hybridkv:prefix_cache_hits", "Prefix cache hits, in tokens",
                                   labels, registry=reg).labels(model_name)
        # host tier (kv/host_tier.py); bytes are one rank's (every rank moves as many of its own heads' bytes)
        self.host_hits = Counter("hybridkv:host_cache_hit_tokens", "Prefix-hit tokens served from the host tier",
                                 labels, registry=reg).labels(model_name)
        self.host_written = Counter("hybridkv:host_cache_bytes_written", "KV bytes written back to the host tier",
                                    labels, registry=reg).labels(model_name)
        self.host_read = Counter("hybridkv:host_cache_bytes_read", "KV bytes loaded from the host tier",
                                 labels, registry=reg).labels(model_name)
        self.host_usage = Gauge("hybridkv:host_cache_usage_perc", "Share of host tier pages in use (0-1)",
                                labels, registry=reg).labels(model_name)
        self.prompt_tokens = Counter("hybridkv:prompt_tokens", "Prefill tokens processed", labels,
                                     registry=reg).labels(model_name)
        self.generation_tokens = Counter("hybridkv:generation_tokens", "Generation tokens processed", labels,
                                         registry=reg).labels(model_name)
        self.ttft = Histogram("hybridkv:time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("hybridkv:inter_token_latency_seconds", "Time between output tokens", labels,
                             buckets=_ITL_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("hybridkv:e2e_request_latency_seconds", "End-to-end request latency", labels,
                             buckets=_E2E_BUCKETS, registry=reg).labels(model_name)
        self._seen = _Seen()
        self._interval = Interval()
        self._last_usage: dict[str, float] = {}
        self._last_counts = (0, 0)  # running, waiting

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def kv_free_share(self) -> float:
        """The share of the KV pool free after the last step (read from any thread: the engine thread replaces the
        dict it reads whole)."""
        return max(0.0, 1.0 - sum(self._last_usage.values()))

    # ---- per request (engine thread) ----------------------------------------------------------------------
    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)
        self._interval.prompt_tokens += num_prompt_tokens

    def on_tokens(self, num_tokens: int, since_last_s: float | None) -> None:
        self.generation_tokens.inc(num_tokens)
        self._interval.generation_tokens += num_tokens
        if since_last_s is not None:
            self.itl.observe(since_last_s)

    def on_finished(self, e2e_s: float) -> None:
        self.e2e.observe(e2e_s)

    # ---- engine state (engine thread) ---------------------------------------------------------------------
    def update_engine_state(self, engine) -> None:
        """Gauges and counters from the engine's own counters; call after every step and every abort."""
        scheduler, kv = engine.scheduler, engine.kv
        self._last_counts = (len(scheduler.running), len(scheduler.waiting))
        self.running.set(self._last_counts[0])
        self.waiting.set(self._last_counts[1])
        self._last_usage = kv.usage_by_kind()
        for kind, usage in self._last_usage.items():
            self._kv_usage.labels(self.model_name, kind).set(usage)
        stats = kv.stats
        queries, hits = stats.query_tokens - self._seen.query_tokens, stats.hit_tokens - self._seen.hit_tokens
        self.prefix_queries.inc(queries)
        self.prefix_hits.inc(hits)
        self.preemptions.inc(scheduler.num_preemptions - self._seen.preemptions)
        self._interval.query_tokens += queries
        self._interval.hit_tokens += hits
        host = self._seen.host
        if kv.host is not None:
            h = kv.host.stats
            host = (h.hit_tokens, h.bytes_written, h.bytes_read)
            for counter, now, seen in zip((self.host_hits, self.host_written, self.host_read), host, self._seen.host):
                counter.inc(now - seen)
            self.host_usage.set(kv.host.usage())
        self._seen = _Seen(stats.query_tokens, stats.hit_tokens, scheduler.num_preemptions, host)

    # ---- the log line ---------------------------------------------------------------------------------------
    def seconds_to_next_log(self) -> float | None:
        """None when nothing happened since the last line (nothing to log, so the engine may sleep)."""
        if not self._interval.active:
            return None
        return max(0.0, self._interval.start + LOG_INTERVAL_S - time.monotonic())

    def maybe_log(self) -> None:
        interval = self._interval
        if not interval.active:  # idle: the next interval starts when work does
            self._interval = Interval()
            return
        elapsed = time.monotonic() - interval.start
        if elapsed >= LOG_INTERVAL_S:
            log.info(self.format_line(interval, elapsed))
            self._interval = Interval()

    def format_line(self, interval: Interval, elapsed: float) -> str:
        usage = ", ".join(f"{kind} {100 * u:.1f}%" for kind, u in self._last_usage.items()) or "n/a"
        hit_rate = 100 * interval.hit_tokens / interval.query_tokens if interval.query_tokens else 0.0
        return (
            f"Avg prompt throughput: {interval.prompt_tokens / elapsed:.1f} tokens/s, "
            f"Avg generation throughput: {interval.generation_tokens / elapsed:.1f} tokens/s, "
            f"Running: {self._last_counts[0]} reqs, Waiting: {self._last_counts[1]} reqs, "
            f"KV cache usage: {usage}, Prefix cache hit rate: {hit_rate:.1f}%"
        )
