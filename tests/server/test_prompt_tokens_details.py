"""``--enable-prompt-tokens-details``: ``usage.prompt_tokens_details.cached_tokens`` says how many prompt tokens the
prefix cache served (vLLM's flag and field); without it the usage keeps its three counts alone. A tiny random
checkpoint with 4-token blocks: a repeated 13-token prompt finds its first 12 tokens (3 whole blocks) cached."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.server import build_app
from hybridkv.server.options import ServerOptions

MODEL = "tiny"
PROMPT = list(range(5, 18))  # 13 tokens: 3 whole blocks of 4, then one token
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _client(tiny_model, details: bool) -> TestClient:
    engine = LLMEngine(EngineConfig(model=str(tiny_model("llama3").path), block_size=4, max_num_batched_tokens=32,
                                    kv_cache_memory_bytes=8 << 20, max_num_seqs=4))
    return TestClient(build_app(engine, served_model_name=MODEL, chat_template=CHAT_TEMPLATE,
                                options=ServerOptions(prompt_tokens_details=details)))


@pytest.fixture(scope="module")
def client(tiny_model):
    with _client(tiny_model, True) as c:
        yield c


def completion(client, prompt, **body) -> dict:
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True,
                                             **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_second_request_reports_its_cached_blocks(client):
    first = completion(client, PROMPT)
    second = completion(client, PROMPT)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"] == {"prompt_tokens": 13, "completion_tokens": 2, "total_tokens": 15,
                               "prompt_tokens_details": {"cached_tokens": 12}}


def test_streamed_usage_and_prompt_lists_sum_the_cached_tokens(client):
    other = [90, 91, 92, 93, 94]  # never sent before: nothing cached
    completion(client, PROMPT)
    body = {"model": MODEL, "prompt": [PROMPT, other], "max_tokens": 2, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks[-1]["usage"]["prompt_tokens"] == 18
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 12}


def test_chat_reports_them_too(client):
    messages = [{"role": "user", "content": "w5 w6 w7 w8 w9 w10 w11 w12 w13"}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "ignore_eos": True}
    client.post("/v1/chat/completions", json=body)
    usage = client.post("/v1/chat/completions", json=body).json()["usage"]
    # the last prompt token is always computed: the whole blocks before it are served from the cache
    assert usage["prompt_tokens_details"]["cached_tokens"] == (usage["prompt_tokens"] - 1) // 4 * 4 > 0


def test_off_by_default_the_usage_has_three_counts(tiny_model):
    with _client(tiny_model, False) as c:
        completion(c, PROMPT)
        assert set(completion(c, PROMPT)["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
