"""Prompt generation: exact token lengths, bounded tokenization of big texts, offsets, shared prefixes."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from hybridkv.bench.datasets import (
    SUMMARIZE_INSTRUCTION,
    DatasetConfig,
    dataset_summary,
    random_dataset,
    text_dataset,
    wrapped_window,
)


@dataclass(slots=True)
class RecordingTokenizer:
    """Wraps a tokenizer and remembers the longest string ever passed to encode."""

    inner: object
    longest: int = 0
    calls: int = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.longest = max(self.longest, len(text))
        self.calls += 1
        return self.inner.encode(text, add_special_tokens)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.inner.decode(ids, skip_special_tokens)


def big_text(chars: int, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    words = ["the", "cache", "block", "attention", "window", "serving", "latency", "token", "naïve", "über",
             "2026", "KV-cache,", "prefix.", "(sliding)", "日本語", "emoji🙂", "don't", "\n\n", "—", "x" * 12]
    picks = rng.integers(len(words), size=chars // 5 + 1)
    text = " ".join(words[i] for i in picks)
    return text[:chars]


def ids(tok, prompt: str) -> list[int]:
    return tok.encode(prompt, add_special_tokens=False)


@pytest.mark.parametrize("input_len", [1, 7, 64, 300, 1500])
def test_random_exact_lengths(smollm_tokenizer, input_len):
    cfg = DatasetConfig("random", input_len, 4, num_prompts=12, seed=input_len)
    samples = random_dataset(smollm_tokenizer, cfg)
    assert len(samples) == 12
    for s in samples:
        assert s.prompt_len == input_len == len(ids(smollm_tokenizer, s.prompt))
    assert len({s.prompt for s in samples}) == 12
    special = set(range(17))  # SmolLM2's special ids
    assert not any(set(ids(smollm_tokenizer, s.prompt)) & special for s in samples)


def test_random_is_seeded(smollm_tokenizer):
    cfg = DatasetConfig("random", 32, 4, num_prompts=3, seed=7)
    first = [s.prompt for s in random_dataset(smollm_tokenizer, cfg)]
    assert first == [s.prompt for s in random_dataset(smollm_tokenizer, cfg)]
    cfg.seed = 8
    assert first != [s.prompt for s in random_dataset(smollm_tokenizer, cfg)]


@pytest.mark.parametrize("input_len", [5, 128, 1000, 4000])
def test_text_exact_lengths_without_encoding_whole_text(smollm_tokenizer, input_len):
    text = big_text(6_000_000)
    tok = RecordingTokenizer(smollm_tokenizer)
    cfg = DatasetConfig("text", input_len, 4, num_prompts=10, seed=3)
    samples = text_dataset(tok, cfg, text)
    for s in samples:
        assert s.prompt_len == input_len == len(ids(smollm_tokenizer, s.prompt))
        assert s.prompt.strip()[:20] in text
    # Windows are sized from the chars/token estimate: a few times the prompt, never the 6 MB text.
    assert tok.longest <= max(4000, input_len * 12), tok.longest
    offsets = [s.offset for s in samples]
    assert len(set(offsets)) == len(offsets) == 10
    assert dataset_summary(samples)["offsets"] == offsets


def test_text_dataset_from_file_and_offsets_spread(smollm_tokenizer, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(big_text(2_000_000, seed=1), encoding="utf-8")
    cfg = DatasetConfig("text", 200, 4, num_prompts=20, seed=0, path=str(path))
    samples = text_dataset(smollm_tokenizer, cfg)
    offsets = sorted(s.offset for s in samples)
    assert len(set(offsets)) == 20
    assert offsets[-1] - offsets[0] > 500_000  # random over the file, not clustered at the start
    assert all(s.prompt_len == 200 for s in samples)
    assert len({s.prompt[:100] for s in samples}) == 20  # no accidental shared prefix


def test_text_shorter_than_prompt_wraps(smollm_tokenizer):
    text = "A short text about paged attention and prefix caching."
    samples = text_dataset(smollm_tokenizer, DatasetConfig("text", 100, 4, num_prompts=3, seed=0), text)
    assert all(len(ids(smollm_tokenizer, s.prompt)) == 100 for s in samples)
    assert wrapped_window("abcdef", 4, 6) == "ef abc"


@pytest.mark.parametrize("kind", ["random", "text"])
@pytest.mark.parametrize("summarize", [False, True])
def test_shared_prefix_is_shared(smollm_tokenizer, kind, summarize):
    prefix_len, input_len = 48, 160
    cfg = DatasetConfig(kind, input_len, 4, num_prompts=8, prefix_len=prefix_len,
                        summarize_instruction=summarize, seed=11)
    text = big_text(500_000, seed=2)
    samples = random_dataset(smollm_tokenizer, cfg) if kind == "random" else text_dataset(smollm_tokenizer, cfg, text)
    token_lists = [ids(smollm_tokenizer, s.prompt) for s in samples]
    assert all(len(t) == input_len for t in token_lists)
    head = token_lists[0][:prefix_len]
    assert all(t[:prefix_len] == head for t in token_lists)
    # The bodies after the shared part differ.
    shared = prefix_len + (10 if summarize else 0)
    assert len({tuple(t[shared:]) for t in token_lists}) == len(token_lists)
    if summarize:
        assert all(s.prompt.startswith(SUMMARIZE_INSTRUCTION) for s in samples)


def test_summarize_instruction_counts_in_input_len(smollm_tokenizer):
    cfg = DatasetConfig("text", 40, 4, num_prompts=4, summarize_instruction=True, seed=5)
    samples = text_dataset(smollm_tokenizer, cfg, big_text(100_000))
    for s in samples:
        assert s.prompt.startswith(SUMMARIZE_INSTRUCTION + "\n")
        assert len(ids(smollm_tokenizer, s.prompt)) == 40


def test_input_len_must_exceed_shared_head(smollm_tokenizer):
    with pytest.raises(ValueError, match="input-len"):
        random_dataset(smollm_tokenizer, DatasetConfig("random", 16, 4, num_prompts=2, prefix_len=16))
