"""OpenAI-shaped request and response models (pydantic), with vLLM's extra sampling fields.

Requests validate types here; value rules (``temperature >= 0`` ...) live in ``SamplingParams`` so the engine
and the server share one set of messages. Unknown request fields are ignored, as OpenAI and vLLM do.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hybridkv.engine.sampling_params import SamplingParams

MAX_LOGPROBS = 20


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---- requests ----------------------------------------------------------------------------------------------
class StreamOptions(_Model):
    include_usage: bool = False


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
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the field when a value is out of range."""
        if logprobs is not None and logprobs > MAX_LOGPROBS:
            raise ValueError(f"logprobs must be <= {MAX_LOGPROBS}, got {logprobs}")
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
            skip_special_tokens=self.skip_special_tokens,
            logit_bias=_token_id_keys(self.logit_bias),
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
    echo: bool = False

    def sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs)

    def single_prompt(self) -> str | list[int]:
        """The one prompt this request carries; batches of prompts are refused with ValueError."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ValueError(f"prompt: exactly one prompt per request is supported, got {len(prompt)}")
            prompt = prompt[0]
        if self.echo:
            raise ValueError("echo: not supported")
        return prompt


class TextPart(_Model):
    type: Literal["text"]
    text: str


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        try:
            return self._sampling_params(max_tokens, logprobs)
        except ValueError as error:
            if self.max_completion_tokens is not None and str(error).startswith("max_tokens "):
                raise ValueError(f"max_completion_tokens{str(error)[len('max_tokens'):]}") from None
            raise

    def template_messages(self) -> list[dict[str, Any]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# ---- responses ---------------------------------------------------------------------------------------------
class UsageInfo(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ErrorInfo(_Model):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(_Model):
    error: ErrorInfo


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


class DeltaMessage(_Model):
    role: str | None = None
    content: str | None = None


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
