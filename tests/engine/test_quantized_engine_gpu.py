"""Quantized weights through the engine on an NVIDIA GPU: a bf16 checkpoint quantized at load (``--quantization
fp8 | int4``) keeps its linears and routed experts quantized there, runs them through the INT4/FP8 kernels inside
CUDA graphs, and generates what the CPU engine generates from the same quantized values (float32, weights
dequantized). Dummy quantized weights (``load_format=dummy``) serve too. Skips cleanly without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from tiny_models import random_prompts  # noqa: E402

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.model.quantization.quantized_layers import is_quantized  # noqa: E402

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def first_logprobs(outputs) -> torch.Tensor:
    return torch.tensor([o.outputs[0].logprobs[0][0][1] for o in outputs])


@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_quantized_at_load_runs_its_kernels_in_graphs_and_agrees_with_the_cpu(tiny_model, quantization):
    model = tiny_model("llama4_q")
    prompts = [{"prompt_token_ids": p} for p in random_prompts([40, 7, 90], seed=5)]
    common = dict(model=str(model.path), quantization=quantization, block_size=16, max_num_batched_tokens=64)
    gpu = LLM(device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20, **common)
    q_proj = gpu.engine.model.layers[0].self_attn.q_proj
    assert is_quantized(q_proj)
    assert q_proj.weight.dtype == (torch.int32 if quantization == "int4" else torch.float8_e4m3fn)
    experts = gpu.engine.model.layers[1].mlp.experts
    assert experts.quantized and experts.gate_up_proj.dtype == q_proj.weight.dtype  # the routed experts too
    eager = LLM(device="cuda", dtype="bfloat16", kv_cache_memory_bytes=64 << 20, enforce_eager=True, **common)
    cpu = LLM(device="cpu", **common)
    got = gpu.generate(prompts, PARAMS, use_tqdm=False)
    assert tokens(got) == tokens(eager.generate(prompts, PARAMS, use_tqdm=False))  # graphs replay the kernels
    want = cpu.generate(prompts, PARAMS, use_tqdm=False)
    # bf16 activations (and FP8's quantized ones) against float32: the first token agrees, and its logprob within
    # 0.15 (on an H100 they differed by up to 0.10: this model's activations are large, init 0.3)
    assert [t[0] for t in tokens(got)] == [t[0] for t in tokens(want)]
    torch.testing.assert_close(first_logprobs(got), first_logprobs(want), atol=0.15, rtol=0)


@pytest.mark.parametrize("quantization", ["int4", "fp8"])
def test_dummy_quantized_weights_serve(tiny_model, tmp_path, quantization):
    config = json.loads((tiny_model("llama4_q").path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(model=str(tmp_path), load_format="dummy", quantization=quantization, device="cuda",
              kv_cache_memory_bytes=64 << 20, skip_tokenizer_init=True)
    linear = llm.engine.model.layers[1].mlp.shared_expert.down_proj
    assert is_quantized(linear) and linear.weight_scale.abs().sum() > 0
    out = llm.generate([{"prompt_token_ids": [3, 4, 5, 6]}], SamplingParams(temperature=0, max_tokens=8,
                                                                            ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
