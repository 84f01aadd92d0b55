"""Tool-call parsing and planning without a model: the llama3_json and hermes parsers on whole outputs and on
outputs streamed a character at a time, the grammar ``required`` asks for, and the 400s for what cannot be
honoured."""

from __future__ import annotations

import json

import jsonschema
import pytest

from hybridkv.server.protocol import ChatCompletionRequest, ToolDefinition
from hybridkv.server.tool_calls import (
    ToolCallStream,
    ToolConfig,
    ToolPlan,
    extract,
    finish_reason,
    load_chat_template,
    make_parser,
    plan_tools,
    required_schema,
    template_renders_tools,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
USER = [{"role": "user", "content": "hi"}]
AUTO = ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER} | fields)


def plan_for(parser: str) -> ToolPlan:
    return ToolPlan("auto", [WEATHER], parser=make_parser(parser))


# text, parser, content, [(name, arguments)]
OUTPUTS = {
    "llama json": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "llama3_json", None,
                   [("get_weather", {"city": "Paris"})]),
    "llama python_tag, two calls": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
                                    '{"name": "add", "arguments": {"a": 1, "b": 2}}', "llama4_json", None,
                                    [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]),
    "llama plain text": ("The weather is {unknown} today.", "llama3_json", "The weather is {unknown} today.", []),
    "llama broken json": ('{"name": "get_weather", "parameters": {"city": ', "llama3_json",
                          '{"name": "get_weather", "parameters": {"city": ', []),
    "llama json without name": ('{"city": "Paris"}', "llama3_json", '{"city": "Paris"}', []),
    "hermes object": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>', "hermes",
                      None, [("get_weather", {"city": "Rome"})]),
    "smollm2 list after content": ('Let me check. <tool_call>[{"name": "get_weather", "arguments": {"city": "Lima"}},'
                                   ' {"name": "add", "arguments": {"a": 3, "b": 4}}]</tool_call>', "hermes",
                                   "Let me check. ", [("get_weather", {"city": "Lima"}), ("add", {"a": 3, "b": 4})]),
    "hermes text only": ("No tools needed <tool> here.", "hermes", "No tools needed <tool> here.", []),
    "hermes unclosed": ('Sure <tool_call>{"name": "add"', "hermes", 'Sure <tool_call>{"name": "add"', []),
}


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_parse_whole_output(case):
    text, parser, content, calls = OUTPUTS[case]
    got_content, got_calls = extract(plan_for(parser), text)
    assert got_content == content
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("case", list(OUTPUTS))
def test_streaming_a_character_at_a_time_gives_the_same_message(case):
    text, parser, content, calls = OUTPUTS[case]
    stream = ToolCallStream(plan_for(parser))
    sent_content, sent_calls = "", []
    for i, ch in enumerate(text):
        piece, deltas = stream.feed(ch, finished=i == len(text) - 1)
        sent_content += piece or ""
        for d in deltas:
            assert d.index == len(sent_calls) and d.id and d.type == "function"
            sent_calls.append((d.function.name, json.loads(d.function.arguments)))
    assert sent_content == (content or "")
    assert sent_calls == calls
    assert stream.called == bool(calls)


# cut by max_tokens: text, mode (parser for auto), content, [(name, arguments text)]
CUT = {
    "required, second call cut": (
        '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", "parameters": {"city": "Pa',
        "required", None, [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Pa')]),
    "required, name just complete": ('[{"name": "add"', "required", None, [("add", "")]),
    "required, arguments just opened": ('[{"name": "add", "parameters": ', "required", None, [("add", "")]),
    "required, name cut": ('[{"name": "get_wea', "required", '[{"name": "get_wea', []),
    "hermes, call cut": ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Ro',
                         "hermes", "Let me check. ", [("get_weather", '{"city": "Ro')]),
    "smollm2 list, second call cut": (
        '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"ci',
        "hermes", None, [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"ci')]),
    "hermes, block after a complete one cut": (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n<tool_call>{"name": "get_',
        "hermes", None, [("add", '{"a": 1, "b": 2}')]),
    "hermes, name cut": ('Sure <tool_call>{"name": "ad', "hermes", 'Sure <tool_call>{"name": "ad', []),
    "llama json cut": ('{"name": "get_weather", "parameters": {"city": "Os', "llama3_json", None,
                       [("get_weather", '{"city": "Os')]),
}


def cut_plan(mode: str) -> ToolPlan:
    if mode == "required":
        return plan_tools(request(tools=[WEATHER, ADD], tool_choice="required"), ToolConfig(), False)
    return plan_for(mode)


@pytest.mark.parametrize("case", list(CUT))
def test_a_call_cut_by_max_tokens_comes_back_once_its_name_is_complete(case):
    text, mode, content, calls = CUT[case]
    plan = cut_plan(mode)
    got_content, got_calls = extract(plan, text, cut=True)
    assert (got_content, [(c.function.name, c.function.arguments) for c in got_calls]) == (content, calls)
    assert finish_reason(plan, "length", bool(got_calls)) == "length"
    stream = ToolCallStream(plan)
    sent_content, sent_calls = "", []
    for i, ch in enumerate(text):
        piece, deltas = stream.feed(ch, finished=i == len(text) - 1, cut=True)
        sent_content += piece or ""
        sent_calls += [(d.function.name, d.function.arguments) for d in deltas]
    assert (sent_content, sent_calls) == (content or "", calls)


def test_an_unfinished_call_without_the_cut_stays_content():
    text = CUT["required, second call cut"][0]
    assert extract(cut_plan("required"), text) == (text, [])


def test_hermes_holds_back_what_could_open_a_tool_call():
    stream = ToolCallStream(plan_for("hermes"))
    assert stream.feed("Checking <tool_", finished=False) == ("Checking ", [])
    assert stream.feed("box> done", finished=True) == ("<tool_box> done", [])


def test_required_output_streams_each_call_once_complete():
    plan = plan_tools(request(tools=[WEATHER, ADD], tool_choice="required"), ToolConfig(), False)
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "get_weather", "parameters": {"city": "Nice"}}]'
    stream = ToolCallStream(plan)
    first_complete = text.index("}},") + 2
    _, deltas = stream.feed(text[:first_complete], finished=False)
    assert [d.function.name for d in deltas] == ["add"]
    content, deltas = stream.feed(text[first_complete:], finished=True)
    assert content is None and [d.function.name for d in deltas] == ["get_weather"]
    content, calls = extract(plan, text)
    assert content is None and [c.function.name for c in calls] == ["add", "get_weather"]
    assert finish_reason(plan, "stop", True) == "tool_calls" and finish_reason(plan, "length", False) == "length"


def test_named_function_streams_its_arguments_as_they_come():
    plan = plan_tools(request(tools=[WEATHER, ADD], tool_choice={"type": "function", "function": {"name": "add"}}),
                      ToolConfig(), False)
    assert plan.mode == "named" and plan.constraint.json == ADD["function"]["parameters"]
    stream = ToolCallStream(plan)
    pieces = ['{"a": ', "1, ", '"b": 2}']
    deltas = [stream.feed(p, finished=i == 2)[1] for i, p in enumerate(pieces)]
    assert deltas[0][0].function.name == "add" and deltas[0][0].id
    assert all(d[0].id is None and d[0].function.name is None for d in deltas[1:])
    assert "".join(d[0].function.arguments for d in deltas) == "".join(pieces)
    assert finish_reason(plan, "stop", True) == "stop"  # OpenAI keeps stop for a forced function
    content, calls = extract(plan, "".join(pieces))
    assert content is None and calls[0].function.name == "add" and json.loads(calls[0].function.arguments) == {
        "a": 1, "b": 2}


def test_required_schema_accepts_calls_and_nothing_else():
    tools = [ToolDefinition.model_validate(t) for t in (WEATHER, ADD)]
    schema = required_schema(tools, parallel=True)
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}], schema)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "X"}}, {"name": "add", "parameters": {
        "a": 1, "b": 2}}], schema)
    for bad in ([], [{"name": "add", "parameters": {"city": "X"}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = required_schema(tools, parallel=False)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}] * 2, single)


REFUSED = {
    "auto without the flags": (dict(tools=[WEATHER]), ToolConfig(), True, "--enable-auto-tool-choice"),
    "explicit auto without the flags": (dict(tools=[WEATHER], tool_choice="auto"), ToolConfig(), True,
                                        "--tool-call-parser"),
    "auto, template without tools": (dict(tools=[WEATHER]), AUTO, False, "chat template that renders tools"),
    "unknown named function": (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "x"}}),
                               AUTO, True, "function 'x' is not among the tools (get_weather)"),
    "required without tools": (dict(tool_choice="required"), AUTO, True, '"required" needs tools'),
    "duplicate names": (dict(tools=[WEATHER, WEATHER], tool_choice="required"), AUTO, True, "appears twice"),
    "functions": (dict(functions=[{"name": "f"}]), AUTO, True, "functions/function_call are not supported"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_what_cannot_be_honoured_is_a_value_error_saying_why(case):
    fields, config, renders, needle = REFUSED[case]
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        plan_tools(request(**fields), config, renders)


def test_none_and_no_tools_mean_plain_text():
    assert plan_tools(request(), ToolConfig(), False).mode == "none"
    plan = plan_tools(request(tools=[WEATHER], tool_choice="none"), ToolConfig(), False)
    assert plan.mode == "none" and plan.template_tools[0]["function"]["name"] == "get_weather"
    assert not plan.parses and plan.constraint is None


def test_server_flags():
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ToolConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'"):
        ToolConfig(tool_call_parser="nope")
    from hybridkv.cli import build_parser

    args = build_parser().parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert (args.enable_auto_tool_choice, args.tool_call_parser) == (True, "llama3_json")


def test_template_renders_tools():
    from hybridkv.model.loading.known_models import resolve_model
    from hybridkv.model.loading.tokenizer import Tokenizer

    assert not template_renders_tools(Tokenizer.from_gguf(resolve_model(None).path).chat_template)  # SmolLM2-135M
    assert template_renders_tools("{% if tools %}{{ tools | tojson }}{% endif %}{{ messages[0].content }}")
    assert not template_renders_tools(None)


def test_shipped_smollm2_tool_template():
    from dataclasses import replace

    from hybridkv.model.loading.known_models import resolve_model
    from hybridkv.model.loading.tokenizer import Tokenizer

    own = Tokenizer.from_gguf(resolve_model(None).path)
    shipped = replace(own, chat_template=load_chat_template("tool_chat_template_smollm2.jinja"))
    assert template_renders_tools(shipped.chat_template)
    for conversation in ([{"role": "user", "content": "hi"}],
                         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
                          {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]):
        for generation_prompt in (True, False):  # without tools it is the GGUF's own template
            assert shipped.apply_chat_template(conversation, generation_prompt) == own.apply_chat_template(
                conversation, generation_prompt)
    request_ = request(tools=[WEATHER], messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call-1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call-1", "content": "-3 C"}])
    text = shipped.apply_chat_template(request_.template_messages(), True,
                                       tools=[t.model_dump(exclude_none=True) for t in request_.tools])
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou are an expert in composing functions.")
    assert '<tools>[{"type": "function", "function": {"name": "get_weather"' in text
    assert ('<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Oslo"}}]</tool_call>'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\n-3 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n'
            ) in text
    assert text.count("Be brief.") == 1
    # what the template writes for a call, the parser reads back
    _, calls = extract(plan_for("hermes"), text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0])
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_chat_template_flag():
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    with pytest.raises(ValueError, match="no such file, nor a template .shipped: tool_chat_template_smollm2.jinja"):
        load_chat_template("missing.jinja")
