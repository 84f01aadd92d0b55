"""Structured outputs and tool calls over HTTP with the official ``openai`` client, on the real SmolLM2 model.

``server`` is a bare ``hybridkv serve`` (no tool flags): JSON mode, JSON schemas, vLLM's ``structured_outputs`` on
both endpoints, tool_choice ``required`` and named functions, and the 400s. ``make_serve`` has the flags the
Makefile's ``serve`` passes (``--enable-auto-tool-choice --tool-call-parser hermes --chat-template
tool_chat_template_smollm2.jinja``), for tool_choice ``auto``.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from test_openai_server import MODEL, TIMEOUT, Server, wait_idle_and_free

from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.model.loading.checkpoint import load_checkpoint
from hybridkv.server.tool_calls import ToolConfig, load_chat_template

PERSON = json.loads((Path(__file__).parents[1] / "data" / "person.schema.json").read_text())  # small, closed
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 20},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}},
                                                "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
CONFIG = EngineConfig(max_model_len=512, kv_cache_memory_bytes=64 << 20, max_num_seqs=16)

@pytest.fixture(scope="module")
def loaded():
    return load_checkpoint(None)


@pytest.fixture(scope="module")
def server(loaded):
    with Server(LLMEngine(CONFIG, loaded)) as srv:
        yield srv


@pytest.fixture(scope="module")
def make_serve(loaded):
    tools = ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    template = load_chat_template("tool_chat_template_smollm2.jinja")
    with Server(LLMEngine(CONFIG, loaded), tools=tools, chat_template=template) as srv:
        yield srv


# ---- JSON mode and JSON schemas (OpenAI's response_format) --------------------------------------------------
def test_json_mode(server):
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object describing a cat, with its name "
                                                           "and age."}],
        response_format={"type": "json_object"}, max_tokens=60, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_langchain_json_mode_returns_the_object(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Cat(BaseModel):
        name: str
        age: int

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="none", temperature=0, max_tokens=60,
                     max_retries=0, timeout=TIMEOUT)
    cat = llm.with_structured_output(Cat, method="json_mode").invoke(
        'Describe a cat as a JSON object with exactly two keys: "name" (a string) and "age" (an integer).')
    assert isinstance(cat, Cat) and cat.name, cat


def test_unsatisfiable_schema_and_external_ref_are_a_400_before_queueing(server):
    client = server.client()
    before = server.metrics()["hybridkv:prompt_tokens_total"]
    cases = {
        "only leads back to itself through other $refs; no value satisfies it":
            {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
        "$ref 'http://example.com/cat.json' (at properties.cat) is not a reference inside the schema":
            {"type": "object", "properties": {"cat": {"$ref": "http://example.com/cat.json"}}},
    }
    mutual = {"$defs": {"a": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
                        "b": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]}},
              "$ref": "#/$defs/a"}
    cases |= {  # each compiled into a grammar whose output broke the schema, or never ended
        "not: {} rules out every value, so no value satisfies the schema": {"not": {}},
        "no value is both string and integer": {"allOf": [{"type": "string"}, {"type": "integer"}]},
        "const 5 is not a string (type)": {"type": "string", "const": 5},
        "required property 'a' is not in properties, and additionalProperties is false":
            {"type": "object", "required": ["a"], "additionalProperties": False},
        "type: [] allows no type": {"type": []},
        "(#/$defs/a -> #/$defs/b -> #/$defs/a), with no way to end": mutual,
        "uniqueItems is not enforced by the grammar backend (xgrammar)": {"type": "array", "uniqueItems": True},
    }
    for needle, schema in cases.items():
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, response_format=fmt, max_tokens=5)
        assert needle in info.value.body["message"], info.value.body
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="x", max_tokens=5, extra_body={"response_format": fmt})
    assert server.metrics()["hybridkv:prompt_tokens_total"] == before  # refused before the engine saw them


def test_json_schema_strict_chat_stream_and_non_stream(server):
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    messages = [{"role": "user", "content": "Describe my neighbour."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, max_tokens=80,
                                          temperature=0)
    assert full.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(full.choices[0].message.content), PERSON)
    chunks = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, max_tokens=80,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content


def test_json_schema_on_completions(server):
    r = server.client().completions.create(
        model=MODEL, prompt="A person, as JSON:", max_tokens=80, temperature=0.7, seed=5, n=2,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), PERSON)


# ---- vLLM's structured_outputs on both endpoints -----------------------------------------------------------
CONSTRAINTS = {
    "json": ({"json": PERSON, "disable_any_whitespace": True},
             lambda text: jsonschema.validate(json.loads(text), PERSON) or text == json.dumps(json.loads(text))),
    "regex": ({"regex": r"\d{3}-\d{4}"}, lambda text: re.fullmatch(r"\d{3}-\d{4}", text)),
    "choice": ({"choice": ["yes", "no"]}, lambda text: text in ("yes", "no")),
    "grammar": ({"grammar": 'root ::= "Answer: " ("red" | "green" | "blue") "."'},
                lambda text: re.fullmatch(r"Answer: (red|green|blue)\.", text)),
}


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_structured_outputs_on_both_endpoints(server, kind):
    spec, valid = CONSTRAINTS[kind]
    client = server.client()
    extra = {"structured_outputs": spec}
    completion = client.completions.create(model=MODEL, prompt="Question: what is it? Reply:", max_tokens=60,
                                           temperature=0, extra_body=extra)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is it?"}],
                                          max_tokens=60, temperature=0, extra_body=extra)
    for text, reason in ((completion.choices[0].text, completion.choices[0].finish_reason),
                         (chat.choices[0].message.content, chat.choices[0].finish_reason)):
        assert reason == "stop" and valid(text), text


def test_concurrent_requests_with_different_constraints_share_the_batch(server):
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        kind = list(CONSTRAINTS)[i % len(CONSTRAINTS)]
        r = await client.completions.create(model=MODEL, prompt=f"Item {i}:", max_tokens=60, temperature=0.8, seed=i,
                                            extra_body={"structured_outputs": CONSTRAINTS[kind][0]})
        assert r.choices[0].finish_reason == "stop"
        return kind, r.choices[0].text

    async def main() -> list[tuple[str, str]]:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=120, max_retries=0)
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(8)))

    for kind, text in asyncio.run(main()):
        assert CONSTRAINTS[kind][1](text), (kind, text)
    wait_idle_and_free(server)


BAD = {
    "unknown response_format type": ({"response_format": {"type": "nonsense"}},
                                     "response_format.type: Input should be 'text', 'json_object' or 'json_schema'"),
    "json_schema without schema": ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                                   "json_schema.schema"),
    "invalid schema": ({"structured_outputs": {"json": {"type": "nonsense"}}},
                       'structured_outputs.json: Unsupported type "nonsense"'),
    "bad regex": ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex: Regex parsing error"),
    "bad grammar": ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs.grammar: EBNF"),
    "two constraints": ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of"),
    "no constraint": ({"structured_outputs": {}}, "exactly one of"),
    "both fields": ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
                    "cannot be combined"),
    "structural_tag": ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag: not supported"),
    "removed guided_json": ({"guided_json": PERSON}, "guided_json: removed in vLLM"),
    "tools, auto, no flags": ({"tools": TOOLS}, "--enable-auto-tool-choice"),
    "required with response_format": ({"tools": TOOLS, "tool_choice": "required",
                                       "response_format": {"type": "json_object"}}, "cannot be combined"),
    "unknown named tool": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                           "'nope' is not among the tools"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_requests_are_400_saying_why(server, case):
    fields, needle = BAD[case]
    for path, body in (("/v1/chat/completions", {"messages": ASK_WEATHER}), ("/v1/completions", {"prompt": "hi"})):
        if "tools" in fields and path == "/v1/completions":
            continue
        r = httpx.post(server.url + path, json={**body, **fields, "max_tokens": 4}, timeout=TIMEOUT)
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"], r.json()
    assert httpx.get(f"{server.url}/health").status_code == 200


# ---- tool calls (no server flags needed for required / named) ----------------------------------------------
def _check_calls(calls) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_required(server):
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                       max_tokens=80, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    _check_calls(choice.message.tool_calls)

    calls, finish = {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS,
                                                tool_choice="required", max_tokens=80, temperature=0, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            calls[d.index] = (d.function.name, d.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert list(calls.values()) == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def _streamed_calls(client: openai.OpenAI, **kw) -> tuple[list[tuple[str, str]], str | None, str]:
    """(name, arguments) per call as the deltas build them up, the finish reason, and the content."""
    calls: dict[int, list[str]] = {}
    finish, content = None, ""
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            name, arguments = calls.setdefault(d.index, ["", ""])
            calls[d.index] = [name + (d.function.name or ""), arguments + (d.function.arguments or "")]
        finish = chunk.choices[0].finish_reason or finish
    return [tuple(c) for c in calls.values()], finish, content


@pytest.mark.parametrize("tool_choice, max_tokens", [
    ("required", 24), ({"type": "function", "function": {"name": "get_weather"}}, 8)])
def test_a_tool_call_cut_by_max_tokens_is_still_a_tool_call(server, tool_choice, max_tokens):
    client = server.client()
    kw = dict(messages=ASK_WEATHER, tools=TOOLS, tool_choice=tool_choice, temperature=0)
    whole = client.chat.completions.create(model=MODEL, max_tokens=80, **kw).choices[0].message.tool_calls[0]
    cut = client.chat.completions.create(model=MODEL, max_tokens=max_tokens, **kw).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    [call] = cut.message.tool_calls
    assert call.function.name == whole.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    assert 0 < len(call.function.arguments) < len(whole.function.arguments), (call, whole)
    squeeze = lambda text: "".join(text.split())  # noqa: E731  complete arguments are re-serialized JSON
    assert squeeze(whole.function.arguments).startswith(squeeze(call.function.arguments)), (call, whole)
    streamed = _streamed_calls(client, max_tokens=max_tokens, **kw)
    assert streamed == ([(call.function.name, call.function.arguments)], "length", "")


def test_named_function(server):
    client = server.client()
    named = {"type": "function", "function": {"name": "add"}}
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named, max_tokens=60,
                                       temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and [c.function.name for c in choice.message.tool_calls] == ["add"]
    _check_calls(choice.message.tool_calls)

    name, arguments, pieces = None, "", 0
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named,
                                                max_tokens=60, temperature=0, stream=True):
        for d in chunk.choices[0].delta.tool_calls or []:
            name = name or d.function.name
            arguments += d.function.arguments or ""
            pieces += 1
    assert name == "add" and arguments == choice.message.tool_calls[0].function.arguments and pieces > 1


def test_a_tool_conversation_goes_back_to_the_model(server):
    client = server.client()
    first = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                           max_tokens=80, temperature=0).choices[0].message
    call = first.tool_calls[0]
    messages = [*ASK_WEATHER, first.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    assert r.usage.prompt_tokens > client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, max_tokens=1).usage.prompt_tokens + 5  # the tool's answer is in the prompt


# ---- tool_choice auto (make serve's flags) ------------------------------------------------------------------
CALL_REGEX = r'I will check\. <tool_call>\[\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", ' \
             r'"unit": "celsius"\}\}\]</tool_call>'


def test_openai_tool_call_code_works_unchanged(make_serve):
    """The openai docs' tool example: tools, no tool_choice (auto); the model may answer or call."""
    r = make_serve.client().chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=40,
                                                    temperature=0)
    choice = r.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        _check_calls(choice.message.tool_calls)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")


def test_auto_renders_tools_into_the_prompt(make_serve):
    client = make_serve.client()
    plain = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=1)
    with_tools = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=1)
    rendered = len(make_serve.tokenizer.encode(json.dumps(TOOLS, ensure_ascii=False), add_special_tokens=False))
    assert with_tools.usage.prompt_tokens - plain.usage.prompt_tokens > rendered


def test_auto_parses_tool_calls_from_the_output(make_serve):
    client = make_serve.client()
    extra = {"structured_outputs": {"regex": CALL_REGEX}}  # makes the model write a call, to parse it
    r = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=60, temperature=0,
                                       extra_body=extra)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will check. "
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
    _check_calls(choice.message.tool_calls)

    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=60,
                                                temperature=0, extra_body=extra, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += [(d.function.name, d.function.arguments) for d in delta.tool_calls or []]
        finish = chunk.choices[0].finish_reason or finish
    assert (content, finish) == ("I will check. ", "tool_calls")
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_auto_tool_call_cut_by_max_tokens_is_still_a_tool_call(make_serve):
    client = make_serve.client()
    kw = dict(messages=ASK_WEATHER, tools=TOOLS, temperature=0, extra_body={"structured_outputs": {"regex": CALL_REGEX}})
    cut = client.chat.completions.create(model=MODEL, max_tokens=30, **kw).choices[0]
    assert cut.finish_reason == "length" and cut.message.content == "I will check. "
    [call] = cut.message.tool_calls
    assert call.function.name == "get_weather" and '"city": "' in call.function.arguments
    assert not call.function.arguments.endswith("}}")  # cut: the arguments are unfinished
    assert _streamed_calls(client, max_tokens=30, **kw) == (
        [("get_weather", call.function.arguments)], "length", "I will check. ")
    # cut before the name is complete: the text stays content
    early = client.chat.completions.create(model=MODEL, max_tokens=15, **kw).choices[0]
    assert early.finish_reason == "length" and not early.message.tool_calls
    assert early.message.content.startswith("I will check. <tool_call>")


def test_auto_without_a_call_is_plain_content(make_serve):
    r = make_serve.client().chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="auto", max_tokens=30, temperature=0,
        extra_body={"structured_outputs": {"regex": r"It is sunny in [A-Z][a-z]{2,8}\."}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert re.fullmatch(r"It is sunny in [A-Z][a-z]{2,8}\.", choice.message.content)
