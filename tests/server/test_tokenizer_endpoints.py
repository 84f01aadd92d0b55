"""vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` on the default model (SmolLM2): vLLM's request and
response shapes, the same ids the completion endpoints count, and 400s naming the problem."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.server import build_app
from hybridkv.server.options import ServerOptions

MAX_MODEL_LEN = 256
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def client():
    engine = LLMEngine(EngineConfig(max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=16 << 20, max_num_seqs=2))
    with TestClient(build_app(engine, served_model_name="m")) as c:
        c.engine = engine
        yield c


def ok(r) -> dict:
    assert r.status_code == 200, r.text
    return r.json()


def test_tokenize_a_prompt(client):
    tok = client.engine.tokenizer
    text = "Hello world, ünïcode and <|im_end|>"
    out = ok(client.post("/tokenize", json={"model": "m", "prompt": text}))
    assert out == {"count": len(out["tokens"]), "max_model_len": MAX_MODEL_LEN,
                   "tokens": tok.encode(text, add_special_tokens=True), "token_strs": None}
    assert tok.convert_ids_to_tokens([out["tokens"][-1]]) == ["<|im_end|>"]  # a special token written in the text
    bare = ok(client.post("/tokenize", json={"prompt": text, "add_special_tokens": False, "return_token_strs": True}))
    assert bare["tokens"] == tok.encode(text, add_special_tokens=False)
    assert bare["token_strs"] == tok.convert_ids_to_tokens(bare["tokens"]) and "Hello" in bare["token_strs"]
    # what a completion of the same prompt counts
    usage = ok(client.post("/v1/completions", json={"prompt": text, "max_tokens": 1}))["usage"]
    assert usage["prompt_tokens"] == out["count"]


def test_tokenize_a_chat_counts_what_chat_completions_counts(client):
    out = ok(client.post("/tokenize", json={"messages": MESSAGES}))
    assert out["tokens"] == client.engine.chat_token_ids(MESSAGES)
    usage = ok(client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 1}))["usage"]
    assert usage["prompt_tokens"] == out["count"]
    without = ok(client.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}))
    assert out["tokens"][: without["count"]] == without["tokens"] and without["count"] < out["count"]
    text = client.engine.tokenizer.apply_chat_template(MESSAGES, True)
    assert ok(client.post("/detokenize", json={"tokens": out["tokens"]}))["prompt"] == text


def test_detokenize_round_trip(client):
    text = "The quick brown fox 🦊 jumps."
    ids = ok(client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}))["tokens"]
    assert ok(client.post("/detokenize", json={"model": "m", "tokens": ids})) == {"prompt": text}
    assert ok(client.post("/detokenize", json={"tokens": []})) == {"prompt": ""}


def test_tokenizer_info_has_what_lm_eval_reads(client):
    tok = client.engine.tokenizer
    info = ok(client.get("/tokenizer_info"))
    assert info["eos_token"] == tok.eos_token and info["bos_token"] == tok.bos_token
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] == MAX_MODEL_LEN
    assert info["tokenizer_class"] and info["vocab_size"] == tok.vocab_size


BAD = {
    "unknown token id": ("/detokenize", {"tokens": [5, 10**6]}, 400,
                         "tokens: token id 1000000 is outside the tokenizer's vocabulary [0, 49152)"),
    "negative token id": ("/detokenize", {"tokens": [-1]}, 400, "token id -1 is outside"),
    "huge token id": ("/detokenize", {"tokens": [2**70]}, 400, "is outside"),
    "token id not an int": ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0"),
    "no tokens": ("/detokenize", {}, 400, "tokens: Field required"),
    "prompt and messages": ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "exactly one of prompt"),
    "neither": ("/tokenize", {"add_special_tokens": True}, 400, "exactly one of prompt"),
    "unknown model": ("/tokenize", {"model": "other", "prompt": "a"}, 404, "The model `other` does not exist"),
    "too long": ("/tokenize", {"prompt": "a" * 10**6}, 400, "characters long, more than max_model_len 256"),
    "bad role": ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role"),
    "continue_final_message": ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400,
                               "continue_final_message: not supported"),
    "not json": ("/tokenize", "{", 400, "malformed JSON"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_are_openai_error_bodies(client, case):
    path, body, status, needle = BAD[case]
    r = client.post(path, content=body) if isinstance(body, str) else client.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["code"] == status


def test_without_a_tokenizer_they_say_so(tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model("llama3").path), skip_tokenizer_init=True,
                                    kv_cache_memory_bytes=4 << 20))
    with TestClient(build_app(engine)) as c:
        for path, body in [("/tokenize", {"prompt": "w5"}), ("/detokenize", {"tokens": [5]})]:
            r = c.post(path, json=body)
            assert r.status_code == 400 and "--skip-tokenizer-init" in r.json()["error"]["message"], r.text
        assert c.get("/tokenizer_info").status_code == 400
        r = c.post("/v1/completions", json={"prompt": [5, 6], "echo": True, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("echo: needs a tokenizer")
        # prompt logprobs need no tokenizer: the tokens are spelled token_id:<id>, as vLLM does
        r = c.post("/v1/completions", json={"prompt": [5, 6, 7], "prompt_logprobs": 0, "max_tokens": 1})
        assert r.status_code == 200, r.text
        entries = r.json()["choices"][0]["prompt_logprobs"]
        assert entries[0] is None and entries[2]["7"]["decoded_token"] == "token_id:7"


def test_with_an_api_key_they_need_it(tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model("llama3").path), kv_cache_memory_bytes=4 << 20))
    with TestClient(build_app(engine, options=ServerOptions(api_keys=["sesame"]))) as c:
        for method, path, body in [("POST", "/tokenize", {"prompt": "w5"}), ("POST", "/detokenize", {"tokens": [5]}),
                                   ("GET", "/tokenizer_info", None)]:
            assert c.request(method, path, json=body).status_code == 401
            r = c.request(method, path, json=body, headers={"Authorization": "Bearer sesame"})
            assert r.status_code == 200, r.text
        assert c.post("/tokenize", json={"prompt": "w5 w9"}, headers={"Authorization": "Bearer sesame"}).json() == {
            "count": 2, "max_model_len": engine.max_model_len, "tokens": [5, 9], "token_strs": None}


def test_tools_reach_the_template_as_in_chat_completions(tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model("llama3").path), kv_cache_memory_bytes=4 << 20))
    # each tool renders as one word, so the count tells whether the template saw them
    template = "{% for t in tools or [] %}w7 {% endfor %}{{ messages[0]['content'] }}"
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in ("a", "b")]
    messages = [{"role": "user", "content": "w5 w9"}]
    with TestClient(build_app(engine, chat_template=template)) as c:
        out = c.post("/tokenize", json={"messages": messages, "tools": tools}).json()
        assert out["tokens"] == [7, 7, 5, 9]
        chat = c.post("/v1/chat/completions", json={"messages": messages, "tools": tools, "tool_choice": "none",
                                                    "max_tokens": 1})
        assert chat.status_code == 200, chat.text
        assert chat.json()["usage"]["prompt_tokens"] == out["count"]
        assert c.post("/tokenize", json={"messages": messages}).json()["tokens"] == [5, 9]
