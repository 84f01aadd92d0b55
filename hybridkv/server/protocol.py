"""OpenAI-shaped request and response models (pydantic), with vLLM's extra sampling fields.

Requests validate types here (booleans strictly, numbers finite); value rules (``temperature >= 0`` ...) live in
``SamplingParams`` so the engine and the server share one set of messages. Unknown request fields are ignored, as
OpenAI and vLLM do.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_serializer, model_validator

from hybridkv.engine.sampling_params import SamplingParams, StructuredOutputsParams

MAX_LOGPROBS = 20


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Model(BaseModel):
    # OpenAI's API takes only true and false for a boolean ("yes", 1 and "true" are errors), and no number that is
    # not finite (the string "inf" too)
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


# ---- requests ----------------------------------------------------------------------------------------------
class StreamOptions(_Model):
    include_usage: StrictBool = False


class _SamplingFields(_Model):
    """Fields both endpoints share: OpenAI's plus vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: str | list[str] | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias in [-100, 100]
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: StrictBool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    cache_salt: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the top k at its position

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed_fields(cls, data: Any) -> Any:
        _refuse_guided_fields(data)
        return data

    def output_constraint(self) -> StructuredOutputsParams | None:
        """``response_format`` or ``structured_outputs`` as the engine's constraint (ValueError if both)."""
        formats = [f for f in (self.response_format, self.structured_outputs) if f is not None]
        constraints = [c for c in (f.params() for f in formats) if c is not None]
        if len(constraints) > 1:
            raise ValueError("response_format: cannot be combined with structured_outputs; send one of them")
        return constraints[0] if constraints else None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         constraint: StructuredOutputsParams | None = None,
                         prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be <= {MAX_LOGPROBS}, got {logprobs}")
        prompt_logprobs = self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs
        if prompt_logprobs is not None and prompt_logprobs > MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be <= {MAX_LOGPROBS}, got {prompt_logprobs}")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs: not available with stream (as in vLLM); send stream: false")
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=_token_id_keys(self.logit_bias),
            structured_outputs=constraint,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _token_id_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    bad = next((k for k in bias or () if not re.fullmatch(r"[0-9]{1,10}", k)), None)
    if bad is not None:
        raise ValueError(f"logit_bias: keys must be token ids (integers), got {bad!r}")
    return {int(k): v for k, v in bias.items()} if bias else None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: StrictBool = False

    def sampling_params(self) -> SamplingParams:
        """With ``echo``, the prompt's tokens get ``logprobs`` too (as their prompt logprobs), and ``max_tokens``
        0 returns the prompt alone: the engine still samples one token, which is left out (vLLM does the
        same)."""
        max_tokens = 1 if self.echo_only else self.max_tokens
        prompt_logprobs = self.logprobs if self.echo and self.prompt_logprobs is None else None
        return self._sampling_params(max_tokens, self.logprobs, self.output_constraint(), prompt_logprobs)

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """The prompts this request carries, as vLLM reads ``prompt``: a string or a list of token ids is one
        prompt; a list of strings or of token-id lists is several.

        >>> CompletionRequest(prompt=["a", "b"]).prompts(), CompletionRequest(prompt=[1, 2]).prompts()
        (['a', 'b'], [[1, 2]])
        """
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return list(prompt)
        return [prompt]


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer to one of them

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def template_dict(self) -> dict[str, Any]:
        """What chat templates read; tool-call arguments as objects (templates write them with ``tojson``)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: StrictBool = False
    top_logprobs: int | None = None
    add_generation_prompt: StrictBool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    functions: list[Any] | None = None  # OpenAI's removed predecessors of tools: refused, see tool_calls.py
    function_call: Any = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template

    def sampling_params(self, tool_constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """``tool_constraint``: the grammar that ``tool_choice`` required or a named function asks for."""
        constraint = self.output_constraint()
        if tool_constraint is not None and constraint is not None:
            raise ValueError("tool_choice: a required or named tool call cannot be combined with response_format "
                             "or structured_outputs")
        constraint = tool_constraint or constraint
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling_params(max_tokens, logprobs, constraint)
        except ValueError as error:
            if self.max_completion_tokens is not None and str(error).startswith("max_tokens "):
                raise ValueError(f"max_completion_tokens{str(error)[len('max_tokens'):]}") from None
            raise

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]


# ---- vLLM's tokenizer endpoints ---------------------------------------------------------------------------
class TokenizeRequest(_Model):
    """``/tokenize``: a ``prompt``, or chat ``messages`` rendered by the chat template (vLLM's two requests)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: True for a prompt, False for messages (the chat template writes any BOS itself)
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    return_token_strs: StrictBool = False
    tools: list[ToolDefinition] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt (text) or messages (a chat)")
        if self.continue_final_message:
            raise ValueError("continue_final_message: not supported")
        return self


class TokenizeResponse(_Model):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(_Model):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(_Model):
    prompt: str


# ---- structured outputs and tools --------------------------------------------------------------------------
# vLLM's request fields that older clients still send; they would change the output, so they are refused.
_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar", "guided_json_object": "json_object"}


def _refuse_guided_fields(data: Any) -> None:
    for name, now in _GUIDED_FIELDS.items():
        if isinstance(data, dict) and data.get(name) is not None:
            raise ValueError(f"{name}: removed in vLLM; send structured_outputs: {{\"{now}\": ...}} instead")


class JsonSchemaFormat(_Model):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None  # the schema is enforced either way


class ResponseFormat(_Model):
    """OpenAI's ``response_format``: ``text``, ``json_object`` or ``json_schema``; any other type is refused."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def params(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.json_schema is None:
                raise ValueError("response_format: type json_schema needs json_schema.schema (a JSON schema)")
            return StructuredOutputsParams(json=self.json_schema.json_schema)
        return None


class StructuredOutputsField(_Model):
    """vLLM's ``structured_outputs`` request field (``StructuredOutputsParams``); unsupported parts are refused."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    json_schema: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: StrictBool | None = None
    disable_any_whitespace: StrictBool = False
    disable_fallback: StrictBool = False  # one backend, nothing to fall back to
    disable_additional_properties: StrictBool = False  # xgrammar already closes objects without additionalProperties
    whitespace_pattern: str | None = None
    structural_tag: str | dict[str, Any] | None = None

    def params(self) -> StructuredOutputsParams:
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise ValueError(f"structured_outputs.{name}: not supported (xgrammar backend); use json, regex, "
                                 "choice, grammar or json_object")
        return StructuredOutputsParams(json=self.json_schema, regex=self.regex, choice=self.choice,
                                       grammar=self.grammar, json_object=self.json_object,
                                       disable_any_whitespace=self.disable_any_whitespace)


class FunctionDefinition(_Model):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class ToolDefinition(_Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Model):
    name: str


class NamedToolChoice(_Model):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(_Model):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Model):
    id: str = Field(default_factory=lambda: random_id("chatcmpl-tool"))
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_dict(self) -> dict[str, Any]:
        try:
            arguments = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        return {"id": self.id, "type": self.type, "function": {"name": self.function.name, "arguments": arguments}}


class DeltaFunctionCall(_Model):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Model):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


# ---- responses ---------------------------------------------------------------------------------------------
class PromptTokensDetails(_Model):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # --enable-prompt-tokens-details (vLLM's flag); left out of the JSON when off
    prompt_tokens_details: PromptTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _without_absent_details(self, handler) -> dict[str, Any]:
        data = handler(self)
        if data.get("prompt_tokens_details") is None:
            data.pop("prompt_tokens_details", None)
        return data


class ErrorInfo(_Model):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(_Model):
    error: ErrorInfo


class PromptLogprob(_Model):
    """vLLM's ``Logprob``: one entry of ``prompt_logprobs``."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobsField = list[dict[int, PromptLogprob] | None] | None


class CompletionLogprobs(_Model):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Model):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsField = None  # vLLM's extra


class CompletionResponse(_Model):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Model):
    content: list[ChatLogprob] | None = None


class ResponseMessage(_Model):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(_Model):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Model):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobsField = None  # vLLM's extra


class DeltaMessage(_Model):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Model):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Model):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ModelCard(_Model):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "hybridkv"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Model):
    object: Literal["list"] = "list"
    data: list[ModelCard]
