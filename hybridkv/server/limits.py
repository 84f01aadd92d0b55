"""What a client may send, checked before the work it would cost: body size, read time, context length, fields
hybridkv does not implement (the body's JSON is decoded and checked in ``json_body.py``).

A body is refused with 413 from its ``Content-Length`` before a byte is read, or as soon as a chunked body grows
past the limit; a body that has not all arrived within ``body_read_timeout_s`` (a ``Content-Length`` larger than
what is sent, a client that stalls) gets 408 and the connection is closed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from starlette.requests import Request

from hybridkv.server.errors import APIError

DEFAULT_MAX_BODY_BYTES = 100 << 20  # a 10M-token prompt sent as token ids is about 70 MB of JSON
DEFAULT_MAX_JSON_DEPTH = 128  # a request is 4 levels deep; a JSON schema inside one rarely passes 20
DEFAULT_BODY_READ_TIMEOUT_S = 30.0  # the whole body: 100 MiB at 30 MB/s, any chat request over a slow link


@dataclass(slots=True)
class RequestLimits:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_json_depth: int = DEFAULT_MAX_JSON_DEPTH
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S


async def read_body(request: Request, limits: RequestLimits) -> bytes:
    """The whole body; 413 as soon as it is known to be longer than ``limits.max_body_bytes``, 408 when it has not
    all arrived within ``limits.body_read_timeout_s``."""
    max_bytes = limits.max_body_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(f"is {int(declared):,} bytes", max_bytes)
    chunks: list[bytes] = []
    try:
        await asyncio.wait_for(_read_chunks(request, max_bytes, chunks), limits.body_read_timeout_s)
    except asyncio.TimeoutError:
        got = sum(map(len, chunks))
        expected = f" of the {int(declared):,} its Content-Length announced" if declared.isdigit() else ""
        raise APIError(408, f"the request body did not arrive within {limits.body_read_timeout_s:g} s ({got:,} "
                            f"bytes{expected}; the server's --request-body-timeout-s)") from None
    return b"".join(chunks)


async def _read_chunks(request: Request, max_bytes: int, chunks: list[bytes]) -> None:
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(f"is longer than that (over {size:,} bytes read)", max_bytes)
        chunks.append(chunk)


def _too_large(what: str, max_bytes: int) -> APIError:
    return APIError(413, f"the request body {what}; at most {max_bytes:,} bytes are accepted "
                         "(the server's --max-request-body-bytes)")


def check_max_tokens(max_tokens: int | None, prompt_len: int, max_model_len: int, name: str = "max_tokens") -> None:
    """vLLM's rule and wording: prompt plus ``max_tokens`` must fit the context (a longer prompt alone is the
    engine's error)."""
    if max_tokens is None or prompt_len >= max_model_len or prompt_len + max_tokens <= max_model_len:
        return
    raise APIError(400, f"'{name}' is too large: {max_tokens}. This model's maximum context length is "
                        f"{max_model_len} tokens and your request has {prompt_len} input tokens "
                        f"({max_tokens} > {max_model_len} - {prompt_len})", name)


# Fields of OpenAI's or vLLM's requests that would change what comes back and that hybridkv does not implement:
# refused with 400 unless absent or at their neutral value (every other unknown field is ignored, as OpenAI does).
_NEUTRAL_VALUES = (None, False, "", [], {})
_UNSUPPORTED_FIELDS = {
    "use_beam_search": "beam search is not supported",
    "length_penalty": "applies to beam search, which is not supported",
    "allowed_token_ids": "not supported; logit_bias can ban or favour tokens",
    "bad_words": "not supported; logit_bias can ban tokens",
    "truncate_prompt_tokens": "prompts are never truncated: send one that fits max_model_len",
    "return_tokens_as_token_ids": "not supported",
    "logits_processors": "custom logits processors are not supported",
    "prompt_embeds": "prompt embeddings are not supported",
}
_UNSUPPORTED_BY_ENDPOINT = {
    "completions": {"suffix": "not supported (no fill-in-the-middle)"},
    "chat": {
        "echo": "echoing the last message is not supported",
        "continue_final_message": "not supported",
        "chat_template": "a per-request chat template is not supported: the server's is used (--chat-template)",
        "audio": "audio output is not supported",
    },
    "responses": {
        "background": "background responses are not supported: send stream: true to follow a long one",
        "conversation": "conversations are not supported: chain responses with previous_response_id",
        "prompt": "prompt templates are not supported: send input and instructions",
        "reasoning": "reasoning options are not supported: this server runs no reasoning parser",
        "max_tool_calls": "not supported",
        "top_logprobs": "logprobs are not supported on /v1/responses; use /v1/chat/completions",
        "include": "extra output data is not supported (no logprobs, reasoning or tool outputs to include)",
        "context_management": "not supported",
    },
}


def refuse_unsupported(data: dict, endpoint: str) -> None:
    """APIError 400 naming the first field that asks for something hybridkv does not do."""
    for name, why in (_UNSUPPORTED_FIELDS | _UNSUPPORTED_BY_ENDPOINT[endpoint]).items():
        value = data.get(name)
        if not _neutral(name, value):
            raise APIError(400, f"{name}: {why}", name)
    n, best_of = data.get("n", 1), data.get("best_of")
    if best_of is not None and best_of != n:
        why = "must be >= n" if isinstance(best_of, int) and isinstance(n, int) and best_of < n else (
            "must equal n: returning the best n of more samples is not supported")
        raise APIError(400, f"best_of {why} (got best_of={best_of!r}, n={n!r})", "best_of")
    modalities = data.get("modalities")
    if endpoint == "chat" and modalities not in (None, ["text"]):
        raise APIError(400, f"modalities: only ['text'] is supported, got {modalities!r}", "modalities")


def _neutral(name: str, value) -> bool:
    if name == "length_penalty":
        return value is None or value == 1
    return any(value is v or (type(value) is type(v) and value == v) for v in _NEUTRAL_VALUES)
