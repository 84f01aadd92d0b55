"""Aggregate per-request timings into the serving metrics (as vLLM's ``bench serve`` defines them).

TTFT: send to first generated text. TPOT: ``(e2e - ttft) / (output_tokens - 1)`` per request with
more than one output token. ITL: every gap between successive text chunks, pooled over requests.
E2E latency: send to end of stream. Percentiles interpolate linearly (numpy's default).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from hybridkv.bench.client import RequestResult


@dataclass(slots=True)
class Stats:
    """One latency metric, in milliseconds."""

    mean: float = 0.0
    median: float = 0.0
    p99: float = 0.0
    std: float = 0.0
    count: int = 0

    @classmethod
    def of_seconds(cls, values: list[float]) -> Stats:
        if not values:
            return cls()
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        return cls(
            mean=float(ms.mean()),
            median=float(np.median(ms)),
            p99=float(np.percentile(ms, 99)),
            std=float(ms.std()),
            count=int(ms.size),
        )


@dataclass(slots=True)
class BenchMetrics:
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int  # by the bench tokenizer, as the dataset built them (vLLM's count)
    total_output_tokens: int
    server_input_tokens: int | None  # the servers' usage.prompt_tokens (chat templates included), if all sent it
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    peak_output_throughput: float
    max_concurrent_requests: int
    ttft_ms: Stats = field(default_factory=Stats)
    tpot_ms: Stats = field(default_factory=Stats)
    itl_ms: Stats = field(default_factory=Stats)
    e2el_ms: Stats = field(default_factory=Stats)
    errors: list[str] = field(default_factory=list)  # the first few distinct messages

    def to_dict(self) -> dict:
        return asdict(self)


def fill_output_tokens(results: list[RequestResult], count_tokens: Callable[[str], int]) -> None:
    """Output tokens from the server's usage when it sent one, else by tokenizing the generated text."""
    for r in results:
        if r.usage_completion_tokens is not None:
            r.output_tokens, r.output_tokens_source = r.usage_completion_tokens, "usage"
        else:
            r.output_tokens, r.output_tokens_source = count_tokens(r.generated_text), "tokenized"


def server_input_tokens(results: list[RequestResult]) -> int | None:
    usages = [r.usage_prompt_tokens for r in results]
    return None if not usages or None in usages else sum(usages)


def tpot_s(r: RequestResult) -> float | None:
    if r.output_tokens <= 1:
        return None
    return (r.latency_s - r.ttft_s) / (r.output_tokens - 1)


def token_timeline(results: list[RequestResult], bucket_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens/s per ``bucket_s`` bucket since the start; each chunk weighs output_tokens / chunks."""
    times, weights = [], []
    for r in results:
        if not (r.success and r.chunk_times_s):
            continue
        times.extend(r.start_s + t for t in r.chunk_times_s)
        weights.extend([r.output_tokens / len(r.chunk_times_s)] * len(r.chunk_times_s))
    if not times:
        return np.zeros(0), np.zeros(0)
    edges = np.arange(0.0, max(times) + bucket_s, bucket_s)
    if edges.size < 2:
        edges = np.array([0.0, bucket_s])
    counts, edges = np.histogram(times, bins=edges, weights=weights)
    return edges[:-1], counts / bucket_s


def max_concurrency_seen(results: list[RequestResult]) -> int:
    events = sorted([(r.start_s, 1) for r in results] + [(r.start_s + r.latency_s, -1) for r in results])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def first_errors(results: list[RequestResult], limit: int = 5) -> list[str]:
    return list(dict.fromkeys(r.error for r in results if not r.success and r.error))[:limit]


def compute_metrics(results: list[RequestResult], duration_s: float) -> BenchMetrics:
    """Requires ``fill_output_tokens`` to have run."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    _, per_second = token_timeline(ok)
    return BenchMetrics(
        completed=len(ok),
        failed=len(results) - len(ok),
        duration_s=duration_s,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        server_input_tokens=server_input_tokens(ok),
        request_throughput=len(ok) / duration,
        input_throughput=total_in / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        peak_output_throughput=float(per_second.max()) if per_second.size else 0.0,
        max_concurrent_requests=max_concurrency_seen(results),
        ttft_ms=Stats.of_seconds([r.ttft_s for r in ok]),
        tpot_ms=Stats.of_seconds([t for r in ok if (t := tpot_s(r)) is not None]),
        itl_ms=Stats.of_seconds([gap for r in ok for gap in r.itl_s]),
        e2el_ms=Stats.of_seconds([r.latency_s for r in ok]),
        errors=first_errors(results),
    )
