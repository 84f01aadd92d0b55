"""Prompts of exact token lengths for ``hybridkv bench serve``.

Two sources: ``random`` (random non-special token ids, decoded) and ``text`` (windows of a text file
from seeded random character offsets). A text is never tokenized whole: only a window around each
start, sized from an estimated chars/token ratio and grown when it yields too few tokens.

Decoding ids and encoding the text back can change the count at boundaries, so every prompt is
re-encoded and adjusted until ``len(encode(prompt)) == input_len`` (counted without special tokens,
as vLLM's bench does); a prompt that cannot be made exact keeps its deviation in ``prompt_len``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

SUMMARIZE_INSTRUCTION = "Please summarize the following text."
_FIT_ROUNDS = 24
_HEAD_ATTEMPTS = 8
_RATIO_SAMPLES = 8
_RATIO_SAMPLE_CHARS = 2000
_SNAP_CHARS = 64


class TokenizerLike(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True)
class DatasetConfig:
    kind: str  # "random" | "text"
    input_len: int
    output_len: int
    num_prompts: int
    prefix_len: int = 0
    summarize_instruction: bool = False
    seed: int = 0
    path: str | None = None


@dataclass(slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens of ``prompt`` by the bench tokenizer, special tokens not added
    target_len: int
    expected_output_len: int
    offset: int | None = None  # character offset into the text file (text dataset)

    @property
    def deviation(self) -> int:
        return self.prompt_len - self.target_len


# -- token sources -----------------------------------------------------------------------------------


@dataclass(slots=True)
class RandomPool:
    """An endless stream of random non-special token ids."""

    tokenizer: TokenizerLike
    rng: np.random.Generator
    allowed: np.ndarray

    def take(self, count: int) -> list[int]:
        return self.rng.choice(self.allowed, size=max(count, 0)).tolist()

    def text(self, count: int) -> str:
        return self.tokenizer.decode(self.take(count))


@dataclass(slots=True)
class TextPool:
    """Consecutive tokens of a text from one start offset, encoding only a window that grows on demand."""

    tokenizer: TokenizerLike
    source: str
    start: int
    chars_per_token: float
    ids: list[int] = field(default_factory=list)
    window: int = 0
    used: int = 0

    def text(self, count: int) -> str:
        self._ensure(self.used + count)
        piece = self.ids[self.used : self.used + count]
        self.used += len(piece)
        return self.tokenizer.decode(piece)

    def _ensure(self, count: int) -> None:
        if len(self.ids) >= count:
            return
        size = max(self.window * 2, int(count * self.chars_per_token * 1.25) + _SNAP_CHARS)
        while True:
            self.window = size
            self.ids = self.tokenizer.encode(wrapped_window(self.source, self.start, size), add_special_tokens=False)
            if len(self.ids) >= count:
                return
            size *= 2


def wrapped_window(text: str, start: int, size: int) -> str:
    """``size`` characters of ``text`` from ``start``, continuing from the beginning (after a space) at the end."""
    pieces, remaining, position = [], size, start
    while remaining > 0:
        piece = text[position : position + remaining]
        pieces.append(piece)
        remaining -= len(piece)
        position = 0
        if remaining > 0:
            pieces.append(" ")
            remaining -= 1
    return "".join(pieces)


def estimate_chars_per_token(tokenizer: TokenizerLike, text: str, rng: np.random.Generator) -> float:
    """Characters per token over a few random samples of the text (never the whole text)."""
    chars = tokens = 0
    for _ in range(_RATIO_SAMPLES):
        start = int(rng.integers(max(len(text) - _RATIO_SAMPLE_CHARS, 1)))
        sample = text[start : start + _RATIO_SAMPLE_CHARS]
        chars += len(sample)
        tokens += len(tokenizer.encode(sample, add_special_tokens=False))
    if tokens == 0:
        raise ValueError("the dataset text yields no tokens")
    return max(chars / tokens, 0.5)


def snap_to_word(text: str, start: int) -> int:
    """Move ``start`` to the whitespace before the next word (within a few characters).

    A prompt body then begins with e.g. " word", which byte-level BPE never merges into the shared
    head before it, and no prompt starts mid-word.
    """
    limit = min(start + _SNAP_CHARS, len(text))
    position = start
    while position < limit and not text[position].isspace():
        position += 1
    while position + 1 < limit and text[position + 1].isspace():
        position += 1
    return position if position < limit else start


def special_ids(tokenizer: TokenizerLike, vocab_size: int) -> set[int]:
    is_special = getattr(tokenizer, "is_special", None)
    if is_special is None:
        return set()
    return {i for i in range(vocab_size) if is_special(i)}


def random_allowed_ids(tokenizer: TokenizerLike) -> np.ndarray:
    vocab_size = int(getattr(tokenizer, "vocab_size"))
    excluded = special_ids(tokenizer, vocab_size)
    allowed = np.array([i for i in range(vocab_size) if i not in excluded], dtype=np.int64)
    if allowed.size == 0:
        raise ValueError("the tokenizer has no non-special tokens")
    return allowed


# -- exact-length fitting ------------------------------------------------------------------------------


def fit_prompt(tokenizer: TokenizerLike, head: str, head_ids: list[int], pool, target: int) -> tuple[str, int]:
    """``head`` plus pool text, re-encoded and adjusted until it is exactly ``target`` tokens.

    Returns (prompt, its token count); the count differs from ``target`` only if no adjustment
    converged. The prompt's first tokens stay ``head_ids`` whenever the count is exact.
    """
    text = head + pool.text(target - len(head_ids))
    count = -1
    for _ in range(_FIT_ROUNDS):
        ids = tokenizer.encode(text, add_special_tokens=False)
        count = len(ids)
        if count == target:
            return text, count
        if count > target:
            text = tokenizer.decode(ids[:target])
        else:
            text += pool.text(target - count)
    return _trim_to(tokenizer, text, target, count)


def _trim_to(tokenizer: TokenizerLike, text: str, target: int, count: int) -> tuple[str, int]:
    """Last resort for an over-long prompt: drop trailing characters one at a time."""
    while count > target and len(text) > 1:
        text = text[:-1]
        count = len(tokenizer.encode(text, add_special_tokens=False))
    return text, count


def make_prompt(tokenizer: TokenizerLike, head: str, head_ids: list[int], new_pool, target: int):
    """A prompt that starts with exactly ``head_ids``; retried with fresh pools if the body merges into the head."""
    best = None
    for _ in range(_HEAD_ATTEMPTS):
        pool = new_pool()
        text, count = fit_prompt(tokenizer, head, head_ids, pool, target)
        head_kept = tokenizer.encode(text, add_special_tokens=False)[: len(head_ids)] == head_ids
        if count == target and head_kept:
            return text, count, pool
        if best is None or abs(count - target) < abs(best[1] - target):
            best = (text, count, pool)
    return best


def build_head(tokenizer: TokenizerLike, cfg: DatasetConfig, prefix_pool) -> tuple[str, list[int]]:
    """The text every prompt starts with: the optional instruction, then ``prefix_len`` shared tokens."""
    head = SUMMARIZE_INSTRUCTION + "\n" if cfg.summarize_instruction else ""
    if cfg.prefix_len > 0:
        prefix, _ = fit_prompt(tokenizer, "", [], prefix_pool, cfg.prefix_len)
        head += prefix.lstrip() if head else prefix
    head_ids = tokenizer.encode(head, add_special_tokens=False) if head else []
    if len(head_ids) >= cfg.input_len:
        raise ValueError(
            f"--input-len {cfg.input_len} leaves no room after the shared head of {len(head_ids)} tokens "
            "(--prefix-len and --summarize-instruction count in --input-len)"
        )
    return head, head_ids


# -- datasets -----------------------------------------------------------------------------------------


def random_dataset(tokenizer: TokenizerLike, cfg: DatasetConfig) -> list[SampleRequest]:
    rng = np.random.default_rng(cfg.seed)
    allowed = random_allowed_ids(tokenizer)

    def new_pool() -> RandomPool:
        return RandomPool(tokenizer, rng, allowed)

    head, head_ids = build_head(tokenizer, cfg, new_pool())
    samples = []
    for _ in range(cfg.num_prompts):
        text, count, _ = make_prompt(tokenizer, head, head_ids, new_pool, cfg.input_len)
        samples.append(SampleRequest(text, count, cfg.input_len, cfg.output_len))
    return samples


def text_dataset(tokenizer: TokenizerLike, cfg: DatasetConfig, text: str | None = None) -> list[SampleRequest]:
    if text is None:
        if not cfg.path:
            raise ValueError("--dataset text needs --dataset-path FILE")
        text = Path(cfg.path).read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise ValueError("the dataset text is empty")
    rng = np.random.default_rng(cfg.seed)
    ratio = estimate_chars_per_token(tokenizer, text, rng)
    starts = rng.choice(len(text), size=cfg.num_prompts + 1, replace=cfg.num_prompts + 1 > len(text))

    def pool_at(start: int) -> TextPool:
        return TextPool(tokenizer, text, snap_to_word(text, int(start)), ratio)

    head, head_ids = build_head(tokenizer, cfg, pool_at(starts[-1]))
    samples = []
    for start in starts[:-1]:
        offsets = iter([start, *rng.integers(len(text), size=_HEAD_ATTEMPTS - 1)])
        prompt, count, pool = make_prompt(tokenizer, head, head_ids, lambda: pool_at(next(offsets)), cfg.input_len)
        samples.append(SampleRequest(prompt, count, cfg.input_len, cfg.output_len, offset=pool.start))
    return samples


def load_dataset(tokenizer: TokenizerLike, cfg: DatasetConfig) -> list[SampleRequest]:
    if cfg.kind == "random":
        return random_dataset(tokenizer, cfg)
    if cfg.kind == "text":
        return text_dataset(tokenizer, cfg)
    raise ValueError(f"unknown dataset {cfg.kind!r}; choose random or text")


def dataset_summary(samples: list[SampleRequest]) -> dict:
    deviations = [s.deviation for s in samples]
    return {
        "num_prompts": len(samples),
        "exact_prompts": sum(d == 0 for d in deviations),
        "max_abs_deviation": max((abs(d) for d in deviations), default=0),
        "offsets": [s.offset for s in samples if s.offset is not None],
    }
