"""vLLM's ``chat_template_kwargs``: more variables for the chat template (``enable_thinking: false`` for Qwen3-style
templates), on ``/v1/chat/completions`` and ``/tokenize``; a value that is not an object, or a name the server sets
itself, is a 400. A tiny random checkpoint whose tokenizer makes token i the word ``w<i>``."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.server import build_app

MODEL = "tiny"
# Qwen3's switch, at toy size: thinking on unless the request turns it off (then an empty think block, w9 w9)
TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
            "{% if enable_thinking is defined and enable_thinking is false %}w9 w9 {% endif %}"
            "{% if style is defined %}{{ style['words'] | join(' ') }}{% endif %}")
MESSAGES = [{"role": "user", "content": "w5 w6 w7"}]


@pytest.fixture(scope="module")
def client(tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model("llama3").path), block_size=4,
                                    kv_cache_memory_bytes=8 << 20, max_num_seqs=4))
    with TestClient(build_app(engine, served_model_name=MODEL, chat_template=TEMPLATE)) as c:
        yield c


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 1, **body})


def tokens(client, **body) -> list[int]:
    r = client.post("/tokenize", json={"model": MODEL, "messages": MESSAGES, **body})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_the_template_sees_the_kwargs(client):
    assert tokens(client) == [5, 6, 7]
    assert tokens(client, chat_template_kwargs={"enable_thinking": False}) == [5, 6, 7, 9, 9]
    assert tokens(client, chat_template_kwargs={"enable_thinking": True, "style": {"words": ["w3", "w4"]}}) == [
        5, 6, 7, 3, 4]
    for kwargs, prompt_tokens in (({}, 3), ({"enable_thinking": False}, 5), (None, 3)):
        r = chat(client, chat_template_kwargs=kwargs)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == prompt_tokens


@pytest.mark.parametrize("value, needle", [
    ("enable_thinking=false", "chat_template_kwargs: Input should be a valid dictionary"),
    ([{"enable_thinking": False}], "chat_template_kwargs: Input should be a valid dictionary"),
    (7, "chat_template_kwargs: Input should be a valid dictionary"),
    ({"messages": []}, "chat_template_kwargs: 'messages' is set from the request itself"),
    ({"tools": []}, "chat_template_kwargs: 'tools' is set from the request itself"),
])
def test_a_bad_value_is_a_400_naming_it(client, value, needle):
    for r in (chat(client, chat_template_kwargs=value),
              client.post("/tokenize", json={"messages": MESSAGES, "chat_template_kwargs": value})):
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert needle in error["message"] and error["param"] == "chat_template_kwargs", error
