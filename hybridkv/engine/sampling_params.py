"""Per-request sampling parameters, named and defaulted as in vLLM."""

from __future__ import annotations

import enum
import json as _json
from dataclasses import dataclass
from typing import Any

# Below this a temperature is treated as greedy: dividing logits by ~0 would
# overflow, and the resulting distribution is argmax anyway.
_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.Enum):
    """Which outputs a request produces (vLLM's names): every step with all text so far, every step with only the
    new text, or only the final one (what ``LLM.generate`` wants: no per-step copies of growing outputs)."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


@dataclass(slots=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's names): exactly one of ``json`` (a JSON schema, dict or text),
    ``regex``, ``choice`` (one of these strings), ``grammar`` (EBNF as xgrammar/GBNF write it, or Lark) or
    ``json_object`` (any JSON object). ``disable_any_whitespace`` makes JSON compact (no free whitespace
    between tokens)."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as error:
                raise ValueError(f"structured_outputs.json: not valid JSON ({error})") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(f"structured_outputs.json: a JSON schema is an object, got {type(self.json).__name__}")
        if self.choice is not None:
            self.choice = list(self.choice)
            if not self.choice or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice: a non-empty list of non-empty strings is needed")
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar, json_object must be set, got "
                + (", ".join(kinds) or "none")
            )

    @property
    def kind(self) -> str:
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k))


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's continuation(s).

    ``top_k`` accepts both 0 and -1 for "off" (older and newer vLLM) and is
    normalised to 0.  ``stop`` is normalised to a list and ``stop_token_ids``
    to a list.  ``max_tokens=None`` means "until the context limit".
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    # vLLM's: the prompt's tokens scored by the prefill (each with its logprob and rank) and each position's top k
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI: -100 bans, 100 forces)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self.stop = _normalise_stop(self.stop)
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or ())]
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(t): float(b) for t, b in self.logit_bias.items()} or None
        self._validate()

    def _validate(self) -> None:
        _check(self.n >= 1, "n", "must be >= 1", self.n)
        _check(self.temperature >= 0.0, "temperature", "must be >= 0", self.temperature)
        _check(0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]", self.top_p)
        _check(self.top_k >= 0, "top_k", "must be -1 or 0 (disabled) or >= 1", self.top_k)
        _check(0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]", self.min_p)
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               "must be in [-2, 2]", self.presence_penalty)
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               "must be in [-2, 2]", self.frequency_penalty)
        _check(self.repetition_penalty > 0.0, "repetition_penalty", "must be > 0",
               self.repetition_penalty)
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", "must be >= 1 or None", self.max_tokens)
        _check(self.min_tokens >= 0, "min_tokens", "must be >= 0", self.min_tokens)
        if self.max_tokens is not None:
            _check(self.min_tokens <= self.max_tokens, "min_tokens",
                   f"must be <= max_tokens={self.max_tokens}", self.min_tokens)
        if self.logprobs is not None:
            _check(self.logprobs >= 0, "logprobs", "must be >= 0 or None", self.logprobs)
        if self.prompt_logprobs is not None:
            _check(self.prompt_logprobs >= 0, "prompt_logprobs", "must be >= 0 or None", self.prompt_logprobs)
        if self.seed is not None:  # torch generators take 64 bits; sequence i of n draws from seed + i
            _check(-(2**63) <= self.seed < 2**63, "seed", "must fit in 64 bits (-2**63 to 2**63 - 1)", self.seed)
        for token, bias in (self.logit_bias or {}).items():
            _check(-100.0 <= bias <= 100.0, "logit_bias", f"values must be in [-100, 100] (token {token})", bias)
        # An empty stop string would match at every position and end at once.
        _check(all(self.stop), "stop", "must not contain an empty string", self.stop)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def argmax_only(self, num_output_tokens: int) -> bool:
        """The next token is the raw logits' argmax and nothing else of them is read: greedy, no logprobs, nothing
        that edits logits (bias, penalties, a grammar, ``min_tokens`` not yet reached). Then the sampler takes one
        argmax, and the model may compute only the argmax exactly (``model/int8_head_cpu.py``)."""
        return (self.greedy and self.logprobs is None and not self.logit_bias and self.presence_penalty == 0
                and self.frequency_penalty == 0 and self.repetition_penalty == 1
                and num_output_tokens >= self.min_tokens and self.structured_outputs is None)

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def _normalise_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        return [stop]
    return list(stop)


def _check(ok: bool, name: str, rule: str, value: object) -> None:
    if not ok:
        raise ValueError(f"{name} {rule}, got {value!r}")
