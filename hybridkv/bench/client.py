"""Streaming requests to an OpenAI-compatible server, timed per request.

Each request streams (``stream: true`` with ``stream_options.include_usage``) and asks for exactly
``max_tokens`` tokens with ``ignore_eos: true`` (vLLM and SGLang honour it; others ignore it). A chunk
that carries text is a token arrival: the first gives TTFT, the gaps between them are the ITLs.
Arrivals follow a Poisson process at ``request_rate`` (all at once when infinite), and at most
``max_concurrency`` requests are in flight.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx
import numpy as np

from hybridkv.bench.datasets import SampleRequest

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"
_DONE = "[DONE]"
_ERROR_TEXT_CHARS = 500


class RequestError(Exception):
    """A failure the server reported (HTTP status or an error event); its message is shown as is."""


@dataclass(slots=True)
class ClientConfig:
    base_url: str
    endpoint: str
    model: str
    request_rate: float = math.inf
    max_concurrency: int | None = None
    seed: int = 0
    timeout_s: float = 6 * 3600.0
    api_key: str | None = None

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


@dataclass(slots=True)
class RequestResult:
    index: int
    prompt_len: int
    target_output_len: int
    success: bool = False
    error: str = ""
    start_s: float = 0.0  # since the benchmark started
    ttft_s: float = 0.0
    latency_s: float = 0.0
    # Seconds since this request was sent, one per chunk that carried text.
    chunk_times_s: list[float] = field(default_factory=list)
    generated_text: str = ""
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    output_tokens: int = 0  # filled by metrics: usage if the server sent it, else tokenized text
    output_tokens_source: str = ""

    @property
    def itl_s(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in zip(times, times[1:])]


def build_payload(cfg: ClientConfig, prompt: str, output_len: int) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if cfg.is_chat:
        payload["messages"] = [{"role": "user", "content": prompt}]
        payload["max_completion_tokens"] = output_len
    else:
        payload["prompt"] = prompt
    return payload


def parse_sse_line(line: str) -> dict | str | None:
    """A ``data:`` line's JSON (or ``"[DONE]"``); None for blank lines, comments and other fields."""
    line = line.strip()
    if not line.startswith("data:"):
        return None
    data = line[len("data:") :].strip()
    if not data:
        return None
    return _DONE if data == _DONE else json.loads(data)


def chunk_text(chunk: dict) -> str:
    """The text a completions or chat chunk carries ("" for role-only, usage-only or finish chunks)."""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        delta = choice.get("delta") or {}
        return (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return choice.get("text") or ""


def record_chunk(result: RequestResult, chunk: dict, elapsed: float) -> None:
    if "error" in chunk:
        raise RequestError(f"server error in stream: {json.dumps(chunk['error'])[:_ERROR_TEXT_CHARS]}")
    usage = chunk.get("usage")
    if usage:
        result.usage_prompt_tokens = usage.get("prompt_tokens")
        result.usage_completion_tokens = usage.get("completion_tokens")
    text = chunk_text(chunk)
    if text:
        if not result.chunk_times_s:
            result.ttft_s = elapsed
        result.chunk_times_s.append(elapsed)
        result.generated_text += text


async def send_request(
    client: httpx.AsyncClient, cfg: ClientConfig, sample: SampleRequest, result: RequestResult, t0: float
) -> RequestResult:
    payload = build_payload(cfg, sample.prompt, sample.expected_output_len)
    sent = time.perf_counter()
    result.start_s = sent - t0
    try:
        async with client.stream("POST", cfg.url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                raise RequestError(f"HTTP {response.status_code}: {body[:_ERROR_TEXT_CHARS]}")
            async for line in response.aiter_lines():
                chunk = parse_sse_line(line)
                if chunk == _DONE:
                    break
                if chunk is not None:
                    record_chunk(result, chunk, time.perf_counter() - sent)
        result.latency_s = time.perf_counter() - sent
        result.success = bool(result.chunk_times_s)
        if not result.success:
            result.error = "stream ended without any generated text"
    except Exception as error:  # every failure is one failed request, reported, not a crash
        result.latency_s = time.perf_counter() - sent
        result.error = _describe(error)
    return result


def _describe(error: Exception) -> str:
    if isinstance(error, RequestError):
        return str(error)
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def arrival_delays(count: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds after the start) of a Poisson process at ``rate`` requests/s."""
    if not rate > 0:
        raise ValueError("--request-rate must be positive")
    if math.isinf(rate):
        return [0.0] * count
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=count)
    gaps[0] = 0.0
    return np.cumsum(gaps).tolist()


def _headers(cfg: ClientConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def run_requests(
    cfg: ClientConfig, samples: list[SampleRequest], on_done: Callable[[RequestResult], None] | None = None
) -> tuple[list[RequestResult], float]:
    """Send every sample; returns the results (in sample order) and the wall time of the whole run."""
    limit = cfg.max_concurrency or len(samples) or 1
    semaphore = asyncio.Semaphore(limit)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(cfg.timeout_s, connect=min(cfg.timeout_s, 60.0))
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=_headers(cfg)) as client:
        t0 = time.perf_counter()

        async def one(index: int, sample: SampleRequest, delay: float) -> RequestResult:
            await asyncio.sleep(max(0.0, delay - (time.perf_counter() - t0)))
            async with semaphore:
                result = RequestResult(index, sample.prompt_len, sample.expected_output_len)
                await send_request(client, cfg, sample, result, t0)
            if on_done is not None:
                on_done(result)
            return result

        delays = arrival_delays(len(samples), cfg.request_rate, cfg.seed)
        results = await asyncio.gather(*(one(i, s, d) for i, (s, d) in enumerate(zip(samples, delays))))
        return list(results), time.perf_counter() - t0


async def first_model_id(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers) as client:
        response = await client.get(base_url.rstrip("/") + "/v1/models")
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no models; pass --model")
    return models[0]["id"]
