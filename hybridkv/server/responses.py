"""OpenAI's Responses API on top of the chat endpoint's machinery.

A request becomes a chat request (``ResponseTurn.chat_request``): ``instructions`` the system message, the stored
conversation of ``previous_response_id``, then ``input``; flat function tools in chat's nested shape;
``text.format`` as ``response_format``. The chat endpoint's template rendering, tool plan (``tool_calls.py``) and
structured outputs then run unchanged, and the output goes back as Responses output items: a ``message`` with one
``output_text`` part, and a ``function_call`` item per call.

Streaming sends OpenAI's events, each with a ``sequence_number`` counted from 0::

    response.created, response.in_progress,
    response.output_item.added (message), response.content_part.added,
        response.output_text.delta ..., response.output_text.done, response.content_part.done,
    response.output_item.done,
    response.output_item.added (function_call), response.function_call_arguments.delta ...,
        response.function_call_arguments.done, response.output_item.done,   (per call)
    response.completed | response.incomplete (max_output_tokens reached) | response.failed (the engine died)

``ResponseStore`` keeps the conversations of stored responses (``store``, on by default) for
``previous_response_id``, within the server's lifetime and a bound: past it the oldest are dropped.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from hybridkv.engine.llm_engine import CompletionOutput, RequestOutput
from hybridkv.server.async_engine import EngineDeadError, RequestStream
from hybridkv.server.errors import APIError
from hybridkv.server.protocol import ChatCompletionRequest
from hybridkv.server.responses_protocol import (
    FunctionCallItem,
    IncompleteDetails,
    MessageItem,
    OutputItem,
    OutputText,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextConfig,
    TextFormat,
    input_messages,
)
from hybridkv.server.tool_calls import ToolCallStream, ToolPlan, extract

DEFAULT_MAX_STORED_RESPONSES = 1024
DEFAULT_MAX_STORED_CHARS = 64 << 20  # the stored conversations' text, all together
# the chat request's field names, as a Responses client knows them (in error messages)
_FIELD_NAMES = {"max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
                "response_format": "text.format", "messages": "input"}
_LEADING_FIELD = re.compile(r"^'?([\w.]+)'?(?::| must| is )")


@dataclass(slots=True)
class _Stored:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # chat messages, without the instructions (OpenAI does not carry them over)
    chars: int


@dataclass(slots=True)
class ResponseStore:
    """Stored responses, newest last; adding one past ``max_responses`` or ``max_chars`` drops the oldest."""

    max_responses: int = DEFAULT_MAX_STORED_RESPONSES
    max_chars: int = DEFAULT_MAX_STORED_CHARS
    _items: OrderedDict[str, _Stored] = field(default_factory=OrderedDict)
    _chars: int = 0

    def conversation(self, response_id: str | None) -> list[dict[str, Any]]:
        """The messages of ``response_id``'s conversation so far (none for None); 404 when it is not stored."""
        if response_id is None:
            return []
        return [dict(m) for m in self._get(response_id, "previous_response_id").conversation]

    def response(self, response_id: str) -> dict[str, Any]:
        return self._get(response_id, "response_id").response

    def add(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        chars = sum(len(str(m.get("content") or "")) + len(str(m.get("tool_calls") or "")) for m in conversation)
        if chars > self.max_chars:
            return  # it would push out everything else; its id answers 404 like any response not stored
        self._items[response["id"]] = _Stored(response, conversation, chars)
        self._chars += chars
        while len(self._items) > self.max_responses or self._chars > self.max_chars:
            _, dropped = self._items.popitem(last=False)
            self._chars -= dropped.chars

    def _get(self, response_id: str, param: str) -> _Stored:
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(404, f"{param}: no stored response {response_id!r} on this server (it was made with "
                                f"store: false, before the server started, or it was dropped: the server keeps the "
                                f"newest {self.max_responses} responses, at most {self.max_chars:,} characters of "
                                "conversation)", param)
        return stored


def renamed(error: APIError) -> APIError:
    """A chat-endpoint error in the Responses API's field names (``max_output_tokens``, ``text.format``)."""
    message, param = error.message, error.param
    for chat, name in _FIELD_NAMES.items():
        if message.startswith(chat) or message.startswith(f"'{chat}'"):
            message = message.replace(chat, name, 1)
        if param == chat:
            param = name
    if param is None and (field_name := _LEADING_FIELD.match(message)):
        param = field_name.group(1)
    return APIError(error.status, message, param)


@dataclass(slots=True)
class ResponseTurn:
    """One ``/v1/responses`` request: its chat request, and the response it builds (stored when done)."""

    body: ResponsesRequest
    model: str
    store: ResponseStore
    conversation: list[dict[str, Any]] = field(default_factory=list)  # history and input; no instructions
    response: ResponseObject = field(init=False)

    def __post_init__(self) -> None:
        body = self.body
        self.conversation = self.store.conversation(body.previous_response_id) + input_messages(body.input)
        text = body.text if body.text is not None and body.text.format is not None else TextConfig(
            format=TextFormat(type="text"))
        self.response = ResponseObject(
            model=self.model, instructions=body.instructions, max_output_tokens=body.max_output_tokens,
            previous_response_id=body.previous_response_id, temperature=body.temperature, top_p=body.top_p,
            tools=body.tools or [], tool_choice=body.tool_choice or "auto",
            parallel_tool_calls=body.parallel_tool_calls, text=text, store=body.store, metadata=body.metadata or {},
            user=body.user)

    @property
    def id(self) -> str:
        return self.response.id

    def chat_request(self) -> ChatCompletionRequest:
        """The same request for the chat endpoint; ValueError naming a bad field."""
        body = self.body
        system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
        fields = {
            "messages": system + self.conversation,
            "max_completion_tokens": body.max_output_tokens,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tools": [t.chat_tool() for t in body.tools] if body.tools else None,
            "tool_choice": body.chat_tool_choice(),
            "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": body.response_format(),
            "stream": body.stream,
        }
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})

    def finish(self, out: RequestOutput, plan: ToolPlan) -> dict[str, Any]:
        """The whole response from the request's last output (not streamed), stored when ``store``."""
        o = out.outputs[0]
        cut = o.finish_reason == "length"
        content, calls = extract(plan, o.text, cut) if plan.parses else (o.text, [])
        status = "incomplete" if cut else "completed"
        items: list[OutputItem] = []
        if content or not calls:
            items.append(MessageItem(status=status, content=[OutputText(text=content or "")]))
        items += [FunctionCallItem(call_id=c.id, name=c.function.name, arguments=c.function.arguments,
                                   status=status) for c in calls]
        return self._done(out, o, items)

    async def events(self, stream: RequestStream, plan: ToolPlan) -> AsyncIterator[str]:
        """The response as OpenAI's stream events (see the module's docstring)."""
        writer = _EventWriter(self.response)
        yield writer.event("response.created", response=self.response)
        yield writer.event("response.in_progress", response=self.response)
        calls = ToolCallStream(plan) if plan.parses else None
        out = None
        try:
            async for out in stream:
                o = out.outputs[0]
                if calls is None:
                    content, deltas = o.delta_text or None, []
                else:
                    content, deltas = calls.feed(o.delta_text, bool(o.finish_reason), o.finish_reason == "length")
                for event in writer.content(content):
                    yield event
                for delta in deltas:
                    for event in writer.call(delta):
                        yield event
        except EngineDeadError as error:
            self.response.status = "failed"
            self.response.error = ResponseError(code="server_error", message=str(error))
            yield writer.event("response.failed", response=self.response)
            return
        o = out.outputs[0]
        if not self.response.output:  # an empty answer is still a message, as when not streamed
            for event in writer.content(""):
                yield event
        status = "incomplete" if o.finish_reason == "length" else "completed"
        for event in writer.close(status):
            yield event
        self._done(out, o, self.response.output)
        yield writer.event(f"response.{status}", response=self.response)

    def _done(self, out: RequestOutput, o: CompletionOutput, items: list[OutputItem]) -> dict[str, Any]:
        response = self.response
        response.output = items
        response.status = "incomplete" if o.finish_reason == "length" else "completed"
        if response.status == "incomplete":
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
        prompt, generated = len(out.prompt_token_ids), len(o.token_ids)
        response.usage = ResponseUsage(input_tokens=prompt, output_tokens=generated, total_tokens=prompt + generated)
        response.usage.input_tokens_details.cached_tokens = out.num_cached_tokens
        dumped = response.dump()
        if response.store:
            self.store.add(dumped, self.conversation + _assistant_messages(items))
        return dumped


def _assistant_messages(items: list[OutputItem]) -> list[dict[str, Any]]:
    """The output as the chat message a later turn's template sees."""
    text = "".join(part.text for item in items if isinstance(item, MessageItem) for part in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in items if isinstance(item, FunctionCallItem)]
    message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
    if calls:
        message["tool_calls"] = calls
    return [message]


@dataclass(slots=True)
class _EventWriter:
    """Numbers the events and keeps the response's output items as the stream builds them."""

    response: ResponseObject
    sequence_number: int = 0
    message: MessageItem | None = None  # the open message item
    call_items: dict[int, FunctionCallItem] = field(default_factory=dict)  # by the tool-call stream's index

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence_number}
        for name, value in fields.items():
            payload[name] = value.model_dump(by_alias=True) if hasattr(value, "model_dump") else value
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def content(self, text: str | None) -> list[str]:
        if text is None:
            return []
        events = []
        if self.message is None:
            self.message = MessageItem()
            self.response.output.append(self.message)
            events.append(self.event("response.output_item.added", output_index=self._index(self.message),
                                     item=self.message))
            self.message.content.append(OutputText())
            events.append(self.event("response.content_part.added", **self._where(self.message),
                                     part=self.message.content[0]))
        if text:
            self.message.content[0].text += text
            events.append(self.event("response.output_text.delta", **self._where(self.message), delta=text,
                                     logprobs=[]))
        return events

    def call(self, delta) -> list[str]:
        """A tool-call delta (``DeltaToolCall``): a new call opens its item; arguments go out as they come."""
        events = []
        item = self.call_items.get(delta.index)
        if item is None:
            events += self._close_message("completed")
            item = self.call_items[delta.index] = FunctionCallItem(call_id=delta.id, name=delta.function.name)
            self.response.output.append(item)
            events.append(self.event("response.output_item.added", output_index=self._index(item), item=item))
        if delta.function.arguments:
            item.arguments += delta.function.arguments
            events.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                     output_index=self._index(item), delta=delta.function.arguments))
        return events

    def close(self, status: str) -> list[str]:
        """The done events of every item still open."""
        events = self._close_message(status)
        for item in self.call_items.values():
            item.status = status
            index = self._index(item)
            events.append(self.event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                     name=item.name, arguments=item.arguments))
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def _close_message(self, status: str) -> list[str]:
        message, self.message = self.message, None
        if message is None:
            return []
        message.status = status
        part = message.content[0]
        where = self._where(message)
        return [self.event("response.output_text.done", **where, text=part.text, logprobs=[]),
                self.event("response.content_part.done", **where, part=part),
                self.event("response.output_item.done", output_index=where["output_index"], item=message)]

    def _index(self, item: OutputItem) -> int:
        return next(i for i, x in enumerate(self.response.output) if x is item)

    def _where(self, message: MessageItem) -> dict[str, Any]:
        return {"item_id": message.id, "output_index": self._index(message), "content_index": 0}

