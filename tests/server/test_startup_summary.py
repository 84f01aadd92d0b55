"""The start-up summary: what the engine serves, with the planner's numbers for the same cache, and the line the
``hybridkv serve`` process logs once it listens."""

from __future__ import annotations

import signal

import pytest
from test_lifecycle import SHUTDOWN_BOUND, ServerProcess

from hybridkv.engine.llm_engine import EngineConfig, LLMEngine
from hybridkv.kv.planner import PlanInputs, plan_capacity
from hybridkv.server.app import build_app
from hybridkv.server.summary import startup_summary
from hybridkv.server.tool_calls import ToolConfig

KV_BYTES = 16 << 20


def summary_for(model_path, tools: ToolConfig | None = None, kv_bytes: int = KV_BYTES,
                **config) -> tuple[str, LLMEngine]:
    engine = LLMEngine(EngineConfig(model=str(model_path), device="cpu", block_size=4, kv_cache_memory_bytes=kv_bytes,
                                    max_num_batched_tokens=64, clamp_max_model_len=True, **config))
    app = build_app(engine, served_model_name="tiny", tools=tools)
    return startup_summary(app.state.server, "http://127.0.0.1:8123"), engine


def test_the_summary_states_the_planners_numbers(tiny_model):
    model = tiny_model("gemma3")  # 5 sliding layers (window 8), 1 full, max_position_embeddings 512
    text, engine = summary_for(model.path, ToolConfig(True, "hermes"), kv_offload_bytes=KV_BYTES // 2)
    plan = plan_capacity(engine.loaded.hf_config, PlanInputs(kv_memory_bytes=KV_BYTES, block_size=4,
                                                             kv_cache_dtype="float32", max_num_batched_tokens=64))
    lines = text.splitlines()
    assert lines[0] == "hybridkv serve ready at http://127.0.0.1:8123"
    assert lines[1] == f"  model: {engine.loaded.name}, served as 'tiny' on cpu, float32 (KV cache float32)"
    params = sum(p.numel() * 4 for p in engine.loaded.model.parameters())  # float32, no buffers in this model
    assert lines[2] == f"  weights: float32, {params / (1 << 30):.2f} GiB"
    del lines[2]
    assert plan.max_model_len > 512  # the cache holds more than the model was trained for: its context bounds it
    assert lines[2] == "  max_model_len: 512 tokens (why: the model's context (max_position_embeddings) is 512)"
    assert plan.usable_blocks == engine.kv.pool.num_usable_blocks
    assert lines[3] == (f"  KV pool: {plan.usable_blocks:,} blocks of 4 tokens ({plan.page_bytes:,} B pages), "
                        f"{plan.pool_tokens:,} tokens per group when shared evenly: full 1 group of 1 layers, "
                        "sliding(8) 5 groups of 1 layers")
    inputs = PlanInputs(kv_memory_bytes=KV_BYTES, block_size=4, kv_cache_dtype="float32", max_num_batched_tokens=64,
                        max_model_len=512)
    ratio = next(c for c in plan_capacity(engine.loaded.hf_config, inputs).concurrency if c.num_tokens == 512)
    assert lines[4] == (f"  concurrency at max_model_len: {ratio.ratio:,.2f}x "
                        f"({ratio.blocks_per_request:,} blocks per request)")
    pages = KV_BYTES // 2 // plan.page_bytes
    host_gib = KV_BYTES / 2 / (1 << 30)
    assert lines[5] == (f"  prefix caching: on (xxh3_128); host tier: {host_gib:.2f} GiB per rank = {pages:,} pages = "
                        f"{pages * 4:,} tokens of context")
    assert lines[6] == "  tools: tool call parser hermes, auto tool choice on"


def test_the_summary_names_quantized_weights_and_their_values_on_the_cpu(tiny_model):
    text, _ = summary_for(tiny_model("llama4_q").path, quantization="int4")
    assert ("  weights: int4 (group 128, W4A16, quantized at load), dequantized to the model dtype on the CPU, "
            in text)


def test_a_max_model_len_bound_by_the_cache_says_so(tiny_model):
    text, engine = summary_for(tiny_model("llama3").path, kv_bytes=64 << 10, enable_prefix_caching=False)
    assert engine.max_model_len < 512
    assert (f"  max_model_len: {engine.max_model_len:,} tokens (why: the KV cache ("
            f"{engine.kv.pool.num_usable_blocks} blocks of 4 tokens") in text
    assert "  prefix caching: off; host tier: off" in text
    assert 'tools: no tool call parser (tool_choice "required" and named functions work; "auto" is refused)' in text


def test_serve_logs_the_summary_once_it_listens(tiny_model):
    srv = ServerProcess(str(tiny_model("gemma3").path), "--kv-cache-memory-bytes", str(KV_BYTES), log_level="info")
    with srv:
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(SHUTDOWN_BOUND) == 0
        out = srv.proc.stdout.read()
    summary = out[out.index("hybridkv serve ready at"):]
    assert summary.startswith(f"hybridkv serve ready at http://127.0.0.1:{srv.port}\n  model: ")
    assert "  max_model_len: 512 tokens (why: the model's context" in summary
    assert out.index("hybridkv serve ready") > out.index("Uvicorn running on")  # only once it listens
