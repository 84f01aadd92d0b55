"""The CPU step budget: a long prompt goes in capped chunks, other requests start and decode between them, and an
aborted prompt stops at the next step boundary with its blocks back."""

from __future__ import annotations

import asyncio

import pytest
from tiny_models import random_prompts

from hybridkv import LLM, SamplingParams
from hybridkv.engine.config import CPU_STEP_TOKENS, GPU_STEP_TOKENS, EngineConfig, resolve_step_budget
from hybridkv.server.async_engine import AsyncEngine
from hybridkv.server.metrics import ServerMetrics


def greedy(n):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def test_step_defaults_differ_by_device_and_explicit_values_stay():
    cpu = resolve_step_budget(EngineConfig(), "cpu")
    assert (cpu.max_num_batched_tokens, cpu.long_prefill_token_threshold) == (CPU_STEP_TOKENS, CPU_STEP_TOKENS // 2)
    # async scheduling: on where a GPU computes while the host works, off on the CPU; an explicit choice stays
    assert (cpu.async_scheduling, resolve_step_budget(EngineConfig(), "cuda").async_scheduling) == (False, True)
    assert resolve_step_budget(EngineConfig(async_scheduling=True), "cpu").async_scheduling is True
    assert resolve_step_budget(EngineConfig(async_scheduling=False), "cuda").async_scheduling is False
    gpu = resolve_step_budget(EngineConfig(), "cuda")
    assert (gpu.max_num_batched_tokens, gpu.long_prefill_token_threshold) == (GPU_STEP_TOKENS, 0)
    mine = resolve_step_budget(EngineConfig(max_num_batched_tokens=300, long_prefill_token_threshold=0), "cpu")
    assert (mine.max_num_batched_tokens, mine.long_prefill_token_threshold) == (300, 0)
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        resolve_step_budget(EngineConfig(long_prefill_token_threshold=-1), "cpu")


def test_the_cpu_engine_chunks_a_long_prompt_by_default(tiny_model):
    engine = LLM(model=str(tiny_model("llama3").path), device="cpu").engine
    assert engine.config.max_num_batched_tokens == CPU_STEP_TOKENS
    engine = LLM(model=str(tiny_model("llama3").path), device="cpu", max_num_batched_tokens=200).engine
    engine.add_request("long", random_prompts([450], seed=1)[0], greedy(1))
    chunks = []
    while engine.has_unfinished_requests():
        out = engine.schedule()
        chunks.append(out.num_tokens)
        engine.execute(out)
    assert chunks == [100, 100, 100, 100, 50]  # half the step: a request arriving meanwhile has the other half


def test_a_short_request_sent_during_a_long_prefill_finishes_first(tiny_model):
    engine = LLM(model=str(tiny_model("llama3").path), block_size=4, max_num_batched_tokens=16).engine
    engine.add_request("long", random_prompts([200], seed=2)[0], greedy(2))
    for _ in range(3):  # the long prompt is mid-prefill: 3 chunks of 8 of its 200 tokens
        assert not engine.step()
    engine.add_request("short", random_prompts([5], seed=3)[0], greedy(6))
    finished, steps_with_both = [], 0
    while engine.has_unfinished_requests():
        out = engine.schedule()
        ids = {s.seq.request_id.rsplit(":", 1)[0] for s in out.scheduled}
        steps_with_both += ids == {"long", "short"}
        finished += [o.request_id for o in engine.execute(out) if o.finished]
    assert finished == ["short", "long"]
    assert steps_with_both >= 6  # the short one's prefill and decodes shared steps with the long prefill's chunks


def test_an_aborted_long_prompt_stops_at_the_next_step_and_frees_its_blocks(tiny_model):
    engine = LLM(model=str(tiny_model("llama3").path), block_size=4, max_num_batched_tokens=16).engine
    pool = engine.kv.pool
    engine.add_request("long", random_prompts([200], seed=4)[0], greedy(2))
    for _ in range(3):
        engine.step()
    assert pool.num_free_blocks < pool.num_usable_blocks  # it holds its first chunks' blocks
    assert engine.abort_request("long")
    assert pool.num_free_blocks == pool.num_usable_blocks
    engine.add_request("other", random_prompts([6], seed=5)[0], greedy(3))
    while engine.has_unfinished_requests():
        out = engine.schedule()
        assert [s.seq.request_id for s in out.scheduled] == ["other:0"]
        engine.execute(out)
    assert pool.num_free_blocks == pool.num_usable_blocks


def test_a_stream_aborted_by_its_client_mid_prefill_is_never_scheduled_again(tiny_model):
    """The server's path: a client gone during a long prefill aborts its stream; the engine thread drops the
    request before its next step (not after the whole prompt)."""
    engine = LLM(model=str(tiny_model("llama3").path), block_size=4, max_num_batched_tokens=16).engine
    scheduled: list[set[str]] = []
    schedule = engine.schedule

    def recording_schedule():
        out = schedule()
        scheduled.append({s.seq.request_id for s in out.scheduled})
        return out

    engine.schedule = recording_schedule

    async def main():
        server = AsyncEngine(engine, ServerMetrics("tiny"))
        server.start()
        stream = await server.add_request("long", random_prompts([400], seed=6)[0], greedy(2))
        while len(scheduled) < 2:
            await asyncio.sleep(0.005)
        stream.abort()
        while engine.has_unfinished_requests():
            await asyncio.sleep(0.005)
        steps_at_abort = len(scheduled)
        server.shutdown()
        return steps_at_abort

    steps = asyncio.run(main())
    assert steps < 400 // 8  # it stopped long before its 50 chunks were done
    assert all(ids == {"long:0"} for ids in scheduled)
    assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_usable_blocks
