"""OpenAI's Responses API (``/v1/responses``) end to end on the real SmolLM2 model, with the clients people point at
it: the ``openai`` client (``client.responses.create``, streamed and not), langchain's ``ChatOpenAI(use_responses_api=
True)``, openai-agents' default ``Runner.run`` and ``litellm.responses``.

The server has the flags ``make serve`` passes (``--enable-auto-tool-choice --tool-call-parser hermes --chat-template
tool_chat_template_smollm2.jinja``), so the default ``tool_choice`` (``auto``) works as it does for those clients.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from test_openai_server import MODEL, TIMEOUT, Server, wait_idle_and_free

from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.server.errors import APIError
from hybridkv.server.responses import ResponseStore
from hybridkv.server.tool_calls import ToolConfig, load_chat_template

PERSON = json.loads((Path(__file__).parents[1] / "data" / "person.schema.json").read_text())  # small, closed
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"], "additionalProperties": False}}
ASK_WEATHER = "What is the weather in Paris?"
INSTRUCTIONS = "Answer in one short sentence."
TEMPLATE = "tool_chat_template_smollm2.jinja"


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(EngineConfig(max_model_len=1024, kv_cache_memory_bytes=64 << 20, max_num_seqs=16))
    tools = ToolConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with Server(engine, tools=tools, chat_template=load_chat_template(TEMPLATE)) as srv:
        yield srv


def chat_prompt_len(srv: Server, messages, tools=None) -> int:
    """The prompt's tokens as the server's chat template renders it."""
    tokenizer = replace(srv.tokenizer, chat_template=load_chat_template(TEMPLATE))
    text = tokenizer.apply_chat_template(messages, True, **({"tools": tools} if tools else {}))
    return len(tokenizer.encode(text, add_special_tokens=False))


def stream_events(client: openai.OpenAI, **kw) -> list:
    return list(client.responses.create(model=MODEL, stream=True, **kw))


def check_sequence(events) -> None:
    """Numbered from 0 without a gap; created and in_progress first; one terminal event, last."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert sum(e.type in ("response.completed", "response.incomplete", "response.failed") for e in events) == 1


# ---- the openai client -------------------------------------------------------------------------------------
def test_text_response_streamed_and_not(server):
    client = server.client()
    kw = dict(input="What is the capital of France?", instructions=INSTRUCTIONS, max_output_tokens=30,
              temperature=0)
    r = client.responses.create(model=MODEL, **kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == MODEL and r.status == "completed"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.content[0].type == "output_text" and r.output_text == message.content[0].text
    assert "Paris" in r.output_text
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": kw["input"]}]
    assert r.usage.input_tokens == chat_prompt_len(server, messages)
    assert 0 < r.usage.output_tokens <= 30 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert (r.instructions, r.max_output_tokens, r.temperature) == (INSTRUCTIONS, 30, 0)

    events = stream_events(client, **kw)
    check_sequence(events)
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *[d.type for d in deltas], "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"]
    item_id = events[2].item.id
    assert {e.item_id for e in deltas} == {item_id} and {e.output_index for e in deltas} == {0}
    text = "".join(d.delta for d in deltas)
    assert text == events[-4].text == events[-3].part.text == events[-2].item.content[0].text
    final = events[-1].response
    assert final.output_text == text == r.output_text
    assert (final.usage.input_tokens, final.usage.output_tokens) == (r.usage.input_tokens, r.usage.output_tokens)
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again: its prefix was cached
    assert final.output[0].id == item_id


def test_max_output_tokens_reached_is_incomplete(server):
    client = server.client()
    kw = dict(input="Tell me a long story about a dragon.", max_output_tokens=5, temperature=0)
    r = client.responses.create(model=MODEL, **kw)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 5 and r.output[0].status == "incomplete"
    events = stream_events(client, **kw)
    check_sequence(events)
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == r.output_text


def _function_calls(response) -> list:
    calls = [item for item in response.output if item.type == "function_call"]
    for call in calls:
        assert call.name == "get_weather" and call.id.startswith("fc_") and call.call_id
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    return calls


def test_function_tool_round_trip(server):
    """A required call, the caller's result sent back with the whole conversation as input, and the same through
    previous_response_id: the model sees the same prompt both ways."""
    client = server.client()
    first = client.responses.create(model=MODEL, input=ASK_WEATHER, tools=[WEATHER], tool_choice="required",
                                    max_output_tokens=60, temperature=0)
    [call] = _function_calls(first)
    assert first.status == "completed" and first.tools[0].name == "get_weather"
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees and sunny"}
    kw = dict(model=MODEL, tools=[WEATHER], tool_choice="none", max_output_tokens=20, temperature=0)
    explicit = client.responses.create(
        input=[{"role": "user", "content": ASK_WEATHER}, call.model_dump(exclude_none=True), result], **kw)
    chained = client.responses.create(input=[result], previous_response_id=first.id, **kw)
    assert chained.previous_response_id == first.id
    assert explicit.output_text and not _function_calls(explicit)
    tool_call = {"id": call.call_id, "type": "function",  # templates get the arguments as an object
                 "function": {"name": "get_weather", "arguments": json.loads(call.arguments)}}
    messages = [{"role": "user", "content": ASK_WEATHER}, {"role": "assistant", "content": "",
                                                           "tool_calls": [tool_call]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees and sunny"}]
    tools = [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}]
    assert explicit.usage.input_tokens == chained.usage.input_tokens == chat_prompt_len(server, messages, tools)


def test_function_call_streamed(server):
    client = server.client()
    kw = dict(input=ASK_WEATHER, tools=[WEATHER], tool_choice="required", max_output_tokens=60, temperature=0)
    whole = client.responses.create(model=MODEL, **kw)
    [call] = _function_calls(whole)
    events = stream_events(client, **kw)
    check_sequence(events)
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [e.item.type for e in added] == ["function_call"]
    item = added[0].item
    assert item.name == "get_weather" and item.arguments == "" and item.status == "in_progress"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done.arguments == call.arguments and done.item_id == item.id
    [final] = _function_calls(events[-1].response)
    assert (final.id, final.call_id, final.arguments) == (item.id, item.call_id, call.arguments)


def test_named_function_choice(server):
    r = server.client().responses.create(model=MODEL, input=ASK_WEATHER, tools=[WEATHER], max_output_tokens=60,
                                         tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    assert len(_function_calls(r)) == 1 and r.tool_choice.name == "get_weather"


def test_json_schema_text_format_streamed_and_not(server):
    client = server.client()
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    kw = dict(input="Describe my neighbour.", text={"format": fmt}, max_output_tokens=80, temperature=0)
    r = client.responses.create(model=MODEL, **kw)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    events = stream_events(client, **kw)
    check_sequence(events)
    jsonschema.validate(json.loads(events[-1].response.output_text), PERSON)


def test_responses_parse_with_a_pydantic_model(server):
    from pydantic import BaseModel

    class Cat(BaseModel):
        name: str
        age: int

    r = server.client().responses.parse(model=MODEL, input="Describe a cat.", text_format=Cat, max_output_tokens=60,
                                        temperature=0)
    assert isinstance(r.output_parsed, Cat) and r.output_parsed.name


def test_previous_response_id_carries_the_conversation_not_the_instructions(server):
    client = server.client()
    first = client.responses.create(model=MODEL, input="My name is Ada.", instructions=INSTRUCTIONS,
                                    max_output_tokens=20, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=20, temperature=0)
    messages = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "What is my name?"}]
    assert second.usage.input_tokens == chat_prompt_len(server, messages)
    assert httpx.get(f"{server.url}/v1/responses/{second.id}").json() == second.model_dump(
        mode="json", exclude_unset=True, by_alias=True)
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_store_false_is_not_kept(server):
    client = server.client()
    r = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=3)
    assert r.store is False
    with pytest.raises(openai.NotFoundError, match="previous_response_id: no stored response"):
        client.responses.create(model=MODEL, input="Again", previous_response_id=r.id, max_output_tokens=3)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_the_store_drops_the_oldest_past_its_bound():
    store = ResponseStore(max_responses=2, max_chars=100)
    for i in range(3):
        store.add({"id": f"resp_{i}"}, [{"role": "user", "content": f"turn {i}"}])
    with pytest.raises(APIError) as info:
        store.conversation("resp_0")
    assert info.value.status == 404 and "keeps the newest 2 responses" in info.value.message
    assert store.conversation("resp_2") == [{"role": "user", "content": "turn 2"}]
    store.add({"id": "resp_big"}, [{"role": "user", "content": "x" * 95}])  # pushes out all but itself
    assert [store.response(r)["id"] for r in ("resp_big",)] == ["resp_big"]
    with pytest.raises(APIError):
        store.response("resp_1")
    with pytest.raises(APIError):
        store.response("resp_2")


BAD = {
    "background": ({"background": True}, "background: background responses are not supported", 400),
    "include": ({"include": ["message.output_text.logprobs"]}, "include: extra output data is not supported", 400),
    "reasoning": ({"reasoning": {"effort": "high"}}, "reasoning: reasoning options are not supported", 400),
    "conversation": ({"conversation": "conv_1"}, "conversation: conversations are not supported", 400),
    "web search tool": ({"tools": [{"type": "web_search"}]}, "tools.0.type: Input should be 'function'", 400),
    "image input": ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                    "input.0.content.0.type", 400),
    "reasoning item": ({"input": [{"type": "reasoning", "summary": []}]}, "input.0: an input item must be", 400),
    "truncation auto": ({"truncation": "auto"}, "truncation: Input should be 'disabled'", 400),
    "max_output_tokens 0": ({"max_output_tokens": 0}, "max_output_tokens must be >= 1", 400),
    "too long": ({"max_output_tokens": 5000}, "'max_output_tokens' is too large: 5000", 400),
    "schema missing": ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format: type json_schema "
                                                                                  "needs schema", 400),
    "unsatisfiable schema": ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {
        "$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}}}, "only leads back to itself", 400),
    "named tool not given": ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "add"}},
                             "tool_choice: function 'add' is not among the tools", 400),
    "unknown previous": ({"previous_response_id": "resp_nope"}, "previous_response_id: no stored response", 404),
    "unknown model": ({"model": "gpt-9"}, "gpt-9", 404),
}


@pytest.mark.parametrize("case", list(BAD))
def test_unsupported_and_bad_fields_are_refused_by_name(server, case):
    fields, needle, status = BAD[case]
    before = server.metrics()["hybridkv:prompt_tokens_total"]
    r = httpx.post(f"{server.url}/v1/responses", json={"model": MODEL, "input": "Hi", **fields}, timeout=TIMEOUT)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert needle in error["message"] and error["code"] == status, error
    assert server.metrics()["hybridkv:prompt_tokens_total"] == before  # refused before the engine saw it


def test_a_stream_the_client_leaves_frees_everything(server):
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/responses", json=body, timeout=TIMEOUT) as r:
        lines = r.iter_lines()
        assert any(line == "event: response.output_text.delta" for line in lines)
    wait_idle_and_free(server, within=5.0)


# ---- other clients -----------------------------------------------------------------------------------------
def test_langchain_chat_openai_with_the_responses_api(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="none", temperature=0, max_tokens=30,
                     max_retries=0, timeout=TIMEOUT, use_responses_api=True)
    message = llm.invoke("What is the capital of France?")
    assert "Paris" in message.text and message.response_metadata["id"].startswith("resp_")
    assert message.usage_metadata["total_tokens"] == (message.usage_metadata["input_tokens"]
                                                      + message.usage_metadata["output_tokens"])
    assert "".join(chunk.text for chunk in llm.stream("What is the capital of France?")) == message.text

    class Cat(BaseModel):
        name: str
        age: int

    cat = llm.bind(max_tokens=60).with_structured_output(Cat, method="json_schema").invoke("Describe a cat.")
    assert isinstance(cat, Cat) and cat.name


def test_openai_agents_runner_with_a_function_tool(server):
    """The quick-start's ``Runner.run`` through the default model provider (the Responses API), its client pointed
    here: the model must call the tool (``tool_choice`` required; the SDK resets it to auto after the call), the
    tool's result goes back, and the answer is the last turn's text."""
    from agents import Agent, ModelSettings, RunConfig, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_provider import OpenAIProvider

    set_tracing_disabled(True)  # the SDK would upload traces to OpenAI
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        cities.append(city)
        return f"18 degrees and sunny in {city}"

    agent = Agent(name="Assistant", instructions="You are a helpful assistant.", tools=[get_weather],
                  model=MODEL, model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=60))
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=TIMEOUT)
    result = asyncio.run(Runner.run(agent, ASK_WEATHER,
                                    run_config=RunConfig(model_provider=OpenAIProvider(openai_client=client))))
    assert cities == ["Paris"]
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert result.final_output and len(result.raw_responses) == 2
    assert all(r.response_id.startswith("resp_") for r in result.raw_responses)
    # the second turn's prompt held the first turn, the call and its result
    assert result.raw_responses[1].usage.input_tokens > result.raw_responses[0].usage.input_tokens


def test_litellm_responses(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm fetches a price list at import otherwise
    import litellm

    kw = dict(model=f"openai/{MODEL}", api_base=f"{server.url}/v1", api_key="none", max_output_tokens=30,
              temperature=0, input="What is the capital of France?")
    r = litellm.responses(**kw)
    text = r.output[0].content[0].text
    assert "Paris" in text and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    streamed = "".join(e.delta for e in litellm.responses(stream=True, **kw)
                       if getattr(e, "type", None) == "response.output_text.delta")
    assert streamed == text
