"""The whole engine (scheduler, paged hybrid cache, chunked prefill, prefix cache, preemption) generates exactly
what transformers generates, greedy, on tiny random checkpoints loaded from disk."""

from __future__ import annotations

import pytest
import torch
from tiny_models import random_prompts

from hybridkv import LLM, SamplingParams

N_NEW = 12


def greedy(n=N_NEW, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("name", ["llama4", "llama3", "mistral", "gemma3"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_matches_transformers_with_chunked_prefill_and_prefix_cache(tiny_model, name, block_size):
    model = tiny_model(name)
    # several chunks (8) long; the last two share their first 24 tokens with the first
    prompts = random_prompts([37, 21, 9], seed=1)
    prompts += [prompts[0][:24] + p for p in random_prompts([13, 30], seed=2)]
    expected = [model.greedy(p, N_NEW) for p in prompts]
    llm = LLM(model=str(model.path), block_size=block_size, max_num_batched_tokens=16, max_num_seqs=3)
    for round_ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == expected, f"round {round_}"
    # the second round came from the prefix cache wherever a prompt holds a full block before its last token
    cached = [o.num_cached_tokens for o in outs]
    assert all(c > 0 for c, p in zip(cached, prompts) if len(p) > block_size), cached
    assert all(c % block_size == 0 and c < len(p) for c, p in zip(cached, prompts))
    assert llm.engine.kv.stats.hit_tokens > 0
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_usable_blocks


@pytest.mark.parametrize("name,pages", [("llama4", 38), ("mistral", 10)])
def test_tight_kv_budget_queues_and_preempts_but_output_is_unchanged(tiny_model, name, pages):
    model = tiny_model(name)
    prompts = random_prompts([30, 26, 33, 19, 28], seed=3)
    expected = [model.greedy(p, 20) for p in prompts]
    probe = LLM(model=str(model.path), block_size=4, kv_cache_memory_bytes=1 << 20)
    page = probe.engine.layout.page_bytes
    # one request (50 tokens) fits at its peak, five together cannot (Mistral's window needs 5 pages, not 13)
    # whole 8-token chunks (no cap on one prompt's chunk): the pages above are counted for that schedule
    llm = LLM(model=str(model.path), block_size=4, max_num_batched_tokens=8, kv_cache_memory_bytes=pages * page,
              enable_prefix_caching=False, long_prefill_token_threshold=0)
    assert llm.engine.kv.can_ever_fit(50)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(20), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.scheduler.num_preemptions > 0
    kv = llm.engine.kv
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    assert all(v == 0 for v in kv.pool.in_use_by_group.values())


@pytest.mark.parametrize("name", ["llama4", "llama3"])
def test_logprobs_of_the_paged_engine_match_transformers(tiny_model, name):
    model = tiny_model(name)
    prompt = random_prompts([29], seed=4)[0]
    llm = LLM(model=str(model.path), block_size=4, max_num_batched_tokens=8)
    out = llm.generate({"prompt_token_ids": prompt}, greedy(1, logprobs=5), use_tqdm=False)[0]
    ref = model.logprobs(prompt)
    top = torch.topk(ref, 5)
    row = out.outputs[0].logprobs[0]
    assert [t for t, _ in row[1:]] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([lp for _, lp in row[1:]]), top.values, atol=1e-4, rtol=0)


def test_abort_mid_generation_frees_every_block(tiny_model):
    llm = LLM(model=str(tiny_model("llama4").path), block_size=4, max_num_batched_tokens=8)
    engine = llm.engine
    engine.add_request("a", random_prompts([40], seed=5)[0], greedy(50))
    engine.add_request("b", random_prompts([12], seed=6)[0], greedy(50))
    for _ in range(8):
        engine.step()
    assert engine.kv.pool.num_free_blocks < engine.kv.pool.num_usable_blocks
    assert engine.abort_request("a") and engine.abort_request("b")
    assert not engine.abort_request("a")
    assert not engine.has_unfinished_requests() and not engine.scheduler.has_unfinished
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks
    assert all(v == 0 for v in engine.kv.pool.in_use_by_group.values())


def test_n_greater_than_one_is_seeded_and_reproducible(tiny_model):
    llm = LLM(model=str(tiny_model("llama3").path), block_size=4)
    prompt = {"prompt_token_ids": random_prompts([10], seed=7)[0]}
    params = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=8, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    runs = [o.token_ids for o in first.outputs]
    assert len(runs) == 3 and len({tuple(r) for r in runs}) == 3
    assert runs == [o.token_ids for o in again.outputs]
    assert [o.index for o in first.outputs] == [0, 1, 2]


def test_bad_requests_are_refused_with_both_numbers_and_leave_no_state(tiny_model):
    path = str(tiny_model("llama3").path)
    llm = LLM(model=path, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match=r"70 tokens long but max_model_len is 64"):
        llm.generate({"prompt_token_ids": [5] * 70}, greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate({"prompt_token_ids": [5, 10_000]}, greedy(), use_tqdm=False)
    # one good and one bad prompt in a batch: the batch is refused and nothing stays queued
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [5] * 70}], greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.kv.pool.num_free_blocks == llm.engine.kv.pool.num_usable_blocks
    # a max_model_len the KV budget cannot hold is refused at start-up, naming what fits
    with pytest.raises(ValueError, match="too long: the KV cache"):
        LLM(model=path, block_size=4, max_model_len=512, kv_cache_memory_bytes=20 * 4 * 3 * 2 * 2 * 8 * 4)
    # a good request still works afterwards
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy(3), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3


def test_max_tokens_none_stops_at_the_context_limit(tiny_model):
    llm = LLM(model=str(tiny_model("llama3").path), block_size=4, max_model_len=40)
    out = llm.generate({"prompt_token_ids": [5] * 30}, SamplingParams(temperature=0, max_tokens=None,
                                                                      ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 10 and out.outputs[0].finish_reason == "length"


def test_max_model_len_beyond_the_model_context_names_the_context_or_is_clamped(tiny_model):
    path = str(tiny_model("llama3").path)
    with pytest.raises(ValueError, match=r"max_model_len 1000 is too long: the model's context .* is 512"):
        LLM(model=path, max_model_len=1000)
    from hybridkv.engine.llm_engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(model=path, max_model_len=1000, clamp_max_model_len=True))
    assert engine.max_model_len == 512


def test_final_only_requests_produce_one_output_with_everything(tiny_model):
    from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
    from hybridkv.engine.sampling_params import RequestOutputKind

    engine = LLMEngine(EngineConfig(model=str(tiny_model("llama3").path), block_size=4))
    prompt = random_prompts([12], seed=41)[0]
    engine.add_request("final", prompt, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True,
                                                       output_kind=RequestOutputKind.FINAL_ONLY))
    engine.add_request("every", prompt, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    seen = {"final": [], "every": []}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    assert len(seen["final"]) == 1 and seen["final"][0].finished and len(seen["every"]) == 7
    assert seen["final"][0].outputs[0].token_ids == seen["every"][-1].outputs[0].token_ids
    assert seen["final"][0].outputs[0].text == seen["every"][-1].outputs[0].text


def test_final_only_text_waits_but_matches_every_step_and_streamed_text(tiny_model):
    """``LLM.generate``'s requests detokenize late (``RequestOutputState.pending``), streams at once: the same
    text, finish and stop reasons whatever stops them (EOS, a stop token with and without its text, length)."""
    from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
    from hybridkv.engine.sampling_params import RequestOutputKind

    engine = LLMEngine(EngineConfig(model=str(tiny_model("llama3").path), block_size=4, max_num_seqs=8))
    prompts = random_prompts([5, 9, 14], seed=43)
    eos = dict(logit_bias={1: 100.0}, min_tokens=2)  # EOS (w1) as soon as min_tokens allows
    stops = [7, 9, 11, 13]
    variants = [eos, dict(stop_token_ids=stops), dict(stop_token_ids=stops, include_stop_str_in_output=True),
                dict(skip_special_tokens=False, n=2, **eos), dict(ignore_eos=True, **eos)]
    kinds = list(RequestOutputKind)
    for i, p in enumerate(prompts):
        for j, kw in enumerate(variants):
            for kind in kinds:  # high temperature, seeded: the same tokens in every kind, often an early stop
                engine.add_request(f"{kind.value}-{i}-{j}", p, SamplingParams(
                    temperature=3.0, seed=i * 10 + j, max_tokens=9, output_kind=kind, **kw))
    final, streamed = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            kind, key = out.request_id.split("-", 1)
            if kind == "delta":
                for o in out.outputs:
                    streamed[key, o.index] = streamed.get((key, o.index), "") + o.delta_text
            if out.finished:
                final[kind, key] = [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in out.outputs]
    keys = {key for _, key in final}
    assert len(keys) == len(prompts) * len(variants)
    reasons = {o[2:] for key in keys for o in final["final_only", key]}
    assert {("stop", None), ("length", None)} <= reasons and len(reasons) >= 4, reasons  # EOS, length, stop ids
    for key in keys:
        assert final["final_only", key] == final["cumulative", key] == final["delta", key]
        assert [streamed[key, i] for i in range(len(final["final_only", key]))] == [
            o[1] for o in final["cumulative", key]]
