"""A MoE's routed experts kept in INT4 or FP8 (``quantization/quantized_experts.py``), on the CPU through the
reference path (each stack dequantized, then the float MoE):

- a compressed-tensors W4A16 or FP8 checkpoint storing experts one by one (llm-compressor's layout) loads into the
  stacked quantized tensors, holding exactly the checkpoint's values, and computes what the dequantized model
  computes;
- split over two tensor-parallel ranks, each rank holds its rows of gate/up and columns of down (packed words,
  scales, zero points), and the ranks' routed outputs sum to the whole model's;
- a bf16 checkpoint quantized at load (``--quantization int4 | fp8``) holds the quantizer's values per expert, and
  the CPU's round trip computes with the same values;
- dummy weights are drawn quantized, and the bytes the engine allocates are the planner's.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")
import compressed_tensors  # noqa: E402,F401  (a test dependency: the format library itself)

from test_quantized_checkpoints import assert_same_hidden, kept, save_compressed  # noqa: E402

from hybridkv.kv.planner import _linear_bytes, rank_linears  # noqa: E402
from hybridkv.kv.weight_formats import FP8, INT4  # noqa: E402
from hybridkv.model.architectures.llama import Experts  # noqa: E402
from hybridkv.model.architectures.parallel import TPGroup  # noqa: E402
from hybridkv.model.factory import build_model  # noqa: E402
from hybridkv.model.loading.hf_config import load_hf_config  # noqa: E402
from hybridkv.model.loading.weights import load_safetensors_model  # noqa: E402
from hybridkv.model.quantization.quantize import quantize_fp8, quantize_int4  # noqa: E402
from hybridkv.model.quantization.quantized_experts import (  # noqa: E402
    StackedFp8, quantize_experts_layout, quantized_stack,
)
from hybridkv.model.quantization.weight_plan import WeightPlan  # noqa: E402

VOCAB = 128


def llama4(hidden: int = 64, inter: int = 32, dtype=torch.float32):
    """Two layers, the second a MoE of 4 experts, top-2 (so a token's choices are summed)."""
    config = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter, intermediate_size_mlp=2 * hidden,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
        attention_chunk_size=8, no_rope_layer_interval=2, interleave_moe_layer_step=2, num_local_experts=4,
        num_experts_per_tok=2, initializer_range=0.2, attn_implementation="eager")
    torch.manual_seed(2)
    return transformers.Llama4ForCausalLM(config).eval().to(dtype)


IDS = torch.tensor([5, 17, 3, 99, 42, 7, 64, 1, 30])


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM"])
def test_per_expert_checkpoint_kept_quantized_computes_what_the_dequantized_model_does(tmp_path, preset):
    save_compressed(llama4(), preset, tmp_path, group_size=16, split_experts=True)
    config = load_hf_config(tmp_path)
    plain, _ = load_safetensors_model(tmp_path, progress=False)
    packed, _ = load_safetensors_model(tmp_path, progress=False, weights=kept(config))
    experts = packed.layers[1].mlp.experts
    assert experts.quantized and experts.gate_up_proj.dtype == torch.int32
    assert experts.gate_up_proj.shape == (4, 64, 8) and experts.down_proj.shape == (4, 64, 4)
    assert experts.gate_up_proj_scale.shape == (4, 64, 4) and experts.down_proj_scale.shape == (4, 64, 2)
    assert (getattr(experts, "gate_up_proj_zero_point", None) is not None) == preset.endswith("ASYM")
    # the stacks dequantize to exactly the weights the dequantizing load fuses
    want = plain.layers[1].mlp.experts
    gate_up, down = experts.stacks(torch.float32)
    assert torch.equal(gate_up, want.gate_up_proj) and torch.equal(down, want.down_proj)
    assert_same_hidden(plain, packed, config, IDS)


def test_expert_stacks_split_over_two_ranks(tmp_path):
    save_compressed(llama4(), "W4A16_ASYM", tmp_path, group_size=8, split_experts=True)
    config = load_hf_config(tmp_path)
    whole, _ = load_safetensors_model(tmp_path, progress=False, weights=kept(config))
    full = whole.layers[1].mlp.experts
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    summed = torch.zeros(6, 64)
    for rank in range(2):
        part, _ = load_safetensors_model(tmp_path, progress=False, tp=TPGroup(rank, 2), weights=kept(config))
        mine = part.layers[1].mlp.experts
        lo, hi = 16 * rank, 16 * rank + 16  # I = 32 split in two
        for suffix in ("", "_scale", "_zero_point"):  # gate_up: its gate rows and its up rows
            got, ref = getattr(mine, "gate_up_proj" + suffix), getattr(full, "gate_up_proj" + suffix)
            assert torch.equal(got, torch.cat((ref[:, lo:hi], ref[:, 32 + lo : 32 + hi]), dim=1)), suffix
        cols = slice(2 * rank, 2 * rank + 2)  # 16 inputs a rank: 2 int32 words, 2 groups of 8
        assert torch.equal(mine.down_proj, full.down_proj[:, :, cols])
        assert torch.equal(mine.down_proj_scale, full.down_proj_scale[:, :, cols])
        assert torch.equal(mine.down_proj_zero_point, full.down_proj_zero_point[:, :, cols])
        with torch.no_grad():
            summed += part.layers[1].mlp.routed(x).out  # the ranks' partial outputs, before the all-reduce
    with torch.no_grad():
        torch.testing.assert_close(summed, whole.layers[1].mlp.routed(x).out, atol=1e-5, rtol=0)


def test_a_group_that_spans_two_ranks_is_refused(tmp_path):
    save_compressed(llama4(), "W4A16", tmp_path, group_size=32, split_experts=True)  # I = 16 a rank
    with pytest.raises(ValueError, match="not a multiple of the quantization group 32"):
        load_safetensors_model(tmp_path, progress=False, tp=TPGroup(0, 2), weights=kept(load_hf_config(tmp_path)))


def test_bf16_checkpoint_quantizes_its_experts_at_load(tmp_path):
    hf = llama4(hidden=128, inter=128, dtype=torch.bfloat16)  # every expert's K a multiple of INT4's group 128
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config = load_hf_config(tmp_path)
    packed, _ = load_safetensors_model(tmp_path, progress=False, weights=kept(config, INT4))
    on_cpu, _ = load_safetensors_model(tmp_path, progress=False, weights=WeightPlan.of(config, "int4"))
    experts = packed.layers[1].mlp.experts
    source = hf.model.layers[1].feed_forward.experts
    for e in range(4):
        for name in ("gate_up_proj", "down_proj"):
            q, scale = quantize_int4(getattr(source, name)[e].detach().t().contiguous(), 128, torch.bfloat16)
            assert torch.equal(getattr(experts, name)[e], q) and torch.equal(getattr(experts, f"{name}_scale")[e], scale)
    # the CPU keeps the same values in float32 (the round trip), so both compute alike
    gate_up, down = experts.stacks(torch.float32)
    cpu = on_cpu.layers[1].mlp.experts
    assert torch.equal(cpu.gate_up_proj, gate_up) and torch.equal(cpu.down_proj, down)
    assert not torch.equal(cpu.down_proj, source.down_proj.float())
    assert_same_hidden(on_cpu, packed, config, IDS)


def test_dummy_experts_are_drawn_quantized():
    config = llama4(hidden=128, inter=128).config.to_dict()
    model = build_model(config, torch.bfloat16, load_format="dummy", weights=INT4)
    experts = model.layers[1].mlp.experts
    assert experts.quantized and experts.gate_up_proj.shape == (4, 256, 16)
    w = quantized_stack(experts, "gate_up_proj").dequantized(torch.float32)
    assert 0.015 < w.std() < 0.025 and len(w.unique()) > 100  # N(0, 0.02), every expert and row drawn
    assert w[3, -1].abs().sum() > 0
    ids = torch.tensor([1, 2, 3])
    from hybridkv.kv.layer_specs import layer_specs_from_hf_config
    from hybridkv.model.attention.dense import DenseAttention

    attn = DenseAttention(layer_specs_from_hf_config(config, kv_cache_dtype="float32"), [3])
    with torch.no_grad():
        assert torch.isfinite(model(ids, torch.arange(3), attn).float()).all()


@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("tp", [1, 2])
def test_engine_bytes_of_int4_experts_are_the_planners(tp, zero_points):
    """Scout's routed experts of one layer (16 x [5120 -> 8192 x 2 -> 5120]), as the engine allocates them and as
    ``hybridkv plan`` counts them (per expert linear, scales included): the same bytes."""
    config = {"model_type": "llama4_text", "num_hidden_layers": 1, "hidden_size": 5120, "num_attention_heads": 40,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "num_local_experts": 16,
              "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "vocab_size": 1000}
    fmt = replace(INT4, zero_points=zero_points)
    with torch.device("meta"):
        experts = Experts(16, 5120, 8192, torch.bfloat16, TPGroup(0, tp))
        quantize_experts_layout(experts, fmt)
    engine = sum(p.numel() * p.element_size() for p in experts.parameters())
    planned = sum(_linear_bytes(linear, fmt, tp, 2) for linear in rank_linears(config, tp)
                  if ".experts." in linear.name)
    groups = 3 * 5120 * 64 // tp  # of the three [5120, 8192 / tp]-sized projections, in groups of 128
    assert engine == planned == 16 * (3 * 5120 * 8192 // tp // 2 + groups * (2 + zero_points))


# ---- FP8 experts (W8A16): e4m3 [E, N, K] stacks, a float32 scale per output channel [E, N] ----------------------
def routed(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.layers[1].mlp.routed(x).out


@pytest.mark.parametrize("preset", ["FP8_DYNAMIC", "FP8"])
def test_per_expert_fp8_checkpoint_kept_quantized_holds_its_values(tmp_path, preset):
    """An FP8 checkpoint's experts (FP8_DYNAMIC: channel scales; FP8: a tensor scale and a static input_scale, which
    experts do not read) gather into e4m3 stacks without being dequantized, and compute what the dequantizing
    load's fused experts compute."""
    save_compressed(llama4(), preset, tmp_path, split_experts=True)
    config = load_hf_config(tmp_path)
    plain, _ = load_safetensors_model(tmp_path, progress=False)
    packed, _ = load_safetensors_model(tmp_path, progress=False, weights=kept(config))
    experts = packed.layers[1].mlp.experts
    assert experts.quantized and experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert experts.gate_up_proj.shape == (4, 64, 64) and experts.down_proj.shape == (4, 64, 32)
    assert experts.gate_up_proj_scale.dtype == torch.float32
    assert experts.gate_up_proj_scale.shape == (4, 64) and experts.down_proj_scale.shape == (4, 64)
    assert not hasattr(experts, "gate_up_proj_zero_point") and not hasattr(experts, "gate_up_proj_input_scale")
    assert isinstance(quantized_stack(experts, "down_proj"), StackedFp8)
    want = plain.layers[1].mlp.experts
    gate_up, down = experts.stacks(torch.float32)
    assert torch.equal(gate_up, want.gate_up_proj) and torch.equal(down, want.down_proj)
    # expert 2's gate rows then up rows, each as the checkpoint stores them
    from safetensors.torch import load_file

    stored = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.feed_forward.experts.2"
    assert torch.equal(experts.gate_up_proj[2, :32].view(torch.uint8),
                       stored[f"{name}.gate_proj.weight"].view(torch.uint8))
    scale = stored[f"{name}.up_proj.weight_scale"].float().reshape(-1)  # FP8: one per tensor, held one per row
    assert torch.equal(experts.gate_up_proj_scale[2, 32:], scale.expand(32))
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(routed(packed, x), routed(plain, x), atol=1e-5, rtol=0)


def test_fp8_expert_stacks_split_over_two_ranks(tmp_path):
    """gate_up's gate and up rows and down's input columns split; down's scales (per output channel, H) whole."""
    save_compressed(llama4(), "FP8_DYNAMIC", tmp_path, split_experts=True)
    config = load_hf_config(tmp_path)
    whole, _ = load_safetensors_model(tmp_path, progress=False, weights=kept(config))
    full = whole.layers[1].mlp.experts
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    summed = torch.zeros(6, 64)
    for rank in range(2):
        part, _ = load_safetensors_model(tmp_path, progress=False, tp=TPGroup(rank, 2), weights=kept(config))
        mine = part.layers[1].mlp.experts
        lo, hi = 16 * rank, 16 * rank + 16  # I = 32 split in two
        for suffix in ("", "_scale"):
            got, ref = getattr(mine, "gate_up_proj" + suffix), getattr(full, "gate_up_proj" + suffix)
            want = torch.cat((ref[:, lo:hi], ref[:, 32 + lo : 32 + hi]), dim=1)
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), suffix
        assert torch.equal(mine.down_proj.view(torch.uint8), full.down_proj[:, :, lo:hi].view(torch.uint8))
        assert torch.equal(mine.down_proj_scale, full.down_proj_scale)
        summed += routed(part, x)  # the ranks' partial outputs, before the all-reduce
    torch.testing.assert_close(summed, routed(whole, x), atol=1e-5, rtol=0)


def test_bf16_checkpoint_quantizes_its_experts_to_fp8_at_load(tmp_path):
    hf = llama4(dtype=torch.bfloat16)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config = load_hf_config(tmp_path)
    packed, _ = load_safetensors_model(tmp_path, progress=False, weights=kept(config, FP8))
    on_cpu, _ = load_safetensors_model(tmp_path, progress=False, weights=WeightPlan.of(config, "fp8"))
    experts = packed.layers[1].mlp.experts
    source = hf.model.layers[1].feed_forward.experts
    for e in range(4):
        for name in ("gate_up_proj", "down_proj"):
            q, scale = quantize_fp8(getattr(source, name)[e].detach().t().contiguous())
            assert torch.equal(getattr(experts, name)[e].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(getattr(experts, f"{name}_scale")[e], scale)
    # the CPU keeps the same values in float32 (the round trip), so both compute alike
    gate_up, down = experts.stacks(torch.float32)
    cpu = on_cpu.layers[1].mlp.experts
    assert cpu.gate_up_proj.dtype == torch.float32
    assert torch.equal(cpu.gate_up_proj, gate_up) and torch.equal(cpu.down_proj, down)
    assert not torch.equal(cpu.down_proj, source.down_proj.float())
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(routed(packed, x), routed(on_cpu, x), atol=1e-5, rtol=0)


def test_dummy_fp8_experts_are_drawn_quantized_and_keep_their_dtypes():
    """Drawn N(0, 0.02) and quantized; placing the bf16 model keeps the e4m3 stacks and their float32 scales."""
    config = llama4(hidden=128, inter=128).config.to_dict()
    model = build_model(config, torch.bfloat16, load_format="dummy", weights=FP8)
    experts = model.layers[1].mlp.experts
    assert experts.quantized and experts.gate_up_proj.shape == (4, 256, 128)
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn and experts.down_proj_scale.dtype == torch.float32
    w = quantized_stack(experts, "gate_up_proj").dequantized(torch.float32)
    assert 0.015 < w.std() < 0.025 and len(w.unique()) > 100
    assert w[3, -1].abs().sum() > 0
    # each row's absolute max is e4m3's largest value, 448
    assert torch.equal(experts.down_proj.float().abs().amax(-1), torch.full((4, 128), 448.0))
    with torch.no_grad():
        assert torch.isfinite(model.layers[1].mlp.routed(torch.randn(3, 128, dtype=torch.bfloat16)).out).all()


@pytest.mark.parametrize("tp", [1, 2])
def test_engine_bytes_of_fp8_experts_are_the_planners(tp):
    """Scout's routed experts of one layer in FP8: 1 byte a weight and a float32 scale per output channel, as the
    engine allocates them and as ``hybridkv plan`` counts them."""
    config = {"model_type": "llama4_text", "num_hidden_layers": 1, "hidden_size": 5120, "num_attention_heads": 40,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "num_local_experts": 16,
              "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "vocab_size": 1000}
    with torch.device("meta"):
        experts = Experts(16, 5120, 8192, torch.bfloat16, TPGroup(0, tp))
        quantize_experts_layout(experts, FP8)
    engine = sum(p.numel() * p.element_size() for p in experts.parameters())
    planned = sum(_linear_bytes(linear, FP8, tp, 2) for linear in rank_linears(config, tp)
                  if ".experts." in linear.name)
    channels = 2 * 8192 // tp + 5120  # gate and up rows, then down's
    assert engine == planned == 16 * (3 * 5120 * 8192 // tp + 4 * channels)
