"""The server with async scheduling forced on (its default with CUDA; on the CPU it is off, so the other server
tests run without it): the server loop's schedule/execute halves with a step scheduled ahead, streams, and a client
that leaves while the step after its last token is in flight."""

from __future__ import annotations

import json

import httpx
import pytest
from test_openai_server import MODEL, TIMEOUT, Server, wait_idle_and_free

from hybridkv.engine.llm_engine import EngineConfig, LLMEngine


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineConfig(max_model_len=512, kv_cache_memory_bytes=128 << 20, max_num_seqs=64,
                                    async_scheduling=True))
    with Server(engine) as srv:
        yield srv


def test_async_stream_non_stream_and_synchronous_steps_agree(server):
    client = server.client()
    kw = dict(model=MODEL, prompt="The three primary colors are", max_tokens=24, temperature=0)
    whole = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert whole and streamed == whole
    assert server.engine.steps_launched_ahead >= 20
    server.engine.config.async_scheduling = False  # no request in flight: the engine thread reads it next step
    try:
        assert client.completions.create(**kw).choices[0].text == whole
    finally:
        server.engine.config.async_scheduling = True
    wait_idle_and_free(server)


def test_async_disconnected_stream_frees_everything(server):
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "stream": True, "ignore_eos": True,
            "temperature": 0}  # greedy: steps go ahead (OpenAI's default temperature is 1)
    ahead = server.engine.steps_launched_ahead
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[len("data: "):])["object"] == "text_completion"
        for _ in range(6):  # a few events more (blank lines between them), steps going ahead when it leaves
            next(lines)
    wait_idle_and_free(server)
    assert server.engine.steps_launched_ahead > ahead and server.engine.ahead.pending is None
