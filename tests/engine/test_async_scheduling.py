"""Async scheduling (``EngineConfig.async_scheduling``): the next decode step is scheduled and launched before this
step's tokens are read, its input ids taken from the device. On the CPU nothing overlaps, but every piece of the
bookkeeping runs: these tests hold it to the synchronous engine's tokens, cache hits and freed blocks."""

from __future__ import annotations

import json

import pytest
from tiny_models import random_prompts

from hybridkv import LLM, SamplingParams
from hybridkv.engine.ahead import PLACEHOLDER


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, **kw)


def engines(model, **kw):
    common = dict(model=str(model.path), block_size=4, max_num_batched_tokens=32, **kw)
    return LLM(async_scheduling=False, **common), LLM(async_scheduling=True, **common)


def assert_all_blocks_free(llm):
    kv = llm.engine.kv
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    assert not llm.engine.has_unfinished_requests() and llm.engine.ahead.pending is None


@pytest.mark.parametrize("name", ["llama4", "gemma3"])
def test_async_greedy_matches_transformers_and_the_synchronous_engine(tiny_model, name):
    """Requests of different lengths finish at different steps (while the step after theirs is in flight); the
    second round's prompts continue the first round's outputs, so their prefix-cache hits reach into blocks that
    decode steps filled: those must have been hashed from the real tokens, not the placeholders."""
    model = tiny_model(name)
    prompts = random_prompts([21, 9, 30], seed=5)
    lengths = [7, 12, 3]
    params = [greedy(n, ignore_eos=True) for n in lengths]
    sync, ahead = engines(model)
    for round_ in range(2):
        if round_:
            prompts = [p + out for p, out in zip(prompts, expected)]
        expected = [model.greedy(p, n) for p, n in zip(prompts, lengths)]
        batch = [{"prompt_token_ids": p} for p in prompts]
        want = sync.generate(batch, params, use_tqdm=False)
        got = ahead.generate(batch, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == expected, f"round {round_}"
        assert [o.outputs[0].token_ids for o in want] == expected
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
        assert [o.num_cached_tokens for o in got] == [o.num_cached_tokens for o in want], f"round {round_}"
    # the hits of the second round reach past the first round's prompts
    first_round = [21, 9, 30]
    assert sum(o.num_cached_tokens > n for o, n in zip(got, first_round)) >= 2, [o.num_cached_tokens for o in got]
    assert ahead.engine.kv.stats.hit_tokens == sync.engine.kv.stats.hit_tokens
    # most decode steps went ahead: 3 requests of up to 12 tokens, two rounds
    assert ahead.engine.steps_launched_ahead >= 12
    assert sync.engine.steps_launched_ahead == 0
    for llm in (sync, ahead):
        assert_all_blocks_free(llm)


def test_async_stops_on_eos_and_stop_tokens_one_step_late_without_a_trace(tiny_model):
    """A stop found when the tokens are read: the step launched after it computed a row for nothing, which is
    dropped; the output ends where the synchronous engine's does."""
    model = tiny_model("llama4")
    prompts = random_prompts([15, 22, 8, 17], seed=6)
    free_run = [model.greedy(p, 16) for p in prompts]
    # stop on each request's 4th greedy token, or the 9th for the second one (stop_token_ids, as vLLM)
    params = [greedy(16, stop_token_ids=[run[3 if i != 1 else 8]]) for i, run in enumerate(free_run)]
    sync, ahead = engines(model)
    batch = [{"prompt_token_ids": p} for p in prompts]
    want = sync.generate(batch, params, use_tqdm=False)
    got = ahead.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in want]
    assert all(o.outputs[0].finish_reason == "stop" for o in got)
    assert ahead.engine.steps_launched_ahead > 0
    assert_all_blocks_free(ahead)


def test_async_steps_fall_back_to_synchronous_ones_where_they_cannot_go_ahead(tiny_model):
    """Sampled and logprob requests, requests waiting for a slot (max_num_seqs 2) and max_tokens 1 and 2 all run
    through the same engine: each step goes ahead only when it may (not while a row asks for logprobs), and the
    results are the synchronous ones."""
    model = tiny_model("llama3")
    prompts = random_prompts([12, 19, 7, 25, 10], seed=7)
    params = [greedy(1), greedy(2), SamplingParams(temperature=0.8, seed=3, max_tokens=9),
              greedy(8, logprobs=2), greedy(11)]
    sync, ahead = engines(model, max_num_seqs=2)
    batch = [{"prompt_token_ids": p} for p in prompts]
    want = sync.generate(batch, params, use_tqdm=False)
    got = ahead.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [len(o.outputs[0].token_ids) for o in got] == [1, 2, 9, 8, 11]
    assert got[3].outputs[0].logprobs == want[3].outputs[0].logprobs
    assert ahead.engine.steps_launched_ahead > 0
    assert_all_blocks_free(ahead)


def test_async_sampled_requests_go_ahead_and_match_the_synchronous_engine(tiny_model):
    """Temperature, top-k, top-p, min-p, penalties, min_tokens and logit_bias, seeded rows and an unseeded one (the
    two engines' samplers share a seed): each step is sampled before the next is launched, from the tokens up to
    the step before, so the tokens are the synchronous engine's."""
    model = tiny_model("llama4")
    prompts = random_prompts([13, 20, 9, 16], seed=9)
    params = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=5, top_p=0.9, seed=2, max_tokens=14, repetition_penalty=1.3,
                       ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.1, frequency_penalty=0.5, presence_penalty=0.3, min_tokens=6,
                       max_tokens=12, logit_bias={5: 2.0}),
        greedy(9, ignore_eos=True),
    ]
    sync, ahead = engines(model, seed=4)
    batch = [{"prompt_token_ids": p} for p in prompts]
    want = sync.generate(batch, params, use_tqdm=False)
    got = ahead.generate(batch, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert len(got[1].outputs[0].token_ids) == 14 and len(got[2].outputs[0].token_ids) >= 6
    # every decode step of the 14-token request but its first and last could go ahead
    assert ahead.engine.steps_launched_ahead >= 10, ahead.engine.steps_launched_ahead
    assert_all_blocks_free(ahead)


def test_async_json_mode_follows_its_schema_token_for_token_with_the_synchronous_engine():
    """A grammar's mask for a step comes from the tokens up to the step before, all in place when the step is
    sampled: the real model's JSON output under async scheduling is the synchronous one, sampled or greedy."""
    from hybridkv import StructuredOutputsParams

    common = dict(max_model_len=256, kv_cache_memory_bytes=32 << 20, seed=5)
    sync, ahead = LLM(async_scheduling=False, **common), LLM(async_scheduling=True, **common)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    for temperature, prompt in ((0.9, "Describe a person as JSON."), (0, "A person, as JSON:")):
        params = SamplingParams(temperature=temperature, seed=7, max_tokens=40,
                                structured_outputs=StructuredOutputsParams(json=schema))
        launched = ahead.engine.steps_launched_ahead
        want = sync.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        got = ahead.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        assert got.token_ids == want.token_ids
        assert got.finish_reason == "stop", got.text
        assert set(json.loads(got.text)) == {"name", "age"}
        # the request ran alone: its own steps went ahead
        assert ahead.engine.steps_launched_ahead - launched >= len(got.token_ids) - 3, temperature
    assert_all_blocks_free(ahead)


def test_async_rows_asking_for_logprobs_keep_their_steps_synchronous(tiny_model):
    """Their values would be read behind the next step: no step goes ahead while such a row runs."""
    model = tiny_model("llama4")
    prompt = random_prompts([11], seed=10)[0]
    params = SamplingParams(temperature=0.9, seed=2, max_tokens=8, logprobs=3, ignore_eos=True)
    sync, ahead = engines(model)
    want = sync.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    got = ahead.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs
    assert ahead.engine.steps_launched_ahead == 0
    assert_all_blocks_free(ahead)


def test_aborting_a_request_whose_next_step_is_in_flight_frees_its_blocks(tiny_model):
    model = tiny_model("llama4")
    prompts = random_prompts([14, 11], seed=8)
    expected = model.greedy(prompts[1], 10)
    _, ahead = engines(model)
    engine = ahead.engine
    engine.add_request("a", prompts[0], greedy(10, ignore_eos=True))
    engine.add_request("b", prompts[1], greedy(10, ignore_eos=True))
    while engine.ahead.pending is None or engine.ahead.pending.result is None:
        engine.step()
    # between steps every sampled token is in place: only the step in flight has yet to give its own
    seqs = [s.seq for s in engine.ahead.pending.out.scheduled]
    assert len(seqs) == 2 and all(PLACEHOLDER not in s.all_token_ids for s in seqs)
    assert engine.abort_request("a")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    assert "a" not in done and done["b"].outputs[0].token_ids == expected
    assert_all_blocks_free(ahead)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_dropped_engine_is_freed_at_once_not_by_the_cycle_collector(tiny_model, async_scheduling):
    """The engine holds the KV cache (on a GPU, most of its memory): dropping the last reference must free it
    there and then, so a second engine in the same process finds the memory (a reference cycle through the
    steps-ahead state kept it until ``gc.collect``)."""
    import gc
    import weakref

    llm = LLM(model=str(tiny_model("llama4").path), block_size=4, async_scheduling=async_scheduling)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], greedy(3), use_tqdm=False)
    engine, cache = weakref.ref(llm.engine), weakref.ref(llm.engine.kv)
    gc.disable()
    try:
        del llm
        assert engine() is None and cache() is None
    finally:
        gc.enable()
