"""OpenAI's Responses API (``/v1/responses``) as pydantic models: the request's text subset, and what comes back.

A request is checked here for its shape only; ``responses.py`` turns it into a chat request, so sampling values,
tools, ``tool_choice`` and ``text.format`` meet the chat endpoint's own checks. Fields that would change the answer
and are not implemented are refused in ``limits.py``; other unknown fields are ignored, as OpenAI does.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, StrictBool, Tag

from hybridkv.server.protocol import _Model, now


def response_id(prefix: str) -> str:
    """OpenAI's spelling of the Responses API's ids: ``resp_...``, ``msg_...``, ``fc_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- requests ----------------------------------------------------------------------------------------------
class TextContent(_Model):
    """A text part of a message: ``input_text`` as sent, ``output_text`` from an earlier response's output."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_Model):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextContent]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallInput(_Model):
    """A call the model made in an earlier turn (an output item sent back as input)."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputInput(_Model):
    """The caller's result of a function call."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextContent]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


def _item_kind(item: Any) -> str | None:
    """The item's model: a message when ``type`` is absent (OpenAI's "easy input message")."""
    if not isinstance(item, dict):
        return None
    return {"message": "InputMessage", "function_call": "FunctionCallInput",
            "function_call_output": "FunctionCallOutputInput"}.get(item.get("type", "message"))


InputItem = Annotated[
    Annotated[InputMessage, Tag("InputMessage")]
    | Annotated[FunctionCallInput, Tag("FunctionCallInput")]
    | Annotated[FunctionCallOutputInput, Tag("FunctionCallOutputInput")],
    Discriminator(_item_kind, custom_error_type="input_item",
                  custom_error_message="an input item must be a message (role and content), a function_call or a "
                                       "function_call_output; other item types are not supported"),
]


class FunctionTool(_Model):
    """A function tool in the Responses API's flat shape (no ``function`` wrapper)."""

    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None

    def chat_tool(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters,
                    "strict": self.strict}
        return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


class FunctionChoice(_Model):
    type: Literal["function"]
    name: str


class TextFormat(_Model):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (its schema flat beside its name)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    def response_format(self) -> dict[str, Any] | None:
        """The chat endpoint's ``response_format``."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.json_schema is None:
            raise ValueError("text.format: type json_schema needs schema (a JSON schema)")
        return {"type": "json_schema", "json_schema": {"name": self.name or "response", "schema": self.json_schema,
                                                       "strict": self.strict}}


class TextConfig(_Model):
    format: TextFormat | None = None
    verbosity: Literal["medium"] | None = None  # the model has no other verbosity; low/high are refused


class ResponsesRequest(_Model):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: StrictBool = True
    stream: StrictBool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # accepted and unused: they change nothing in the answer
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (drop the middle of a long conversation) is refused

    def chat_tool_choice(self) -> str | dict[str, Any] | None:
        if isinstance(self.tool_choice, FunctionChoice):
            return {"type": "function", "function": {"name": self.tool_choice.name}}
        return self.tool_choice

    def response_format(self) -> dict[str, Any] | None:
        return None if self.text is None or self.text.format is None else self.text.format.response_format()


def input_messages(value: str | list[InputMessage | FunctionCallInput | FunctionCallOutputInput]) -> list[dict]:
    """``input`` as the chat endpoint's messages: a function call joins the assistant message before it, a
    function's output is a ``tool`` message.

    >>> input_messages("Hi")
    [{'role': 'user', 'content': 'Hi'}]
    >>> call, result = input_messages([
    ...     FunctionCallInput(type="function_call", call_id="c1", name="f", arguments="{}"),
    ...     FunctionCallOutputInput(type="function_call_output", call_id="c1", output="42")])
    >>> call["role"], call["tool_calls"][0]["function"], result
    ('assistant', {'name': 'f', 'arguments': '{}'}, {'role': 'tool', 'tool_call_id': 'c1', 'content': '42'})
    """
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    messages: list[dict[str, Any]] = []
    for item in value:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallOutputInput):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages


# ---- what comes back ---------------------------------------------------------------------------------------
class OutputText(_Model):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class MessageItem(_Model):
    id: str = Field(default_factory=lambda: response_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallItem(_Model):
    id: str = Field(default_factory=lambda: response_id("fc"))
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "in_progress"


OutputItem = MessageItem | FunctionCallItem


class InputTokensDetails(_Model):
    cached_tokens: int = 0


class OutputTokensDetails(_Model):
    reasoning_tokens: int = 0


class ResponseUsage(_Model):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(_Model):
    reason: Literal["max_output_tokens"]


class ResponseError(_Model):
    code: str
    message: str


class ResponseObject(_Model):
    id: str = Field(default_factory=lambda: response_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now)
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "in_progress"
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig
    truncation: Literal["disabled"] = "disabled"
    store: bool = True
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    reasoning: None = None
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None

    def dump(self) -> dict[str, Any]:
        """JSON-ready, with ``schema`` spelled as OpenAI does."""
        return self.model_dump(by_alias=True)
