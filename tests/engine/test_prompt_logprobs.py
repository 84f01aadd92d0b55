"""Prompt logprobs (``SamplingParams.prompt_logprobs``) come from the prefill's own hidden states and equal
transformers' log-softmax of the same tiny checkpoints, through chunked prefill, prefix caching and preemption."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_prompts

from hybridkv import LLM, SamplingParams
from hybridkv.engine import model_runner

TOP_K = 3
KV_BYTES = 8 << 20  # small: the 2 GiB CPU default takes seconds to allocate


def reference(model, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every prompt position: row p scores token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(model.hf(torch.tensor([prompt])).logits[0].float(), -1)


def assert_matches(prompt_logprobs, prompt: list[int], ref: torch.Tensor, k: int = TOP_K) -> None:
    assert len(prompt_logprobs) == len(prompt) and prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[p], ref[p - 1], prompt[p]
        assert abs(entry[token].logprob - row[token].item()) < 1e-4, p
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = torch.topk(row, k)
        ranked = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank <= k)
        assert [t for _, t in ranked] == top.indices.tolist(), p
        torch.testing.assert_close(torch.tensor([entry[t].logprob for _, t in ranked]), top.values,
                                   atol=1e-4, rtol=0)
        assert set(entry) == {token, *top.indices.tolist()}


@pytest.mark.parametrize("name", ["llama4", "mistral", "gemma3"])
def test_prompt_logprobs_match_transformers_over_chunked_prefill_and_a_cached_prefix(tiny_model, name):
    model = tiny_model(name)
    # 37 tokens over steps of 8; the second prompt shares its first 24 tokens with the first
    first = random_prompts([37], seed=11)[0]
    second = first[:24] + random_prompts([10], seed=12)[0]
    llm = LLM(model=str(model.path), block_size=4, max_num_batched_tokens=8, max_num_seqs=4,
              kv_cache_memory_bytes=KV_BYTES)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=TOP_K)
    plain = SamplingParams(temperature=0, max_tokens=2)
    # the first prompt without prompt logprobs fills the prefix cache; then both ask for them beside a plain one
    llm.generate({"prompt_token_ids": first}, plain, use_tqdm=False)
    outs = llm.generate([{"prompt_token_ids": first}, {"prompt_token_ids": second}, {"prompt_token_ids": second}],
                        [params, params, plain], use_tqdm=False)
    for out, prompt in zip(outs[:2], (first, second)):
        assert_matches(out.prompt_logprobs, prompt, reference(model, prompt))
        assert out.num_cached_tokens == 0  # every position was computed, none taken from the cache
    assert outs[2].prompt_logprobs is None and outs[2].num_cached_tokens > 0
    # the greedy continuation is what it is without prompt logprobs
    assert outs[0].outputs[0].token_ids == model.greedy(first, 2)
    kv = llm.engine.kv
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


def test_only_the_asked_rows_are_scored_in_lm_head_slices(tiny_model, monkeypatch):
    model = tiny_model("llama3")
    monkeypatch.setattr(model_runner, "SCORE_ROWS", 3)  # each step's rows cross several slices
    # whole 8-token chunks (no cap on one prompt's chunk), as the counts below assume
    llm = LLM(model=str(model.path), block_size=4, max_num_batched_tokens=8, kv_cache_memory_bytes=KV_BYTES,
              long_prefill_token_threshold=0)
    prompt = random_prompts([30], seed=13)[0]
    scored_rows = []
    prepare = llm.engine.runner.prepare

    def record(out):
        step = prepare(out)
        scored_rows.append(len(step.score_rows))
        return step

    llm.engine.runner.prepare = record
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=3), use_tqdm=False)
    assert not any(scored_rows)  # a request without prompt logprobs scores nothing
    scored_rows.clear()
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=3, prompt_logprobs=0),
                       use_tqdm=False)[0]
    # positions 0..28 score tokens 1..29, at most a step's 8 at a time; position 29 is the sampled row
    assert sum(scored_rows) == len(prompt) - 1 and max(scored_rows) == 8
    ref = reference(model, prompt)
    for p in range(1, len(prompt)):
        entry = out.prompt_logprobs[p]
        assert list(entry) == [prompt[p]]  # k = 0: the prompt token alone
        assert abs(entry[prompt[p]].logprob - ref[p - 1, prompt[p]].item()) < 1e-4


def test_preempted_prompt_logprob_requests_still_match(tiny_model):
    model = tiny_model("llama4")
    prompts = random_prompts([30, 26, 33, 19, 28], seed=14)
    probe = LLM(model=str(model.path), block_size=4, kv_cache_memory_bytes=1 << 20)
    page = probe.engine.layout.page_bytes
    llm = LLM(model=str(model.path), block_size=4, max_num_batched_tokens=8, kv_cache_memory_bytes=38 * page)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=TOP_K)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out, prompt in zip(outs, prompts):
        assert_matches(out.prompt_logprobs, prompt, reference(model, prompt))
        assert out.outputs[0].token_ids == model.greedy(prompt, 20)
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_usable_blocks


def test_n_copies_share_one_scoring_and_abort_mid_prefill_frees_every_block(tiny_model):
    model = tiny_model("llama4")
    llm = LLM(model=str(model.path), block_size=4, max_num_batched_tokens=8, kv_cache_memory_bytes=KV_BYTES)
    prompt = random_prompts([21], seed=15)[0]
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=2, max_tokens=2, seed=1, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 2
    assert_matches(out.prompt_logprobs, prompt, reference(model, prompt), k=1)
    engine = llm.engine
    engine.add_request("a", random_prompts([40], seed=16)[0], SamplingParams(max_tokens=5, prompt_logprobs=2))
    engine.step()
    engine.step()
    assert engine.kv.pool.num_free_blocks < engine.kv.pool.num_usable_blocks
    assert engine.abort_request("a")
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks


def test_negative_prompt_logprobs_is_refused():
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0"):
        SamplingParams(prompt_logprobs=-1)


def test_single_token_prompt_has_only_the_empty_entry(tiny_model):
    llm = LLM(model=str(tiny_model("llama3").path), block_size=4, kv_cache_memory_bytes=KV_BYTES)
    out = llm.generate({"prompt_token_ids": [5]}, SamplingParams(max_tokens=1, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]
