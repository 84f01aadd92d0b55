"""Tensor parallelism on CPU (gloo, 2 ranks: this process and one spawned worker) generates exactly what one
rank does, with each rank holding only its shard; a worker that dies or raises fails the engine loudly."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from tiny_models import random_prompts

from hybridkv import LLM, SamplingParams
from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.engine.tp_workers import TensorParallelError
from hybridkv.kv.planner import PlanInputs, plan_capacity
from hybridkv.model.loading.hf_config import load_hf_config

TP = 2
KV_BYTES = 1 << 20
N_NEW = 12


def greedy(n=N_NEW):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def parity_prompts() -> list[list[int]]:
    # several chunks (8) long; the last two share their first 24 tokens with the first
    prompts = random_prompts([37, 21, 9], seed=1)
    return prompts + [prompts[0][:24] + p for p in random_prompts([13, 30], seed=2)]


def engine_args(path) -> dict:
    return dict(model=str(path), block_size=4, max_num_batched_tokens=16, max_num_seqs=3,
                kv_cache_memory_bytes=KV_BYTES)


def generate(llm: LLM, prompts: list[list[int]], n=N_NEW):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(n), use_tqdm=False)


@pytest.fixture
def shut_down():
    """Collects LLMs (or engines) to shut down after the test, whatever its outcome."""
    made: list[LLM | LLMEngine] = []
    yield made.append
    for llm in made:
        llm.shutdown()
    assert not dist.is_initialized()


def tp2_matches_tp1(path, shut_down) -> tuple[LLM, LLM, list]:
    """TP 1 and TP 2 engines over ``path`` after asserting TP 2 generates TP 1's tokens, twice over; and the
    second round's outputs."""
    prompts = parity_prompts()
    one = LLM(**engine_args(path))
    expected = [o.outputs[0].token_ids for o in generate(one, prompts)]
    llm = LLM(**engine_args(path), tensor_parallel_size=TP)
    shut_down(llm)
    for round_ in range(2):
        outs = generate(llm, prompts)
        assert [o.outputs[0].token_ids for o in outs] == expected, f"round {round_}"
    return one, llm, outs


@pytest.mark.parametrize("name", ["llama4", "llama3"])
def test_steps_in_two_halves_are_token_exact_with_tp1(tiny_model, shut_down, monkeypatch, name):
    """prefill_overlap_tokens=1: every step of 2+ tokens runs its layers in two halves, each half's all-reduces
    deferred (gloo's async works here) while the other half computes; the cut crosses sequences mid-chunk, whose
    second piece attends to the first piece's K/V written by the same layer, or falls between decode tokens."""
    from hybridkv.engine.model_runner import ModelRunner
    from hybridkv.model.architectures.llama import LlamaForCausalLM

    path = tiny_model(name).path
    prompts = parity_prompts()
    one = LLM(**engine_args(path))
    expected = [o.outputs[0].token_ids for o in generate(one, prompts)]
    halved, moe_halved, output_runs = [], [], []
    begin, moe_in_halves = ModelRunner._begin_step, LlamaForCausalLM._moe_in_halves
    output_layer = LlamaForCausalLM._output_layer

    def spy(runner, step):
        halves = begin(runner, step)
        halved.append(halves is not None)
        return halves

    def moe_spy(model, layer, halves, runs):
        moe_halved.append(layer.self_attn.layer_id)
        return moe_in_halves(model, layer, halves, runs)

    def output_spy(model, runs, states, attn, outputs):
        output_runs.append((len(runs), len(outputs.rows)))
        return output_layer(model, runs, states, attn, outputs)

    monkeypatch.setattr(ModelRunner, "_begin_step", spy)
    monkeypatch.setattr(LlamaForCausalLM, "_moe_in_halves", moe_spy)
    monkeypatch.setattr(LlamaForCausalLM, "_output_layer", output_spy)
    llm = LLM(**engine_args(path), tensor_parallel_size=TP, prefill_overlap_tokens=1)
    shut_down(llm)
    assert [o.outputs[0].token_ids for o in generate(llm, prompts)] == expected
    assert sum(halved) >= 8 and not all(halved)  # steps ran in halves, 1-token decode steps whole
    # Llama-4's MoE layers ran their routed experts over both halves' rows at once (rank 0, this process)
    moe_layers = [i for i, layer in enumerate(llm.engine.model.layers) if type(layer.mlp).__name__ == "MoE"]
    assert bool(moe_layers) == (name == "llama4")
    assert sorted(set(moe_halved)) == moe_layers and len(moe_halved) >= 8 * len(moe_layers)
    # the last layer of steps in halves with rows nobody reads (prompt chunks) ran for the sampled rows alone
    assert any(runs == 2 and rows == 0 for runs, rows in output_runs), output_runs
    assert any(runs == 2 and rows > 0 for runs, rows in output_runs), output_runs
    with pytest.raises(ValueError, match="prefill_overlap_tokens must be >= 0"):
        LLM(**engine_args(path), prefill_overlap_tokens=-1)


@pytest.mark.parametrize("name", ["llama4", "llama3"])
def test_tp2_is_token_exact_with_tp1_through_chunked_prefill_and_prefix_cache(tiny_model, shut_down, name):
    path = tiny_model(name).path
    one, llm, outs = tp2_matches_tp1(path, shut_down)
    # the second round came from the prefix cache, which every rank's cache served alike
    assert all(o.num_cached_tokens > 0 for o in outs if len(o.prompt_token_ids) > 4)
    # prompt logprobs: every rank takes part in the LM-head calls that score the prompt's positions
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=3)
    want, got = (x.generate({"prompt_token_ids": parity_prompts()[0]}, params, use_tqdm=False)[0].prompt_logprobs
                 for x in (one, llm))
    assert [list(e) for e in got[1:]] == [list(e) for e in want[1:]]
    values = [[lp.logprob for e in entries[1:] for lp in e.values()] for entries in (got, want)]
    torch.testing.assert_close(torch.tensor(values[0]), torch.tensor(values[1]), atol=1e-5, rtol=0)
    kv = llm.engine.kv
    assert kv.stats.hit_tokens > 0 and kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    # 2 KV heads: one per rank, so a rank's pages are half as big and the same bytes hold twice the blocks
    assert {s.num_kv_heads for s in llm.engine.layer_specs} == {1}
    assert llm.engine.layout.page_bytes * 2 == one.engine.layout.page_bytes
    plan = plan_capacity(load_hf_config(path), PlanInputs(tensor_parallel_size=TP, kv_cache_dtype="float32",
                                                          block_size=4, kv_memory_bytes=KV_BYTES))
    assert kv.pool.num_usable_blocks == plan.usable_blocks and llm.engine.layout.page_bytes == plan.page_bytes
    assert_rank0_holds_its_shard(llm.engine.model, one.engine.model)


def test_async_scheduling_launches_tp2_decode_steps_ahead_token_exact_with_tp1(tiny_model, shut_down):
    """Asked for, async scheduling works under TP 2 as on one rank: rank 0 schedules and launches the next decode
    step before it reads this step's tokens, and every rank takes that step's input ids from rank 0's device (a
    broadcast at the step's start), since the workers' copy of the step is pickled without them. On by default
    with CUDA at any TP size, as on one rank; off on the CPU."""
    from hybridkv.engine.config import resolve_step_budget

    path = tiny_model("llama4").path
    prompts = parity_prompts()
    one = LLM(**engine_args(path))
    expected = [o.outputs[0].token_ids for o in generate(one, prompts)]
    llm = LLM(**engine_args(path), tensor_parallel_size=TP, async_scheduling=True)
    shut_down(llm)
    for round_ in range(2):  # the second round's prompts hit the prefix cache, decoded blocks included
        outs = generate(llm, [p + e for p, e in zip(prompts, expected)] if round_ else prompts)
        want = expected if not round_ else [o.outputs[0].token_ids for o in generate(
            one, [p + e for p, e in zip(prompts, expected)])]
        assert [o.outputs[0].token_ids for o in outs] == want, f"round {round_}"
    # 5 requests of 12 tokens, at most 3 running: once none waits, the decode steps go ahead
    assert llm.engine.steps_launched_ahead >= 8, llm.engine.steps_launched_ahead
    kv = llm.engine.kv
    assert kv.stats.hit_tokens > 0 and kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    assert llm.engine.ahead.pending is None and not llm.engine.has_unfinished_requests()
    config = EngineConfig(model=str(path))
    assert resolve_step_budget(config, "cuda").async_scheduling
    assert resolve_step_budget(replace(config, tensor_parallel_size=TP), "cuda").async_scheduling
    assert not resolve_step_budget(replace(config, tensor_parallel_size=TP), "cpu").async_scheduling


def assert_rank0_holds_its_shard(shard: torch.nn.Module, full: torch.nn.Module) -> None:
    cfg = full.cfg
    half_vocab = cfg.vocab_size // TP
    torch.testing.assert_close(shard.embed_tokens.weight, full.embed_tokens.weight[:half_vocab], rtol=0, atol=0)
    attn, full_attn = shard.layers[0].self_attn, full.layers[0].self_attn
    q_rows = cfg.num_heads // TP * cfg.head_dim
    torch.testing.assert_close(attn.q_proj.weight, full_attn.q_proj.weight[:q_rows], rtol=0, atol=0)
    torch.testing.assert_close(attn.o_proj.weight, full_attn.o_proj.weight[:, :q_rows], rtol=0, atol=0)
    if cfg.moe_layers:
        experts, full_experts = shard.layers[cfg.moe_layers[0]].mlp.experts, full.layers[cfg.moe_layers[0]].mlp.experts
        i = cfg.intermediate_size
        gate, up = full_experts.gate_up_proj[..., : i // TP], full_experts.gate_up_proj[..., i : i + i // TP]
        torch.testing.assert_close(experts.gate_up_proj, torch.cat((gate, up), -1), rtol=0, atol=0)
        torch.testing.assert_close(experts.down_proj, full_experts.down_proj[:, : i // TP], rtol=0, atol=0)


def test_fewer_kv_heads_than_ranks_are_replicated(tiny_model, shut_down):
    # the tiny Mistral has 1 KV head (and slides over 8 tokens): each rank keeps a copy of it
    model = tiny_model("mistral")
    prompts = random_prompts([30, 17], seed=3)
    expected = [model.greedy(p, N_NEW) for p in prompts]
    llm = LLM(**engine_args(model.path), tensor_parallel_size=TP)
    shut_down(llm)
    assert [o.outputs[0].token_ids for o in generate(llm, prompts)] == expected
    assert {s.num_kv_heads for s in llm.engine.layer_specs} == {1}
    k_proj = llm.engine.model.layers[0].self_attn.k_proj
    assert k_proj.weight.shape == (8, 32)  # the whole (only) KV head; the 4 query heads are split 2 + 2


def test_a_model_that_does_not_split_evenly_is_refused_before_any_process_starts(tiny_model):
    with pytest.raises(ValueError, match="cannot be split evenly over tensor_parallel_size 3"):
        LLM(**engine_args(tiny_model("llama3").path), tensor_parallel_size=3)
    assert not dist.is_initialized()


def test_a_worker_killed_mid_generation_fails_the_engine_within_seconds(tiny_model, shut_down):
    llm = LLM(**engine_args(tiny_model("llama3").path), tensor_parallel_size=TP)
    shut_down(llm)
    engine = llm.engine
    procs = list(engine.workers.procs)
    engine.add_request("a", random_prompts([40], seed=5)[0], greedy(400))
    engine.step()
    threading.Timer(0.2, os.kill, (procs[0].pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 10
    assert not any(p.is_alive() for p in procs)
    assert not dist.is_initialized()  # the group is gone too: a new engine could start in this process
    with pytest.raises(TensorParallelError, match="cannot step.*killed by SIGKILL"):
        engine.step()


def test_a_hung_worker_fails_the_engine_after_the_collective_timeout(tiny_model, shut_down):
    config = EngineConfig(model=str(tiny_model("llama3").path), block_size=4, tensor_parallel_size=TP,
                          distributed_timeout_s=3)
    engine = LLMEngine(config)
    shut_down(engine)
    proc = engine.workers.procs[0]
    engine.add_request("a", random_prompts([20], seed=7)[0], greedy(400))
    engine.step()
    os.kill(proc.pid, signal.SIGSTOP)  # alive, but never answers again
    start = time.monotonic()
    with pytest.raises(TensorParallelError, match="Timed out"):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 3 + 8
    assert not proc.is_alive()


def test_a_worker_that_raises_fails_the_engine_with_its_traceback(tiny_model, shut_down):
    llm = LLM(**engine_args(tiny_model("llama3").path), tensor_parallel_size=TP)
    shut_down(llm)
    workers = llm.engine.workers
    workers.conns[0].send("not a step")  # the worker's execute raises on it
    with pytest.raises(TensorParallelError, match=r"rank 1 raised:\n(.|\n)*AttributeError"):
        generate(llm, random_prompts([10], seed=6))
    assert not any(p.is_alive() for p in workers.procs)


def test_the_cli_flag_reaches_the_engine_config():
    import argparse

    from hybridkv.engine.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--tensor-parallel-size", "2"])).tensor_parallel_size == 2
    with pytest.raises(ValueError, match="at least 1"):
        engine_config_from_args(parser.parse_args(["--tensor-parallel-size", "0"]))


def test_dummy_weights_build_each_rank_from_the_config_alone(tmp_path):
    """load_format="dummy": no weight files, every rank draws its own seeded shard, generation runs."""
    import json

    from tiny_models import CONFIGS

    config = CONFIGS["llama4"]().to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    one = LLM(model=str(tmp_path), load_format="dummy", seed=3)
    assert one.engine.loaded.name.endswith("(dummy weights)")
    norms = [p for n, p in one.engine.model.named_parameters() if "norm" in n]
    assert all(bool((p == 1).all()) for p in norms)
    out = one.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6
    again = LLM(model=str(tmp_path), load_format="dummy", seed=3)
    assert again.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)[0].outputs[0].token_ids == \
        out.outputs[0].token_ids  # seeded: the same weights again
    two = LLM(model=str(tmp_path), load_format="dummy", seed=3, tensor_parallel_size=2)
    try:
        got = two.generate({"prompt_token_ids": [5, 6, 7, 8]}, params, use_tqdm=False)[0]
        assert len(got.outputs[0].token_ids) == 6
    finally:
        two.shutdown()


def test_gemma3_tp2_is_token_exact_with_tp1(tiny_model, shut_down):
    """Gemma-3 through the one model factory: 2 query heads and 1 KV head (replicated), sliding window 8 on five of
    six layers, tied and vocabulary-split embedding, through chunked prefill."""
    model = tiny_model("gemma3")
    one, llm, _ = tp2_matches_tp1(model.path, shut_down)
    prompt = parity_prompts()[0]  # and TP 1 is transformers' own answer
    assert generate(one, [prompt])[0].outputs[0].token_ids == model.greedy(prompt, N_NEW)
    shard, full = llm.engine.model, one.engine.model
    assert shard.tp.size == TP and full.tp.size == 1
    half_vocab = full.cfg.vocab_size // TP
    torch.testing.assert_close(shard.embed_tokens.weight, full.embed_tokens.weight[:half_vocab], rtol=0, atol=0)
    attn, full_attn = shard.layers[0].self_attn, full.layers[0].self_attn
    q_rows = full.cfg.num_heads // TP * full.cfg.head_dim
    torch.testing.assert_close(attn.q_proj.weight, full_attn.q_proj.weight[:q_rows], rtol=0, atol=0)
    torch.testing.assert_close(attn.k_proj.weight, full_attn.k_proj.weight, rtol=0, atol=0)  # the one KV head
    inter = full.cfg.intermediate_size // TP
    torch.testing.assert_close(shard.layers[0].mlp.down_proj.weight, full.layers[0].mlp.down_proj.weight[:, :inter],
                               rtol=0, atol=0)


def test_gemma3_dummy_weights_on_one_and_two_ranks(tmp_path, shut_down):
    """load_format="dummy" builds Gemma-3 too: norms neutral (Gemma's zero-centred weights: 0), seeded."""
    import json

    from tiny_models import CONFIGS

    (tmp_path / "config.json").write_text(json.dumps(CONFIGS["gemma3"]().to_dict()))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    one = LLM(model=str(tmp_path), load_format="dummy", seed=3)
    assert type(one.engine.model).__name__ == "Gemma3ForCausalLM"
    norms = [p for n, p in one.engine.model.named_parameters() if "norm" in n]
    assert norms and all(bool((p == 0).all()) for p in norms)
    assert float(one.engine.model.layers[0].mlp.up_proj.weight.detach().std()) == pytest.approx(0.02, rel=0.2)
    out = one.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert len(out) == 6
    again = LLM(model=str(tmp_path), load_format="dummy", seed=3)
    assert again.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == out
    two = LLM(model=str(tmp_path), load_format="dummy", seed=3, tensor_parallel_size=TP)
    shut_down(two)
    assert len(two.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids) == 6


def rank_and_shard(runner, name: str) -> tuple[int, tuple[int, ...]]:
    """Run on every rank by ``collective_rpc``: the rank and the shape of its shard of parameter ``name``."""
    return runner.model.tp.rank, tuple(runner.model.get_parameter(name).shape)


def test_collective_rpc_runs_on_every_rank_and_returns_their_results(tiny_model, shut_down):
    path = tiny_model("llama3").path
    one = LLM(**engine_args(path))
    name = "layers.0.self_attn.q_proj.weight"
    (rank, whole), = one.engine.collective_rpc(rank_and_shard, name)
    llm = LLM(**engine_args(path), tensor_parallel_size=TP)
    shut_down(llm)
    got = llm.engine.collective_rpc(rank_and_shard, name)
    assert got == [(r, (whole[0] // TP, whole[1])) for r in range(TP)]  # each rank's own half of the heads
    assert rank == 0
    # the engine still steps after a call, and the call left the workers in step with rank 0
    assert generate(llm, random_prompts([10], seed=7), n=3)[0].outputs[0].token_ids


def test_graph_steps_send_workers_only_the_block_tables_they_lack():
    """A decode step that replays a graph reaches the workers without the block tables of rows whose
    ``tables_version`` they already hold (their decode buffers keep them); new versions, version 0 (unknown) and
    eager steps carry them whole."""
    import numpy as np

    from hybridkv.engine.cuda_graphs import DecodeGraphs
    from hybridkv.engine.model_runner import StepInput
    from hybridkv.engine.tp_workers import TPDriverRunner
    from hybridkv.model.attention.base import StepSequence

    graphs = DecodeGraphs.__new__(DecodeGraphs)  # its bucket choice alone: no GPU here
    graphs.buckets, graphs.max_seqs, graphs.graphs = [1, 2, 4], 4, {}
    runner = TPDriverRunner.__new__(TPDriverRunner)
    runner.graphs, runner.sent_versions = graphs, [0] * 4
    tables = [np.arange(8, dtype=np.int32)]

    def sent(versions, query_len=1):
        seqs = [StepSequence(100, query_len, tables, v) for v in versions]
        step = StepInput(np.zeros(len(seqs) * query_len, dtype=np.int64), seqs,
                         np.arange(len(seqs), dtype=np.int64))
        return [len(s.block_tables) for s in runner._for_workers(step).seqs]

    assert sent([5, 7]) == [1, 1]  # new to the workers
    assert sent([5, 7]) == [0, 0]  # held: stripped
    assert sent([5, 8, 9]) == [0, 1, 1]  # row 1 got a new block; row 2 is new
    assert sent([7, 8, 9]) == [1, 0, 0]  # another sequence in row 0
    assert sent([0, 8]) == [1, 0]  # version 0: always sent
    assert sent([0, 8], query_len=2) == [1, 1]  # a prefill step runs eagerly: every table goes
    # async scheduling: rank 0's device ids never travel (a CUDA tensor would pickle as an IPC handle); the flag does
    ids = torch.tensor([3, 4])
    step = StepInput(np.zeros(2, dtype=np.int64), [StepSequence(100, 1, tables, 9)] * 2, np.arange(2),
                     device_input_ids=ids, ids_from_rank0=True)
    for query_len in (1, 2):  # a graph step, and an eager one
        step.seqs = [StepSequence(100, query_len, tables, 9)] * 2
        theirs = runner._for_workers(step)
        assert theirs.device_input_ids is None and theirs.ids_from_rank0 and step.device_input_ids is ids
