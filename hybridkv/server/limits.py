"""What a client may send, checked before the work it would cost: body size, JSON nesting, context length.

A body is refused with 413 from its ``Content-Length`` before a byte is read, or as soon as a chunked body grows
past the limit; a body that has not all arrived within ``body_read_timeout_s`` (a ``Content-Length`` larger than
what is sent, a client that stalls) gets 408 and the connection is closed; JSON nested deeper than the limit is
refused before the decoder recurses into it (a body of 100,000 nested arrays would otherwise raise RecursionError);
NaN and Infinity (which Python's decoder accepts) are refused as the JSON standard does, and so are strings that
are not Unicode (an escaped unpaired surrogate such as ``"\\ud800"``, which Python's decoder turns into a str that
no tokenizer or UTF-8 encoder takes).
"""

from __future__ import annotations

import asyncio
import json
import re
from dataclasses import dataclass

import numpy as np
from starlette.requests import Request

from hybridkv.server.errors import APIError

DEFAULT_MAX_BODY_BYTES = 100 << 20  # a 10M-token prompt sent as token ids is about 70 MB of JSON
DEFAULT_MAX_JSON_DEPTH = 128  # a request is 4 levels deep; a JSON schema inside one rarely passes 20
DEFAULT_BODY_READ_TIMEOUT_S = 30.0  # the whole body: 100 MiB at 30 MB/s, any chat request over a slow link
# A JSON string (escapes included), written so the regex engine loops over plain characters without backtracking.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
# Only a body with a \uD800-\uDFFF escape, or those code points' (invalid) UTF-8 bytes, which json.loads decodes
# with "surrogatepass", can decode to an unpaired surrogate.
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89abcdefABCDEF]|\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_OPENERS = np.frombuffer(b"[{", np.uint8)
_CLOSERS = np.frombuffer(b"]}", np.uint8)


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


def json_depth(raw: bytes) -> int:
    """How deeply arrays and objects nest in ``raw`` (brackets inside strings do not count)."""
    a = np.frombuffer(_JSON_STRING.sub(b"", raw), np.uint8)
    steps = np.isin(a, _OPENERS).astype(np.int32) - np.isin(a, _CLOSERS).astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))


def parse_json(raw: bytes, max_depth: int):
    """The decoded body; APIError 400 for malformed JSON, nesting deeper than ``max_depth``, NaN or Infinity, or a
    string (or key) holding an unpaired surrogate."""
    if raw.count(b"[") + raw.count(b"{") > max_depth:  # cheap: only such bodies can nest that deep
        depth = json_depth(raw)
        if depth > max_depth:
            raise APIError(400, f"the request body nests JSON arrays and objects {depth:,} levels deep; "
                                f"at most {max_depth} are accepted")
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"malformed JSON in the request body: {error}") from None
    if _SURROGATE_BYTES.search(raw) or json.detect_encoding(raw) != "utf-8":
        bad = unpaired_surrogate(data)
        if bad is not None:
            path, char = bad
            raise APIError(400, f"{path or 'request body'}: not valid Unicode: the string holds an unpaired "
                                f"surrogate (\\u{ord(char):04x}); send UTF-8 text, or escape characters outside "
                                "the BMP as a surrogate pair", path.split(".")[0] or None)
    return data


def unpaired_surrogate(data, path: str = "") -> tuple[str, str] | None:
    """(path of the first string or key holding an unpaired surrogate, that surrogate), or None. The decoder has
    already joined every escaped pair into one character, so any surrogate left is unpaired."""
    if isinstance(data, str):
        found = _SURROGATE.search(data)
        return None if found is None else (path, found.group())
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        # the path goes into the error message, which must itself be valid Unicode
        name = key.encode("utf-8", "backslashreplace").decode() if isinstance(key, str) else str(key)
        where = f"{path}.{name}" if path else name
        found = (unpaired_surrogate(key, where) if isinstance(key, str) else None) or unpaired_surrogate(value, where)
        if found is not None:
            return found
    return None


def _refuse_constant(name: str):
    raise APIError(400, f"malformed JSON in the request body: {name} is not a JSON number")


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
