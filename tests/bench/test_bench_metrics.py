"""Metric math on synthetic timings, SSE parsing and request payloads."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hybridkv.bench.client import (
    ClientConfig,
    RequestError,
    RequestResult,
    arrival_delays,
    build_payload,
    chunk_text,
    parse_sse_line,
    record_chunk,
)
from hybridkv.bench.metrics import Stats, compute_metrics, fill_output_tokens, token_timeline, tpot_s
from hybridkv.bench.report import format_table


def result(index, start, ttft, latency, n_tokens, success=True, usage=True) -> RequestResult:
    r = RequestResult(index, prompt_len=10, target_output_len=n_tokens, success=success, start_s=start,
                      ttft_s=ttft, latency_s=latency)
    r.chunk_times_s = list(np.linspace(ttft, latency, n_tokens)) if n_tokens else []
    r.generated_text = "a" * n_tokens
    r.usage_completion_tokens = n_tokens if usage else None
    return r


def test_tpot_formula():
    r = result(0, 0.0, ttft=0.1, latency=1.0, n_tokens=10)
    fill_output_tokens([r], len)
    assert tpot_s(r) == pytest.approx(0.9 / 9)
    single = result(1, 0.0, ttft=0.1, latency=0.1, n_tokens=1)
    fill_output_tokens([single], len)
    assert tpot_s(single) is None


def test_p99_median_mean():
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms
    stats = Stats.of_seconds(values)
    assert stats.mean == pytest.approx(50.5)
    assert stats.median == pytest.approx(50.5)
    assert stats.p99 == pytest.approx(99.01)  # linear interpolation: 1 + 0.99 * 99
    assert stats.count == 100
    assert Stats.of_seconds([]) == Stats()


def test_compute_metrics_synthetic():
    results = [
        result(0, 0.0, ttft=0.10, latency=1.0, n_tokens=10),
        result(1, 0.5, ttft=0.20, latency=2.0, n_tokens=10),
        result(2, 1.0, ttft=0.30, latency=1.5, n_tokens=5, usage=False),
        result(3, 1.0, ttft=0.0, latency=0.1, n_tokens=0, success=False),
    ]
    results[3].error = "HTTP 500: boom"
    fill_output_tokens(results, len)
    assert results[2].output_tokens_source == "tokenized" and results[0].output_tokens_source == "usage"
    m = compute_metrics(results, duration_s=2.5)
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_output_tokens == 25
    assert m.total_input_tokens == 30 and m.server_input_tokens is None
    assert m.request_throughput == pytest.approx(3 / 2.5)
    assert m.output_throughput == pytest.approx(10.0)
    assert m.total_token_throughput == pytest.approx(55 / 2.5)
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert m.ttft_ms.median == pytest.approx(200.0)
    tpots = [0.9 / 9, 1.8 / 9, 1.2 / 4]
    assert m.tpot_ms.mean == pytest.approx(np.mean(tpots) * 1000)
    assert m.tpot_ms.p99 == pytest.approx(np.percentile(tpots, 99) * 1000)
    assert m.itl_ms.count == 9 + 9 + 4
    assert m.e2el_ms.median == pytest.approx(1500.0)
    assert m.errors == ["HTTP 500: boom"]
    assert m.max_concurrent_requests == 3
    starts, rates = token_timeline([r for r in results if r.success])
    assert rates.sum() == pytest.approx(25.0)  # 1 s buckets: tokens/s sums to the token count
    assert starts[0] == 0.0
    table = format_table(m, {"max_concurrency": None, "request_rate": "inf"})
    assert "Serving Benchmark Result" in table and "P99 TPOT (ms):" in table and "error: HTTP 500" in table


def test_sse_parsing_and_chunks():
    assert parse_sse_line("data: [DONE]") == "[DONE]"
    assert parse_sse_line(": keep-alive") is None
    assert parse_sse_line("") is None
    assert parse_sse_line('data: {"a": 1}') == {"a": 1}
    assert chunk_text({"choices": [{"text": "hi"}]}) == "hi"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert chunk_text({"choices": [{"delta": {"content": "yo"}}]}) == "yo"
    assert chunk_text({"choices": [], "usage": {}}) == ""
    r = RequestResult(0, 5, 3)
    record_chunk(r, {"choices": [{"delta": {"role": "assistant"}}]}, 0.01)  # role-only: not a token
    record_chunk(r, {"choices": [{"delta": {"content": "a"}}]}, 0.02)
    record_chunk(r, {"choices": [{"delta": {"content": "b"}}]}, 0.05)
    record_chunk(r, {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}, 0.06)
    assert r.ttft_s == 0.02 and r.itl_s == pytest.approx([0.03])
    assert (r.usage_prompt_tokens, r.usage_completion_tokens, r.generated_text) == (9, 2, "ab")
    with pytest.raises(RequestError, match="server error"):
        record_chunk(r, {"error": {"message": "bad"}}, 0.07)


def test_payloads():
    cfg = ClientConfig("http://h:1/", "/v1/completions", "m")
    p = build_payload(cfg, "hello", 7)
    assert cfg.url == "http://h:1/v1/completions"
    assert p["prompt"] == "hello" and p["max_tokens"] == 7 and p["ignore_eos"] is True
    assert p["stream"] is True and p["stream_options"] == {"include_usage": True}
    chat = build_payload(ClientConfig("http://h:1", "/v1/chat/completions", "m"), "hello", 7)
    assert chat["messages"] == [{"role": "user", "content": "hello"}] and chat["max_completion_tokens"] == 7


def test_poisson_arrivals():
    assert arrival_delays(3, math.inf, 0) == [0.0, 0.0, 0.0]
    delays = arrival_delays(4000, 20.0, 1)
    assert delays == sorted(delays) and delays[0] == 0.0
    assert np.mean(np.diff(delays)) == pytest.approx(1 / 20, rel=0.1)
    assert delays == arrival_delays(4000, 20.0, 1)
    with pytest.raises(ValueError):
        arrival_delays(3, 0.0, 0)
