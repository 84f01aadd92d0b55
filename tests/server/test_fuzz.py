"""Hypothesis-generated requests (plausible values, edge values and arbitrary JSON in every field of the three
generating endpoints; strings with unpaired surrogates and NUL characters; raw bodies with NUL bytes and Content-Lengths that
lie; numbers beyond a float's range or Python's int limit, NaN and Infinity, deep nesting, booleans that are not
booleans; JSON schemas that are refused): every answer is a 2xx or a 4xx, never a 200 for a refused schema, and the
server is healthy and holds no request or KV block after.

Derandomized, so CI runs the same examples every time."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridkv.engine.llm_engine import EngineConfig
from hybridkv.server.app import build_app
from hybridkv.server.limits import RequestLimits
from hybridkv.server.options import ServerOptions

MAX_MODEL_LEN = 96
BODY_TIMEOUT_S = 0.3  # a body that lies about its length waits this long for the rest, then gets 408


ODD = st.sampled_from(["\x00", "\ud800", "\udfff", "\ud83d\ude00", "\ude00\ud83d"]) | st.characters(
    categories=["Cs"])
# text holding at least one lone surrogate (which json.dumps escapes as \\udXXX), a NUL or a surrogate pair
odd_strings = st.tuples(st.text(max_size=6), ODD, st.text(max_size=6)).map("".join)


def odd_text(max_size: int) -> st.SearchStrategy:
    """Text that is sometimes not Unicode or holds NULs."""
    plain = st.text(max_size=max_size)
    return st.sampled_from([plain] * 3 + [st.lists(ODD | st.characters(), max_size=max_size).map("".join)]).flatmap(
        lambda strategy: strategy)


scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | \
    odd_text(12)
any_json = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(odd_text(6),
                                                                                              inner, max_size=3),
                        max_leaves=6)
edge_ints = st.sampled_from([0, -1, 2**31, 2**63, -(2**63) - 1, 2**64, 10**30])
token_ids = st.lists(st.integers(0, 49_151) | st.sampled_from([-1, 49_152, 10**12]), max_size=8)
text = odd_text(40)
few_tokens = st.integers(1, 6) | edge_ints  # generations stay short: the fuzzing is about input, not output


def mostly(valid: st.SearchStrategy, edge: st.SearchStrategy) -> st.SearchStrategy:
    # 7 in 8 valid, so that many bodies pass validation and run (one_of would pick either side half the time)
    return st.sampled_from([valid] * 7 + [edge]).flatmap(lambda strategy: strategy)


# plausible values for every field the endpoints read or refuse, edge values included
SAMPLING = {
    "model": mostly(st.just("smollm2-135m-instruct"), st.sampled_from(["gpt-4", ""]) | odd_text(8)),
    "n": mostly(st.integers(1, 2), edge_ints | st.just(3)),
    "best_of": mostly(st.none(), st.integers(0, 3)),
    "temperature": mostly(st.floats(0, 2), st.floats(-1, 3) | st.sampled_from([1e-9, 1e308])),
    "top_p": mostly(st.floats(0.01, 1), st.floats(-0.5, 1.5)),
    "top_k": mostly(st.integers(-1, 60), edge_ints),
    "min_p": mostly(st.floats(0, 1), st.floats(-0.5, 1.5)),
    "presence_penalty": mostly(st.floats(-2, 2), st.floats(-3, 3)),
    "frequency_penalty": mostly(st.floats(-2, 2), st.floats(-3, 3)),
    "repetition_penalty": mostly(st.floats(0.01, 3), st.floats(-1, 0) | st.sampled_from([1e308, 1e-308])),
    "stop": text | st.lists(text, max_size=3),
    "stop_token_ids": token_ids,
    "seed": mostly(st.integers(0, 2**32), st.integers() | edge_ints),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "ignore_eos": st.booleans(),
    "min_tokens": mostly(st.integers(0, 4), edge_ints),
    "logit_bias": mostly(st.dictionaries(st.integers(0, 49_151).map(str), st.floats(-100, 100), max_size=3),
                         st.dictionaries(st.from_regex(r"-?[0-9]{1,6}", fullmatch=True) | text,
                                         st.floats(-200, 200), max_size=3)),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "cache_salt": text,
    "suffix": mostly(st.none(), text),
    "use_beam_search": mostly(st.just(False), st.just(True)),
    "truncate_prompt_tokens": mostly(st.none(), st.integers(-1, 8)),
    "prompt_logprobs": mostly(st.none() | st.integers(0, 3), st.integers(-1, 21) | edge_ints),
}
COMPLETION = {**SAMPLING, "logprobs": mostly(st.integers(0, 5), st.integers(-1, 21) | edge_ints),
              "echo": mostly(st.just(False), st.just(True))}
part = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": text})
message = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["system", "user", "assistant", "developer", "tool"]), st.just("wizard"))},
    optional={"content": st.none() | text | st.lists(part, max_size=2), "name": text})
CHAT = {**SAMPLING, "max_completion_tokens": few_tokens, "logprobs": st.booleans(),
        "top_logprobs": mostly(st.integers(0, 5), st.integers(-1, 21) | edge_ints),
        "add_generation_prompt": st.booleans(), "modalities": mostly(st.just(["text"]), st.just(["audio"]))}
# the Responses API: input items, flat function tools, text.format, and the fields it refuses
input_part = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                    "text": text})
input_item = st.one_of(
    st.fixed_dictionaries({"role": mostly(st.sampled_from(["user", "assistant", "system", "developer"]),
                                          st.just("tool"))},
                          optional={"type": st.just("message"), "content": text | st.lists(input_part, max_size=2)}),
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": text, "name": text,
                           "arguments": mostly(st.just('{"city": "Oslo"}'), text)}),
    st.fixed_dictionaries({"type": mostly(st.just("function_call_output"), st.just("reasoning")), "call_id": text,
                           "output": text}),
)
function_tool = st.fixed_dictionaries(
    {"type": mostly(st.just("function"), st.just("web_search")), "name": mostly(st.just("get_weather"), text)},
    optional={"parameters": mostly(st.just({"type": "object", "properties": {"city": {"type": "string"}}}),
                                   any_json),
              "description": text})
text_format = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "json_object", "json_schema", "grammar"])},
    optional={"name": text, "schema": mostly(st.just({"type": "object"}), any_json), "strict": st.booleans()})
RESPONSES = {
    "model": SAMPLING["model"], "temperature": SAMPLING["temperature"], "top_p": SAMPLING["top_p"],
    "stream": st.booleans(), "instructions": text, "tools": st.lists(function_tool, max_size=2),
    "tool_choice": st.sampled_from(["none", "auto", "required"]) | st.fixed_dictionaries(
        {"type": st.just("function"), "name": mostly(st.just("get_weather"), text)}),
    "parallel_tool_calls": st.booleans(), "text": st.fixed_dictionaries({}, optional={"format": text_format}),
    "previous_response_id": text, "store": st.booleans(), "metadata": st.dictionaries(text, text, max_size=2),
    "background": mostly(st.none(), st.just(True)), "include": mostly(st.just([]), st.just(["file_search_call"])),
    "truncation": mostly(st.just("disabled"), st.just("auto")), "reasoning": mostly(st.none(), any_json),
}
REQUIRED = {
    "/v1/completions": {"prompt": text | token_ids | st.lists(text, max_size=2) | st.lists(token_ids, max_size=2),
                        "max_tokens": few_tokens},
    "/v1/chat/completions": {"messages": st.lists(message, min_size=1, max_size=3), "max_tokens": few_tokens},
    "/v1/responses": {"input": text | st.lists(input_item, min_size=1, max_size=3), "max_output_tokens": few_tokens},
}
OPTIONAL = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/v1/responses": RESPONSES}


def plausible(path: str) -> st.SearchStrategy:
    return st.fixed_dictionaries(REQUIRED[path], optional=OPTIONAL[path])


def one_field_anything(path: str) -> st.SearchStrategy:
    """A plausible body with one field (or an unknown one) replaced by arbitrary JSON."""
    names = sorted({*REQUIRED[path], *OPTIONAL[path], "unknown_field"})
    return st.tuples(plausible(path), st.sampled_from(names), any_json).map(lambda t: {**t[0], t[1]: t[2]})


# a small valid body with an odd string where a client's text goes: these reach the tokenizer unless refused
ODD_PLACES = {
    "/v1/completions": lambda t: [{"prompt": t}, {"prompt": [t]}, {"prompt": "hi", "model": t},
                                  {"prompt": "hi", "stop": [t]}, {"prompt": "hi", t: 1}],
    "/v1/chat/completions": lambda t: [{"messages": [{"role": "user", "content": t}]},
                                       {"messages": [{"role": "user", "content": [{"type": "text", "text": t}]}]},
                                       {"messages": [{"role": "user", "content": "hi", "name": t}]},
                                       {"messages": [{"role": "user", "content": "hi"}], "model": t}],
    "/v1/responses": lambda t: [{"input": t}, {"input": [{"role": "user", "content": [{"type": "input_text",
                                                                                        "text": t}]}]},
                                {"input": "hi", "instructions": t}, {"input": "hi", "previous_response_id": t},
                                {"input": [{"type": "function_call_output", "call_id": "c", "output": t}]}],
}


def odd_string_body(path: str) -> st.SearchStrategy:
    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    return st.tuples(odd_strings, st.integers(0, 4)).map(
        lambda t: {**(places := ODD_PLACES[path](t[0]))[t[1] % len(places)], limit: 2})


# JSON schemas no value satisfies, or with keywords the grammar would not enforce: docs/api.md says each is refused
UNSATISFIABLE_SCHEMAS = [
    {"not": {}},
    {"allOf": [{"type": "string"}, {"type": "integer"}]},
    {"type": "string", "const": 5},
    {"type": "object", "required": ["a"], "additionalProperties": False},
    {"type": []},
    {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
               "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
     "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},
    {"type": "string", "enum": [1, 2]},
    {"type": "array", "minItems": 1, "items": False},
    {"anyOf": [{"type": []}, {"not": True}]},
    False,
]
UNENFORCED_SCHEMAS = [
    {"type": ["string", "integer"], "not": {"type": "string"}},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    {"type": "object", "required": ["a"]},
    {"oneOf": [{"type": "number"}, {"type": "integer"}]},
    {"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}},
    {"type": "number", "multipleOf": 0.5},
]
REFUSED_SCHEMAS = UNSATISFIABLE_SCHEMAS + UNENFORCED_SCHEMAS


def constraint(schema, where: int, path: str = "/v1/chat/completions") -> dict:
    """``schema`` as response_format, as structured_outputs.json, or (chat) as a required tool's parameters; for
    /v1/responses as text.format or a required tool's parameters."""
    if path == "/v1/responses":
        return [{"text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}},
                {"tools": [{"type": "function", "name": "f", "parameters": schema}], "tool_choice": "required"}][where]
    return [{"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
            {"structured_outputs": {"json": schema}},
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
             "tool_choice": "required"}][where]


def refused_schema_body(path: str) -> st.SearchStrategy:
    places = 3 if path == "/v1/chat/completions" else 2
    return st.tuples(plausible(path), st.sampled_from(REFUSED_SCHEMAS), st.integers(0, places - 1)).map(
        lambda t: {**{k: v for k, v in t[0].items() if k not in ("response_format", "structured_outputs", "text")},
                   **constraint(t[1], t[2], path)})


BOOLEANS = {"/v1/completions": ["echo", "stream", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output"],
            "/v1/chat/completions": ["stream", "logprobs", "add_generation_prompt", "parallel_tool_calls",
                                     "ignore_eos"],
            "/v1/responses": ["stream", "store", "parallel_tool_calls"]}
not_booleans = st.sampled_from(["yes", "true", "false", 1, 0, "on", 1.0, [], {}])


def loose_boolean_body(path: str) -> st.SearchStrategy:
    return st.tuples(plausible(path), st.sampled_from(BOOLEANS[path] + ["stream_options"]), not_booleans).map(
        lambda t: {**t[0], t[1]: {"include_usage": t[2]} if t[1] == "stream_options" else t[2]})


PATHS = sorted(REQUIRED)
requests = st.one_of(
    *(st.tuples(st.just(path), plausible(path)) for path in PATHS),
    *(st.tuples(st.just(path), one_field_anything(path)) for path in PATHS),
    *(st.tuples(st.just(path), odd_string_body(path)) for path in PATHS),
    *(st.tuples(st.just(path), refused_schema_body(path)) for path in PATHS),
    *(st.tuples(st.just(path), loose_boolean_body(path)) for path in PATHS),
    st.tuples(st.sampled_from(PATHS), any_json),
)


@pytest.fixture(scope="module")
def client():
    config = EngineConfig(max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=32 << 20, max_num_seqs=2)
    options = ServerOptions(limits=RequestLimits(max_body_bytes=1 << 20, body_read_timeout_s=BODY_TIMEOUT_S))
    with TestClient(build_app(config, options=options)) as c:
        yield c


@pytest.fixture(scope="module")
def port(client):
    """The same app, engine and all, on a real socket too (its lifespan already runs under ``client``): raw
    bytes and Content-Lengths that lie, which no HTTP client library sends."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(client.app, lifespan="off", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(30)
    sock.close()


def exchange(port: int, raw: bytes) -> tuple[int, bytes]:
    """Send ``raw`` on a fresh connection; the status and the response, read until the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(raw)
        response = b""
        while chunk := s.recv(1 << 16):
            response += chunk
    return int(response.split(b" ", 2)[1]), response


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(request=requests)
def test_no_request_gets_a_5xx(client, request):
    path, body = request
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert 200 <= r.status_code < 500, (r.status_code, r.text)
    if r.status_code >= 400:
        error = r.json()["error"]
        assert error["code"] == r.status_code and error["message"]
    elif r.headers["content-type"].startswith("text/event-stream") and path == "/v1/responses":
        last = r.text.rstrip().rsplit("\n\n", 1)[-1]  # no [DONE] here: the last event closes the response
        assert last.split("\n")[0] in ("event: response.completed", "event: response.incomplete"), r.text
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(path=st.sampled_from(PATHS), data=st.data())
def test_a_refused_schema_never_gets_a_200(client, path, data):
    """Each schema docs/api.md says is refused, wherever it goes (response_format, structured_outputs, a required
    tool), with any plausible other fields: a 4xx, never an output."""
    body = data.draw(refused_schema_body(path))
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])  # the schema's 400, or another field's 4xx
    assert r.json()["error"]["message"]


SMALL_BODIES = {"/v1/completions": {"prompt": "hi", "max_tokens": 4},
                "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                "/v1/responses": {"input": "hi", "max_output_tokens": 4}}


def test_every_refused_schema_is_a_400_saying_why(client):
    for path in PATHS:
        for schema in REFUSED_SCHEMAS:
            for where in range(3 if path == "/v1/chat/completions" else 2):
                r = client.post(path, json={**SMALL_BODIES[path], **constraint(schema, where, path)})
                assert r.status_code == 400, (path, schema, where, r.text[:300])
                message = r.json()["error"]["message"]
                if where < (1 if path == "/v1/responses" else 2):  # in a tool, the array of calls around it may be what is refused first
                    assert "no value satisfies the schema" in message or "grammar backend (xgrammar)" in message \
                        or "valid dictionary" in message or "a JSON schema is an object" in message, message


# number literals json.dumps cannot write: each replaces a value in a plausible body, as raw bytes
HOSTILE_NUMBERS = [b"1e999", b"-1.5E+400", b"7" * 4301, b"-" + b"9" * 6000, b"NaN", b"Infinity", b"-Infinity",
                   b"1" + b"0" * 400 + b".5"]
NUMBER_PLACES = ["temperature", "top_p", "seed", "max_tokens", "n", "logit_bias.5", "prompt.1", "stop_token_ids.0",
                 "response_format.json_schema.schema.maximum", "unknown_field.x"]
MARK = "\u0001number\u0001"


def with_number(body: dict, place: str) -> tuple[dict, str]:
    """``body`` with MARK at ``place`` (a list index taken modulo the list's length), and the path it went to."""
    body = json.loads(json.dumps(body))
    *parents, last = place.split(".")
    node = body
    for key in parents:
        node = node.setdefault(key, [0] if key in ("prompt", "stop_token_ids") else
                               {"type": "json_schema", "json_schema": {"schema": {}}} if key == "response_format"
                               else {})
        if key == "prompt" and not isinstance(node, list):
            node = body[key] = [1, 2]
    if isinstance(node, list):
        last = str(int(last) % len(node))
        node[int(last)] = MARK
    else:
        node[last] = MARK
    return body, ".".join([*parents, last])


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(path=st.sampled_from(PATHS), literal=st.sampled_from(HOSTILE_NUMBERS), place=st.sampled_from(NUMBER_PLACES),
       data=st.data())
def test_numbers_beyond_json_or_python_are_a_400_naming_the_field(port, path, literal, place, data):
    """Over a real socket: the 400 names the field, and the kept-alive connection still serves the next request."""
    body, place = with_number(data.draw(plausible(path)), place)
    raw = json.dumps(body).encode().replace(json.dumps(MARK).encode(), literal)
    head = (f"POST {path} HTTP/1.1\r\nhost: fuzz\r\ncontent-type: application/json\r\n"
            f"content-length: {len(raw)}\r\n\r\n").encode()
    ok = b'{"prompt": "hi", "max_tokens": 1}'
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head + raw)
        first = _read_response(s)
        s.sendall(raw_request("/v1/completions", ok, len(ok)))  # the same connection
        second = _read_response(s)
    assert first.startswith(b"HTTP/1.1 400 "), first[:300]
    error = json.loads(first.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["param"] == place.split(".")[0] and error["message"].startswith(place + ": "), error
    assert second.startswith(b"HTTP/1.1 200 "), second[:300]


def _read_response(s: socket.socket) -> bytes:
    """One HTTP response with a Content-Length, read off a kept-alive socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(1 << 16)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length:")))
    while len(rest) < length:
        rest += s.recv(1 << 16)
    return head + b"\r\n\r\n" + rest


def test_deep_nesting_in_any_field_is_a_400_naming_it(client):
    for path in PATHS:
        for field in ("prompt", "messages", "response_format", "tools", "unknown"):
            raw = b'{"max_tokens": 1, "' + field.encode() + b'": ' + b"[" * 300 + b"]" * 300 + b"}"
            r = client.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text[:300]


def raw_request(path: str, body: bytes, length: int | str) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nhost: fuzz\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {length}\r\n\r\n")
    return head.encode() + body


def with_nul_bytes(body: bytes, at: list[int]) -> bytes:
    for i in sorted(at, reverse=True):
        body = body[: i % (len(body) + 1)] + b"\x00" + body[i % (len(body) + 1):]
    return body


raw_bodies = st.tuples(
    requests,
    st.booleans(),  # strings escaped to ASCII, or raw UTF-8 bytes (a lone surrogate as its invalid 3 bytes)
    st.lists(st.integers(0, 10**6), max_size=2),  # where raw NUL bytes go
    st.sampled_from(["true", "true", "more", "less", "huge", "junk"]),  # what Content-Length says
    st.integers(1, 64),
)


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=raw_bodies)
def test_raw_bodies_and_lying_content_lengths_get_a_2xx_or_4xx(port, case):
    (path, body), escaped, nuls, length_kind, delta = case
    raw = with_nul_bytes(json.dumps(body, ensure_ascii=escaped).encode("utf-8", "surrogatepass"), nuls)
    length = {"true": len(raw), "more": len(raw) + delta, "less": max(0, len(raw) - delta), "huge": 10**12,
              "junk": "12abc"}[length_kind]
    status, response = exchange(port, raw_request(path, raw, length))
    assert 200 <= status < 500, response
    if length_kind == "more":
        assert status == 408 and b"did not arrive within 0.3 s" in response, response
    if length_kind == "huge":
        assert status == 413, response


def test_a_body_shorter_than_its_content_length_gets_408_and_a_closed_connection(port):
    body = b'{"prompt": "hi", "max_tokens": 2}'
    start = time.monotonic()
    status, response = exchange(port, raw_request("/v1/completions", body, len(body) + 10))
    assert time.monotonic() - start < 20  # bounded; exchange() itself only returns once the server closed
    assert status == 408 and b"connection: close" in response.lower()
    error = json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]
    assert error == {"message": f"the request body did not arrive within 0.3 s ({len(body)} bytes of the "
                                f"{len(body) + 10} its Content-Length announced; the server's "
                                "--request-body-timeout-s)", "type": "RequestTimeoutError", "param": None,
                     "code": 408}


def test_the_server_is_healthy_and_empty_after_the_fuzzing(client):
    engine = client.app.state.server.engine.engine
    assert client.get("/health").status_code == 200
    assert not engine.has_unfinished_requests()
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
