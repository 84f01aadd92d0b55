"""The OpenAI-compatible server end to end: a real uvicorn server on a free 127.0.0.1 port, the official client.

One server (SmolLM2-135M-Instruct, small KV cache, max_model_len 512) is started for the whole module.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.server import build_app

MODEL = "test-model"
MAX_MODEL_LEN = 512
TIMEOUT = 60.0


class Server:
    def __init__(self, engine: LLMEngine, **app_options) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        app = build_app(engine, served_model_name=MODEL, **app_options)
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def __enter__(self) -> Server:
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)

    def metrics(self) -> dict[str, float]:
        """Samples by name, with the attention type appended for the KV usage gauge."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                kind = s.labels.get("attention_type")
                out[f"{s.name}[{kind}]" if kind else s.name] = s.value
        return out


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineConfig(max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=128 << 20, max_num_seqs=64))
    with Server(engine) as srv:
        yield srv


def chat_prompt_len(srv: Server, messages) -> int:
    return len(srv.tokenizer.encode(srv.tokenizer.apply_chat_template(messages, True), add_special_tokens=False))


def wait_idle_and_free(srv: Server, within: float = 1.0) -> float:
    """Seconds until no request runs and no KV block is in use; fails after ``within``."""
    start = time.monotonic()
    while True:
        m = srv.metrics()
        usage = [v for k, v in m.items() if k.startswith("hybridkv:kv_cache_usage_perc")]
        if m["hybridkv:num_requests_running"] == 0 and m["hybridkv:num_requests_waiting"] == 0 and not any(usage):
            return time.monotonic() - start
        assert time.monotonic() - start < within, f"request not freed: {m}"
        time.sleep(0.05)


# ---- happy paths -------------------------------------------------------------------------------------------
def test_health_and_models(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_stream_equals_non_stream(server):
    client = server.client()
    prompt = "The capital of France is"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert full.object == "text_completion" and full.id.startswith("cmpl-") and full.model == MODEL
    choice = full.choices[0]
    assert choice.index == 0 and choice.finish_reason in ("stop", "length") and choice.text
    assert full.usage.prompt_tokens == len(server.tokenizer.encode(prompt))
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_chat_stream_equals_non_stream(server):
    client = server.client()
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=8, temperature=0)
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    msg = full.choices[0].message
    assert msg.role == "assistant" and msg.content and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens == chat_prompt_len(server, messages)

    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == msg.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_n_seed_and_logprobs(server):
    client = server.client()
    out = client.completions.create(model=MODEL, prompt=[504, 2593, 314], n=2, max_tokens=4, temperature=0.8,
                                    seed=7, logprobs=2, extra_body={"top_k": 50, "min_p": 0.01,
                                                                    "repetition_penalty": 1.1, "ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 8
    for c in out.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == 4
        assert all(len(top) >= 2 for top in c.logprobs.top_logprobs)

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2)
    rows = chat.choices[0].logprobs.content
    assert len(rows) == chat.usage.completion_tokens and all(len(r.top_logprobs) == 2 for r in rows)
    assert rows[0].logprob == pytest.approx(rows[0].top_logprobs[0].logprob)  # greedy takes the top token

    texts, finishes = {0: "", 1: ""}, {}
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                                max_tokens=4, seed=3, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                assert c.index not in finishes, "finish_reason sent twice"
                finishes[c.index] = c.finish_reason
    assert sorted(finishes) == [0, 1] and all(texts.values())


def test_stop_string(server):
    client = server.client()
    prompt = "Here is a list of fruits: apple, banana,"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    stop = free.strip().split()[1] if len(free.split()) > 1 else free.strip()[1:]
    cut = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[stop, "zzz"])
    assert cut.choices[0].text == free[: free.index(stop)]
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].stop_reason == stop
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=stop,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut.choices[0].text  # no stop-string prefix leaks


# ---- bad input ---------------------------------------------------------------------------------------------
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
BAD_INPUTS = {
    "malformed json": (COMPLETIONS, '{"model": "test-model", "prompt": ', 400,
                       "malformed JSON in the request body: Expecting value"),
    "missing messages": (CHAT, {"model": MODEL}, 400, "messages: Field required"),
    "missing prompt": (COMPLETIONS, {"model": MODEL}, 400, "prompt: Field required"),
    "wrong type": (COMPLETIONS, {"prompt": "hi", "max_tokens": "lots"}, 400, "max_tokens"),
    "messages not a list": (CHAT, {"messages": "hi"}, 400, "messages"),
    "unknown role": (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "'wizard'"),
    "negative max_tokens": (COMPLETIONS, {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens must be >= 1"),
    "zero max_completion_tokens": (CHAT, {"messages": USER, "max_completion_tokens": 0}, 400,
                                   "max_completion_tokens must be >= 1"),
    "body not an object": (COMPLETIONS, "[1, 2]", 400, "must be a JSON object"),
    "negative temperature": (CHAT, {"messages": USER, "temperature": -0.5}, 400, "temperature must be >= 0"),
    "top_p zero": (COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400, "top_p must be in (0, 1]"),
    "top_p above one": (CHAT, {"messages": USER, "top_p": 1.5}, 400, "top_p must be in (0, 1]"),
    "empty stop": (COMPLETIONS, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    "unknown model": (CHAT, {"model": "gpt-9", "messages": USER}, 404, "gpt-9"),
    "too long": (COMPLETIONS, {"prompt": [1] * 600}, 400, f"600 tokens long but max_model_len is {MAX_MODEL_LEN}"),
    "empty prompt": (COMPLETIONS, {"prompt": ""}, 400, "empty"),
    "token outside vocab": (COMPLETIONS, {"prompt": [10**9]}, 400, "outside the vocabulary"),
    "a bad prompt in a list": (COMPLETIONS, {"prompt": [[1], [1] * 600]}, 400, "600 tokens long"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input(server, case):
    path, body, status, needle = BAD_INPUTS[case]
    if isinstance(body, dict):
        r = httpx.post(server.url + path, json=body, timeout=TIMEOUT)
    else:
        r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"], error
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    assert error["code"] == status and "Traceback" not in r.text
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_bad_input_through_openai_client(server):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        server.client().chat.completions.create(model=MODEL, messages=USER, temperature=-1)
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="hi")


# ---- disconnects and concurrency ---------------------------------------------------------------------------
def test_disconnected_stream_frees_everything(server):
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept referenced: dropping the iterator closes the connection
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["object"] == "text_completion"
        assert server.metrics()["hybridkv:num_requests_running"] == 1
    print(f"freed after {wait_idle_and_free(server):.2f}s")


def test_disconnected_non_stream_frees_everything(server):
    body = {"model": MODEL, "messages": USER, "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=1.5))
    print(f"freed after {wait_idle_and_free(server):.2f}s")


def test_32_concurrent_streams(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(model=MODEL, prompt=f"Item {i}: the number", max_tokens=8,
                                                 temperature=0.5, seed=i, stream=True)
        text, finish = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main() -> list[tuple[str, str | None]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(main())
    assert len(results) == 32 and all(finish in ("stop", "length") for _, finish in results)
    print(f"freed after {wait_idle_and_free(server):.2f}s")


# ---- metrics -----------------------------------------------------------------------------------------------
def test_metrics_and_prefix_cache_counters(server):
    before = server.metrics()
    for name in ("hybridkv:kv_cache_usage_perc[full]", "hybridkv:prefix_cache_queries_total",
                 "hybridkv:prefix_cache_hits_total", "hybridkv:num_requests_running", "hybridkv:num_requests_waiting",
                 "hybridkv:num_preemptions_total", "hybridkv:prompt_tokens_total", "hybridkv:generation_tokens_total",
                 "hybridkv:time_to_first_token_seconds_count", "hybridkv:inter_token_latency_seconds_count",
                 "hybridkv:e2e_request_latency_seconds_count"):
        assert name in before, name
    prompt = "A repeated prompt about caching. " * 8  # several full blocks
    client = server.client()
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = server.metrics()
    n_prompt = len(server.tokenizer.encode(prompt))
    assert after["hybridkv:prefix_cache_queries_total"] - before["hybridkv:prefix_cache_queries_total"] >= n_prompt
    assert after["hybridkv:prefix_cache_hits_total"] - before["hybridkv:prefix_cache_hits_total"] >= 16
    assert after["hybridkv:prompt_tokens_total"] - before["hybridkv:prompt_tokens_total"] == 2 * n_prompt
    assert after["hybridkv:generation_tokens_total"] - before["hybridkv:generation_tokens_total"] == 4
    e2e = "hybridkv:e2e_request_latency_seconds_count"
    assert after[e2e] == before[e2e] + 2


# ---- pieces that need no server ----------------------------------------------------------------------------
def test_serve_cli_defaults():
    from hybridkv.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.model, args.host, args.port, args.served_model_name) == (None, "0.0.0.0", 8000, None)
    args = build_parser().parse_args(["serve", "some/dir", "--port", "9001", "--served-model-name", "m"])
    assert (args.model, args.port, args.served_model_name) == ("some/dir", 9001, "m")


def test_throughput_log_line():
    from hybridkv.server.metrics import ServerMetrics, Interval

    metrics = ServerMetrics("m")
    line = metrics.format_line(Interval(prompt_tokens=100, generation_tokens=50, query_tokens=100, hit_tokens=25),
                               10.0)
    assert line == ("Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 5.0 tokens/s, Running: 0 reqs, "
                    "Waiting: 0 reqs, KV cache usage: n/a, Prefix cache hit rate: 25.0%")


def test_a_fresh_server_exposes_kv_usage_per_attention_type_before_any_request():
    from fastapi.testclient import TestClient

    from hybridkv.engine.llm_engine import EngineConfig
    from hybridkv.server.app import build_app

    with TestClient(build_app(EngineConfig(kv_cache_memory_bytes=64 << 20))) as client:
        text = client.get("/metrics").text
    assert 'hybridkv:kv_cache_usage_perc{attention_type="full"' in text
