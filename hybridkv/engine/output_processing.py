"""Per-sequence output processing: incremental detokenisation and stop checks.

Per generated token the engine calls ``RequestOutputState.append_token``; it
appends the token to the sequence's ids (``Sequence.all_token_ids``, the one
list of a sequence's prompt and output ids: the state reads its outputs there,
``OutputTokenIds``), detokenises, applies vLLM's stop rules and sets
``finish_reason``, the one field that says a sequence finished.  Streaming
callers take text with ``take_delta``.

Text nobody reads before the request ends (``RequestOutputKind.FINAL_ONLY``,
no stop strings: what ``LLM.generate`` asks) is detokenised later: the tokens
wait in ``pending`` until ``catch_up_text`` (the engine calls it while the GPU
computes the next step) or until ``text`` is read.  The detokeniser sees the
same tokens in the same order either way, so text and deltas are the same.

Stop semantics (vLLM's):
* nothing stops before ``min_tokens`` output tokens except the length limits;
* EOS (unless ``ignore_eos``) and ``stop_token_ids`` finish with "stop"; the
  token stays in ``token_ids`` but its text is left out of ``text`` unless
  ``include_stop_str_in_output``; ``stop_reason`` is the stop token id, or
  None for EOS;
* stop strings may span tokens; ``text`` is cut before the earliest match
  (after it with ``include_stop_str_in_output``); ``stop_reason`` is the string;
* "length" when ``max_tokens`` outputs exist, or prompt + output reaches
  ``max_model_len``; a "stop" on the same token wins over "length".
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.engine.sampler import TokenScores
from hybridkv.engine.sampling_params import RequestOutputKind, SamplingParams

Logprobs = list[tuple[int, float]]

# Tokens of context decoded before the unread ones; enough for sentencepiece
# to see a preceding piece (so leading spaces survive) and for a UTF-8
# character split over up to 4 byte tokens.
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a growing token sequence into text deltas.

    Decodes the window ``ids[prefix_offset:]`` and diffs it against
    ``ids[prefix_offset:read_offset]``: decoding a whole window, not single
    tokens, keeps BPE/sentencepiece spacing right, and a decode ending in
    U+FFFD is an incomplete UTF-8 character, so it is held back until the
    following tokens complete it.
    """

    __slots__ = ("_tokenizer", "_ids", "_prefix_offset", "_read_offset", "_skip_special")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        # Seed the window with the prompt's tail so the first output token is
        # decoded in context (e.g. keeps its leading space); no window reaches
        # further back, so a long prompt is not copied.
        self._ids = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._skip_special = skip_special_tokens

    def add_token(self, token_id: int) -> str:
        """Append one token; return the newly completed text (maybe ""; always without a tokenizer)."""
        if self._tokenizer is None:  # skip_tokenizer_init: token ids out, no text
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)


class OutputTokenIds(Sequence):
    """A sequence's output ids, read in place from the list of its prompt and output ids together (no copy per
    step); ``append`` adds a token to that list.

        ids = [5, 6, 7, 8]; out = OutputTokenIds(ids, 2)   # a 2-token prompt
        len(out) == 2, out[-1] == 8, list(out) == [7, 8]; out.append(9) -> ids == [5, 6, 7, 8, 9]
    """

    __slots__ = ("all_token_ids", "start")

    def __init__(self, all_token_ids: list[int], start: int) -> None:
        self.all_token_ids = all_token_ids
        self.start = start  # the prompt's length

    def __len__(self) -> int:
        return len(self.all_token_ids) - self.start

    def __getitem__(self, i):
        if isinstance(i, slice):
            return self.all_token_ids[self.start:][i]
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"output token {i} of {n}")
        return self.all_token_ids[self.start + i if i >= 0 else i]

    def __iter__(self) -> Iterator[int]:
        # a copy of the outputs, not islice: islice steps over the whole prompt first (a 1M-token prompt: ms a step)
        return iter(self.all_token_ids[self.start:])

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, Sequence) else NotImplemented

    def append(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)


@dataclass(slots=True)
class RequestOutputState:
    """What the engine keeps per output sequence.

    ``token_ids`` are all generated ids (stop tokens included), read from the
    sequence's ids; ``text`` the detokenised output after stop handling;
    ``logprobs`` one entry per token (``SamplerOutput`` rows) or None when not
    requested.
    """

    params: SamplingParams
    prompt_len: int
    detokenizer: IncrementalDetokenizer
    token_ids: OutputTokenIds
    _text: str = ""
    logprobs: list[Logprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | None
    stop_reason: int | str | None = None  # stop token id or stop string
    streamed_chars: int = 0
    # the sampled tokens' logprobs summed as they come (with ``logprobs``): no pass over every row per step
    cumulative_logprob: float = 0
    # Text is needed only at the end (final output only, no stop strings): tokens wait in ``pending`` for the
    # detokenizer until ``catch_up_text`` or a read of ``text``.
    defer_text: bool = False
    pending: list[int] = field(default_factory=list)
    # the output count from which the next token is the logits' argmax (``SamplingParams.argmax_only``), or None
    argmax_from: int | None = None

    @classmethod
    def create(
        cls, params: SamplingParams, prompt_ids: Sequence[int], tokenizer: Tokenizer,
        all_token_ids: list[int] | None = None,
    ) -> RequestOutputState:
        """``all_token_ids``: the sequence's list of ids, the prompt's first, which the outputs are appended to
        (``Sequence.all_token_ids``); None: a list of its own."""
        ids = OutputTokenIds(list(prompt_ids) if all_token_ids is None else all_token_ids, len(prompt_ids))
        detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
        logprobs: list[Logprobs] | None = [] if params.logprobs is not None else None
        defer = (tokenizer is not None and not params.stop
                 and params.output_kind is RequestOutputKind.FINAL_ONLY)
        argmax_from = params.min_tokens if params.argmax_only(params.min_tokens) else None
        return cls(params, len(prompt_ids), detok, ids, logprobs=logprobs, defer_text=defer, argmax_from=argmax_from)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def argmax_only(self) -> bool:
        """``params.argmax_only`` of the next token (a per-request constant and the output count)."""
        return self.argmax_from is not None and len(self.token_ids) >= self.argmax_from

    @property
    def text(self) -> str:
        if self.pending:
            self.catch_up_text()
        return self._text

    @text.setter
    def text(self, value: str) -> None:
        self.catch_up_text()
        self._text = value

    def catch_up_text(self) -> None:
        """Detokenize the tokens whose text was deferred."""
        pending, add = self.pending, self.detokenizer.add_token
        if pending:
            self._text += "".join([add(t) for t in pending])
            pending.clear()

    def append_token(
        self,
        token_id: int,
        logprobs: Logprobs | None = None,
        *,
        eos_token_ids: Collection[int] = (),
        max_model_len: int | None = None,
    ) -> str | None:
        """Record one sampled token (appended to the sequence's ids); return the finish reason, if it finished."""
        if self.finish_reason is not None:
            raise RuntimeError(f"sequence already finished ({self.finish_reason})")
        self.token_ids.append(token_id)
        if self.logprobs is not None:
            row = list(logprobs or ())
            self.logprobs.append(row)
            if row:
                self.cumulative_logprob += row[0][1]
        new_chars = 0
        if not (_stop_token_hit(self, eos_token_ids) and not self.params.include_stop_str_in_output):
            if self.defer_text:  # no stop strings: the text decides nothing now
                self.pending.append(token_id)
            else:
                delta = self.detokenizer.add_token(token_id)
                self._text += delta
                new_chars = len(delta)
        self.finish_reason = check_stop(
            self, new_char_count=new_chars, eos_token_ids=eos_token_ids,
            max_model_len=max_model_len)
        return self.finish_reason

    def take_delta(self) -> str:
        """Text not yet streamed.

        While running, the last ``max_stop_len - 1`` chars are held back: they
        could be the start of a stop string that a later token completes and
        that would then be cut from ``text``.
        """
        text = self.text
        end = len(text)
        if self.params.stop and not self.finished and not self.params.include_stop_str_in_output:
            end -= max(self.params.max_stop_len - 1, 0)
        end = max(end, self.streamed_chars)
        delta = text[self.streamed_chars:end]
        self.streamed_chars = end
        return delta


def check_stop(
    state: RequestOutputState,
    *,
    new_char_count: int,
    eos_token_ids: Collection[int] = (),
    max_model_len: int | None = None,
) -> str | None:
    """Finish reason after ``state``'s last token and its ``new_char_count``
    chars of text were appended, or None to keep going.

    On a stop-string hit this truncates ``state.text``; on any stop it sets
    ``state.stop_reason``.
    """
    params = state.params
    num_out = len(state.token_ids)
    if num_out >= params.min_tokens:
        if _stop_token_hit(state, eos_token_ids):
            last = state.token_ids[-1]
            state.stop_reason = last if last in params.stop_token_ids else None
            return "stop"
        hit = params.stop and find_stop_string(state.text, new_char_count, params.stop,
                                               params.include_stop_str_in_output)
        if hit:
            state.stop_reason, cut = hit
            state.text = state.text[:cut]
            return "stop"
    if params.max_tokens is not None and num_out >= params.max_tokens:
        return "length"
    if max_model_len is not None and state.prompt_len + num_out >= max_model_len:
        return "length"
    return None


def find_stop_string(
    text: str, new_char_count: int, stop: Sequence[str], include: bool
) -> tuple[str, int] | None:
    """Earliest stop string that ends inside the last ``new_char_count`` chars
    of ``text``, with the length to cut ``text`` to; None if none.

    Only matches touching new text count: older text was checked already
    (or was under ``min_tokens``, where vLLM ignores stop strings too).
    """
    if new_char_count <= 0:
        return None
    best: tuple[str, int] | None = None
    for s in stop:
        start = max(0, len(text) - new_char_count - len(s) + 1)
        idx = text.find(s, start)
        if idx != -1 and (best is None or idx < best[1]):
            best = (s, idx)
    if best is None:
        return None
    s, idx = best
    return s, idx + len(s) if include else idx


def _stop_token_hit(state: RequestOutputState, eos_token_ids: Collection[int]) -> bool:
    params = state.params
    if len(state.token_ids) < params.min_tokens:
        return False
    last = state.token_ids[-1]
    if last in params.stop_token_ids:
        return True
    return not params.ignore_eos and last in eos_token_ids


@dataclass(slots=True)
class Logprob:
    """vLLM's: a token's log-probability and its rank in the vocabulary (1: the most likely)."""

    logprob: float
    rank: int
    decoded_token: str | None = None  # the engine leaves it None; the server writes each token's text


# vLLM's shape: one entry per prompt token, None for the first (nothing precedes it), else the token's own
# Logprob followed by the position's top k.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class PromptScores:
    """A prompt's logprobs, gathered from the prefill steps: position p's logits score prompt token p + 1.

    Positions arrive in order, a prefill chunk at a time; a sequence recomputed after preemption skips those
    already scored (``num_scored``)."""

    prompt_token_ids: Sequence[int]
    top_k: int
    parts: list[TokenScores] = field(default_factory=list)
    num_scored: int = 0
    _built: PromptLogprobs | None = field(default=None, repr=False)

    @property
    def complete(self) -> bool:
        return self.num_scored >= len(self.prompt_token_ids) - 1

    def add(self, scores: TokenScores) -> None:
        self.parts.append(scores)
        self.num_scored += len(scores)

    def build(self) -> PromptLogprobs:
        """vLLM's ``prompt_logprobs`` (built once, when every position is scored)."""
        if self._built is not None:
            return self._built
        out: PromptLogprobs = [None]
        if self.parts:
            s = TokenScores.concat(self.parts)
            top_ids, top_lps = s.top_ids[:, : self.top_k].tolist(), s.top_logprobs[:, : self.top_k].tolist()
            targets = self.prompt_token_ids[1 : self.num_scored + 1]
            for token, lp, rank, ids, lps in zip(targets, s.logprobs.tolist(), s.ranks.tolist(), top_ids, top_lps):
                entry = {token: Logprob(lp, rank)}
                for j, (t, v) in enumerate(zip(ids, lps), 1):
                    entry.setdefault(t, Logprob(v, j))
                out.append(entry)
        if self.complete:
            self._built, self.parts = out, []
        return out
