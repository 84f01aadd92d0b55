"""Hostile and out-of-range input gets a clear 4xx, cheaply, and the server stays healthy.

One server (SmolLM2-135M-Instruct, max_model_len 512, max_num_seqs 8, a 1 MiB body limit) for the module."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest
from test_openai_server import MODEL, TIMEOUT, Server

from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.server.limits import RequestLimits
from hybridkv.server.options import ServerOptions

MAX_MODEL_LEN = 512
MAX_NUM_SEQS = 8
BODY_LIMIT = 1 << 20
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineConfig(max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=64 << 20,
                                    max_num_seqs=MAX_NUM_SEQS))
    options = ServerOptions(limits=RequestLimits(max_body_bytes=BODY_LIMIT))
    with Server(engine, options=options) as srv:
        yield srv


def post(srv: Server, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, dict):
        return httpx.post(srv.url + path, json=body, timeout=TIMEOUT, **kw)
    return httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"}, timeout=TIMEOUT,
                      **kw)


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and "Traceback" not in r.text
    return error


# ---- the body ----------------------------------------------------------------------------------------------
def test_a_body_over_the_limit_is_refused_from_its_content_length(server):
    body = b'{"prompt": "' + b"a" * BODY_LIMIT + b'"}'
    error = error_of(post(server, COMPLETIONS, body), 413)
    assert error["type"] == "RequestTooLargeError"
    assert f"is {len(body):,} bytes; at most {BODY_LIMIT:,} bytes" in error["message"]


def test_a_chunked_body_is_cut_off_once_it_passes_the_limit(server):
    def chunks():  # no Content-Length: the server only learns the size by reading
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"a" * (64 << 10)
        yield b'"}'

    r = httpx.post(server.url + COMPLETIONS, content=chunks(), timeout=TIMEOUT)
    error = error_of(r, 413)
    assert f"at most {BODY_LIMIT:,} bytes" in error["message"]
    # refused soon after the limit is passed (the server's reads may merge chunks), not after reading all 4 MiB
    read = int(re.search(r"over ([\d,]+) bytes read", error["message"])[1].replace(",", ""))
    assert BODY_LIMIT < read < 2 * BODY_LIMIT


def test_100000_nested_arrays_are_a_400_not_a_recursion_error(server):
    body = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    error = error_of(post(server, COMPLETIONS, body), 400)
    assert error["message"] == "prompt: nests JSON arrays and objects 100,001 levels deep; at most 128 are accepted"
    assert error["param"] == "prompt"


def test_nan_and_infinity_are_not_json(server):
    for constant in ("NaN", "Infinity", "-Infinity"):
        body = f'{{"prompt": "hi", "temperature": {constant}}}'
        error = error_of(post(server, COMPLETIONS, body), 400)
        assert error["message"] == f"temperature: {constant} is not a JSON number" and error["param"] == "temperature"


@pytest.mark.parametrize("path, body, message", [
    (COMPLETIONS, b'{"prompt": "hi", "temperature": 1e999}',
     "temperature: 1e999 is beyond a 64-bit float's range (about 1.8e308)"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "seed": ' + b"1" * 4301 + b"}",
     "seed: an integer of 4,301 digits; at most 4,300 are accepted"),
    (COMPLETIONS, b'{"prompt": [1, 2, ' + b"3" * 5000 + b"]}", "prompt.2: an integer of 5,000 digits; at most 4,300 "
                                                            "are accepted"),
    ("/tokenize", b'{"prompt": "hi", "x": {"y": ' + b"9" * 9999 + b"}}", "x.y: an integer of 9,999 digits"),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", '
           b'"json_schema": {"schema": {"type": "number", "maximum": 2e400}}}}',
     "response_format.json_schema.schema.maximum: 2e400 is beyond"),
])
def test_numbers_beyond_what_json_or_python_carry_are_a_400_on_a_connection_that_stays_open(server, path, body,
                                                                                         message):
    with httpx.Client(timeout=TIMEOUT) as client:  # one kept-alive connection for both requests
        r = client.post(server.url + path, content=body, headers={"content-type": "application/json"})
        error = error_of(r, 400)
        assert error["message"].startswith(message) and error["param"] == message.split(".")[0].split(":")[0]
        assert "connection" not in r.headers or r.headers["connection"] != "close"
        ok = client.post(server.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 1})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("path, field, value", [
    (COMPLETIONS, "echo", "yes"), (COMPLETIONS, "stream", "true"), (CHAT, "stream", 1),
    ("/tokenize", "add_special_tokens", "yes"), (CHAT, "stream_options.include_usage", "yes"),
    (CHAT, "logprobs", "false"), (CHAT, "add_generation_prompt", 0), (COMPLETIONS, "ignore_eos", "no"),
    (CHAT, "tools.0.function.strict", "yes"),
])
def test_booleans_are_strict(server, path, field, value):
    body = {"prompt": "hi"} if path != CHAT else {"messages": USER}
    body["max_tokens"] = 1
    if field == "stream_options.include_usage":
        body.update(stream=True, stream_options={"include_usage": value})
    elif field.startswith("tools."):
        body["tools"] = [{"type": "function", "function": {"name": "f", "strict": value}}]
    else:
        body[field] = value
    if path == "/tokenize":
        del body["max_tokens"]
    error = error_of(post(server, path, body), 400)
    assert error["message"] == f"{field}: Input should be a valid boolean (got {value!r})", error
    assert error["param"] == field


# ---- strings that are not Unicode, NUL bytes ----------------------------------------------------------------
@pytest.mark.parametrize("path, body, where", [
    (CHAT, rb'{"messages": [{"role": "user", "content": "a\ud800b"}], "max_tokens": 2}', "messages.0.content"),
    (CHAT, rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]}',
     "messages.0.content.0.text"),
    (COMPLETIONS, rb'{"prompt": "a\ud800b", "max_tokens": 2}', "prompt"),
    (COMPLETIONS, b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 2}', "prompt"),  # its UTF-8-style bytes, unescaped
    (COMPLETIONS, rb'{"prompt": ["ok", "x\udc00"], "max_tokens": 2}', "prompt.1"),
    (COMPLETIONS, rb'{"prompt": "hi", "model": "\ud800"}', "model"),
    ("/tokenize", rb'{"prompt": "a\ud800b"}', "prompt"),
    (COMPLETIONS, rb'{"prompt": "hi", "stop": ["\ude00\ud83d"]}', "stop.0"),  # a pair in the wrong order
    (CHAT, rb'{"messages": [{"role": "user", "content": "hi"}], "\ud800key": 1}', "\\ud800key"),
])
def test_an_unpaired_surrogate_anywhere_is_a_400_naming_where(server, path, body, where):
    before = server.metrics()["hybridkv:prompt_tokens_total"]
    error = error_of(post(server, path, body), 400)
    assert error["message"].startswith(f"{where}: not valid Unicode: the string holds an unpaired surrogate"), error
    assert server.metrics()["hybridkv:prompt_tokens_total"] == before  # refused before tokenizing
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_surrogate_pairs_and_nul_characters_are_ordinary_text(server):
    emoji = post(server, CHAT, rb'{"messages": [{"role": "user", "content": "\ud83d\ude00 a\u0000b"}], '
                               rb'"max_tokens": 2, "stop": ["\u0000"]}')
    assert emoji.status_code == 200, emoji.text
    prompt = post(server, COMPLETIONS, rb'{"prompt": "a\u0000b\u0000", "max_tokens": 2}')
    assert prompt.status_code == 200, prompt.text
    assert prompt.json()["usage"]["prompt_tokens"] == len(server.tokenizer.encode("a\0b\0"))
    raw_nul = post(server, COMPLETIONS, b'{"prompt": "a\x00b", "max_tokens": 2}')  # unescaped: not JSON
    assert "malformed JSON" in error_of(raw_nul, 400)["message"]


@pytest.mark.parametrize("model", [r"x\u0000y", r"\u00e9\ud83d\udca5", r"`}{%s\\n\"", r"\u202e\ufeff"])
def test_the_404_for_an_unknown_model_survives_odd_characters(server, model):
    body = f'{{"prompt": "hi", "max_tokens": 1, "model": "{model}"}}'.encode()
    error = error_of(post(server, COMPLETIONS, body), 404)
    assert error["param"] == "model" and json.loads(f'"{model}"') in error["message"]


# ---- lengths -----------------------------------------------------------------------------------------------
def test_max_tokens_beyond_the_context_left_names_both_numbers(server):
    error = error_of(post(server, COMPLETIONS, {"prompt": [5] * 12, "max_tokens": 600}), 400)
    assert error["message"] == (
        "'max_tokens' is too large: 600. This model's maximum context length is 512 tokens and your request has "
        "12 input tokens (600 > 512 - 12)")
    assert error["param"] == "max_tokens"
    error = error_of(post(server, CHAT, {"messages": USER, "max_completion_tokens": 10_000}), 400)
    assert "'max_completion_tokens' is too large: 10000" in error["message"]
    # exactly what is left still fits
    r = post(server, COMPLETIONS, {"prompt": [5] * 500, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 12


def test_a_huge_prompt_is_refused_for_its_characters_before_tokenizing(server):
    chars = MAX_MODEL_LEN * server.tokenizer.max_token_chars + 1
    start = time.monotonic()
    error = error_of(post(server, COMPLETIONS, {"prompt": "a" * chars}), 400)
    assert f"the prompt is {chars:,} characters long, more than max_model_len 512 tokens can hold" in \
        error["message"]
    error = error_of(post(server, CHAT, {"messages": [{"role": "user", "content": "b " * chars}]}), 400)
    assert "characters long" in error["message"]
    print(f"refused in {time.monotonic() - start:.2f}s")


def test_a_prompt_just_under_the_character_bound_still_gets_the_token_count(server):
    error = error_of(post(server, COMPLETIONS, {"prompt": "hello " * 600}), 400)
    assert "tokens long but max_model_len is 512" in error["message"]


# ---- fields ------------------------------------------------------------------------------------------------
BAD_FIELDS = {
    "n over max_num_seqs": (COMPLETIONS, {"prompt": "hi", "n": 100_000}, "n must be <= max_num_seqs (8), got 100000"),
    "best_of over n": (COMPLETIONS, {"prompt": "hi", "best_of": 4}, "best_of must equal n"),
    "best_of under n": (CHAT, {"messages": USER, "n": 3, "best_of": 2}, "best_of must be >= n"),
    "logit_bias word key": (CHAT, {"messages": USER, "logit_bias": {"hello": 5}},
                            "logit_bias: keys must be token ids (integers), got 'hello'"),
    "logit_bias float key": (COMPLETIONS, {"prompt": "hi", "logit_bias": {"1.5": 5}}, "got '1.5'"),
    "logit_bias out of vocab": (COMPLETIONS, {"prompt": "hi", "logit_bias": {"999999": 5}},
                                "logit_bias: token id 999999 is outside the vocabulary"),
    "logit_bias value": (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 1000}}, "values must be in [-100, 100]"),
    "logit_bias not a map": (COMPLETIONS, {"prompt": "hi", "logit_bias": [1, 2]}, "logit_bias"),
    "seed too big": (COMPLETIONS, {"prompt": "hi", "seed": 2**64}, "seed must fit in 64 bits"),
    "stop token outside vocab": (CHAT, {"messages": USER, "stop_token_ids": [10**12]},
                                 "stop_token_ids: token id 1000000000000 is outside the vocabulary"),
    "suffix": (COMPLETIONS, {"prompt": "hi", "suffix": "end"}, "suffix: not supported"),
    "beam search": (COMPLETIONS, {"prompt": "hi", "use_beam_search": True}, "use_beam_search: beam search"),
    "prompt_logprobs over 20": (CHAT, {"messages": USER, "prompt_logprobs": 21}, "prompt_logprobs must be <= 20"),
    "chat_template": (CHAT, {"messages": USER, "chat_template": "{{ messages }}"}, "chat_template: a per-request chat template"),
    "audio out": (CHAT, {"messages": USER, "modalities": ["text", "audio"]}, "modalities: only ['text']"),
    "echo in chat": (CHAT, {"messages": USER, "echo": True}, "echo: echoing"),
    "image part": (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                   "messages.0.content"),
}


@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_fields_out_of_range_or_unsupported_are_a_400_naming_them(server, case):
    path, body, needle = BAD_FIELDS[case]
    error = error_of(post(server, path, body), 400)
    assert needle in error["message"], error
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_neutral_values_of_unsupported_fields_are_accepted(server):
    body = {"prompt": "hi", "max_tokens": 2, "suffix": None, "use_beam_search": False, "best_of": 2, "n": 2,
            "prompt_logprobs": None, "length_penalty": 1.0, "logit_bias": {}}
    r = post(server, COMPLETIONS, body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 2


def test_logit_bias_steers_sampling(server):
    token = server.tokenizer.encode(" banana", add_special_tokens=False)[-1]
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0,
            "logit_bias": {str(token): 100}}
    r = post(server, COMPLETIONS, body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == server.tokenizer.decode([token] * 4)
    banned = post(server, COMPLETIONS, {**body, "logit_bias": {}}).json()["choices"][0]["text"]
    first = server.tokenizer.encode(banned, add_special_tokens=False)[0]
    again = post(server, COMPLETIONS, {**body, "logit_bias": {str(first): -100}}).json()["choices"][0]["text"]
    assert server.tokenizer.encode(again, add_special_tokens=False)[0] != first
