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
from hybridkv.model.quantization.quantize import quantize_weight  # noqa: E402
from hybridkv.model.quantization.quantized_experts import (  # noqa: E402
    StackedFp8, StackedInt4, quantize_experts_layout, quantized_stack,
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


# each stack's shape kept quantized (4 experts, H 64, I 32; INT4 in groups of 16), and its weights' dtype
KEPT = {
    "int4": ({"gate_up_proj": (4, 64, 8), "gate_up_proj_scale": (4, 64, 4), "down_proj": (4, 64, 4),
              "down_proj_scale": (4, 64, 2)}, torch.int32),
    "fp8": ({"gate_up_proj": (4, 64, 64), "gate_up_proj_scale": (4, 64), "down_proj": (4, 64, 32),
             "down_proj_scale": (4, 64)}, torch.float8_e4m3fn),
}


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM", "FP8_DYNAMIC", "FP8"])
def test_per_expert_checkpoint_kept_quantized_computes_what_the_dequantized_model_does(tmp_path, preset):
    """A checkpoint's experts stored one by one gather into the quantized stacks without being dequantized (FP8:
    channel scales, or FP8's tensor scale held one per row; its static input_scale not read: experts run W8A16),
    dequantize to exactly the weights the dequantizing load fuses, and compute what it computes."""
    fmt = "fp8" if preset.startswith("FP8") else "int4"
    save_compressed(llama4(), preset, tmp_path, group_size=16, split_experts=True)
    config = load_hf_config(tmp_path)
    plain, _ = load_safetensors_model(tmp_path, progress=False)
    packed, _ = load_safetensors_model(tmp_path, progress=False, weights=kept(config))
    experts = packed.layers[1].mlp.experts
    shapes, dtype = KEPT[fmt]
    assert experts.quantized and experts.gate_up_proj.dtype == experts.down_proj.dtype == dtype
    assert {name: tuple(getattr(experts, name).shape) for name in shapes} == shapes
    if fmt == "fp8":
        assert experts.gate_up_proj_scale.dtype == experts.down_proj_scale.dtype == torch.float32
    assert (getattr(experts, "gate_up_proj_zero_point", None) is not None) == preset.endswith("ASYM")
    assert isinstance(quantized_stack(experts, "down_proj"), StackedFp8 if fmt == "fp8" else StackedInt4)
    want = plain.layers[1].mlp.experts
    gate_up, down = experts.stacks(torch.float32)
    assert torch.equal(gate_up, want.gate_up_proj) and torch.equal(down, want.down_proj)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(routed(packed, x), routed(plain, x), atol=1e-5, rtol=0)
    if fmt == "int4":  # (FP8's kept linears quantize their activations, the dequantizing load's do not)
        assert_same_hidden(plain, packed, config, IDS)


def routed(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.layers[1].mlp.routed(x).out


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` compared bit for bit (torch.equal does not take e4m3)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_fp8_experts_hold_the_checkpoints_values(tmp_path):
    """Expert 2's gate rows, then its up rows, each as the checkpoint stores them (FP8's tensor scale held once per
    row)."""
    from safetensors.torch import load_file

    save_compressed(llama4(), "FP8", tmp_path, split_experts=True)
    experts = load_safetensors_model(tmp_path, progress=False, weights=kept(load_hf_config(tmp_path)))[0].layers[1]
    experts = experts.mlp.experts
    stored = load_file(str(tmp_path / "model.safetensors"))
    name = "model.layers.1.feed_forward.experts.2"
    for proj, rows in (("gate_proj", slice(0, 32)), ("up_proj", slice(32, 64))):
        assert torch.equal(bits(experts.gate_up_proj[2, rows]), bits(stored[f"{name}.{proj}.weight"]))
        scale = stored[f"{name}.{proj}.weight_scale"].float().reshape(-1)
        assert scale.numel() == 1 and torch.equal(experts.gate_up_proj_scale[2, rows], scale.expand(32))
    assert torch.equal(bits(experts.down_proj[2]), bits(stored[f"{name}.down_proj.weight"]))


@pytest.mark.parametrize("preset", ["W4A16_ASYM", "FP8_DYNAMIC"])
def test_expert_stacks_split_over_two_ranks(tmp_path, preset):
    """Each rank holds gate_up's gate and up rows and down's input columns (INT4: packed words, group scales and
    zero points; FP8: e4m3 values, with down's scales, one per output channel (H), whole), and the ranks' routed
    outputs sum to the whole model's."""
    fp8 = preset.startswith("FP8")
    save_compressed(llama4(), preset, tmp_path, group_size=8, split_experts=True)
    config = load_hf_config(tmp_path)
    whole, _ = load_safetensors_model(tmp_path, progress=False, weights=kept(config))
    full = whole.layers[1].mlp.experts
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0))
    summed = torch.zeros(6, 64)
    for rank in range(2):
        part, _ = load_safetensors_model(tmp_path, progress=False, tp=TPGroup(rank, 2), weights=kept(config))
        mine = part.layers[1].mlp.experts
        lo, hi = 16 * rank, 16 * rank + 16  # I = 32 split in two
        for suffix in ("", "_scale") + (() if fp8 else ("_zero_point",)):  # gate_up: its gate rows and its up rows
            got, ref = getattr(mine, "gate_up_proj" + suffix), getattr(full, "gate_up_proj" + suffix)
            assert torch.equal(bits(got), bits(torch.cat((ref[:, lo:hi], ref[:, 32 + lo : 32 + hi]), dim=1))), suffix
        cols = slice(lo, hi) if fp8 else slice(2 * rank, 2 * rank + 2)  # INT4: 2 int32 words, 2 groups of 8
        assert torch.equal(bits(mine.down_proj), bits(full.down_proj[:, :, cols]))
        if fp8:
            assert torch.equal(mine.down_proj_scale, full.down_proj_scale)
        else:
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


@pytest.mark.parametrize("fmt", [INT4, FP8], ids=["int4", "fp8"])
def test_bf16_checkpoint_quantizes_its_experts_at_load(tmp_path, fmt):
    hf = llama4(hidden=128, inter=128, dtype=torch.bfloat16)  # every expert's K a multiple of INT4's group 128
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config = load_hf_config(tmp_path)
    packed, _ = load_safetensors_model(tmp_path, progress=False, weights=kept(config, fmt))
    on_cpu, _ = load_safetensors_model(tmp_path, progress=False, weights=WeightPlan.of(config, fmt.name))
    experts = packed.layers[1].mlp.experts
    source = hf.model.layers[1].feed_forward.experts
    for e in range(4):
        for name in ("gate_up_proj", "down_proj"):
            q, scale = quantize_weight(getattr(source, name)[e].detach().t().contiguous(), fmt, torch.bfloat16)
            assert torch.equal(bits(getattr(experts, name)[e]), bits(q))
            assert torch.equal(getattr(experts, f"{name}_scale")[e], scale)
    # the CPU keeps the same values in float32 (the round trip), so both compute alike
    gate_up, down = experts.stacks(torch.float32)
    cpu = on_cpu.layers[1].mlp.experts
    assert cpu.gate_up_proj.dtype == torch.float32
    assert torch.equal(cpu.gate_up_proj, gate_up) and torch.equal(cpu.down_proj, down)
    assert not torch.equal(cpu.down_proj, source.down_proj.float())
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(routed(packed, x), routed(on_cpu, x), atol=1e-5, rtol=0)
    if fmt is INT4:  # (FP8's kept linears quantize their activations, the CPU's round trip does not)
        assert_same_hidden(on_cpu, packed, config, IDS)


@pytest.mark.parametrize("fmt", [INT4, FP8], ids=["int4", "fp8"])
def test_dummy_experts_are_drawn_quantized(fmt):
    """Drawn N(0, 0.02) in bf16 and quantized; placing the bf16 model keeps FP8's e4m3 stacks and float32 scales."""
    config = llama4(hidden=128, inter=128).config.to_dict()
    model = build_model(config, torch.bfloat16, load_format="dummy", weights=fmt)
    experts = model.layers[1].mlp.experts
    assert experts.quantized and experts.gate_up_proj.shape == ((4, 256, 16) if fmt is INT4 else (4, 256, 128))
    w = quantized_stack(experts, "gate_up_proj").dequantized(torch.float32)
    assert 0.015 < w.std() < 0.025 and len(w.unique()) > 100  # N(0, 0.02), every expert and row drawn
    assert w[3, -1].abs().sum() > 0
    if fmt is FP8:  # each row's absolute max is e4m3's largest value, 448
        assert experts.down_proj.dtype == torch.float8_e4m3fn and experts.down_proj_scale.dtype == torch.float32
        assert torch.equal(experts.down_proj.float().abs().amax(-1), torch.full((4, 128), 448.0))
    ids = torch.tensor([1, 2, 3])
    from hybridkv.kv.layer_specs import layer_specs_from_hf_config
    from hybridkv.model.attention.dense import DenseAttention

    attn = DenseAttention(layer_specs_from_hf_config(config, kv_cache_dtype="float32"), [3])
    with torch.no_grad():
        assert torch.isfinite(model(ids, torch.arange(3), attn).float()).all()


# Scout's routed experts of one layer at TP 1 and 2: int4 (group 128, without and with zero points) and fp8; bytes
# of the three [5120, 8192 / tp]-sized projections of 16 experts: INT4 a half byte a weight and, per 128 inputs, a
# bf16 scale (and an int8 zero point); FP8 a byte a weight and a float32 scale per output channel (2 x 8192 / tp
# gate and up rows, 5120 down rows)
EXPERT_BYTES = {
    ("int4", 1): 16 * (3 * 5120 * 8192 // 2 + 3 * 5120 * 64 * 2),
    ("int4", 2): 16 * (3 * 5120 * 4096 // 2 + 3 * 5120 * 32 * 2),
    ("int4 zero points", 1): 16 * (3 * 5120 * 8192 // 2 + 3 * 5120 * 64 * 3),
    ("int4 zero points", 2): 16 * (3 * 5120 * 4096 // 2 + 3 * 5120 * 32 * 3),
    ("fp8", 1): 16 * (3 * 5120 * 8192 + 4 * (2 * 8192 + 5120)),
    ("fp8", 2): 16 * (3 * 5120 * 4096 + 4 * (2 * 4096 + 5120)),
}


@pytest.mark.parametrize("name,tp", list(EXPERT_BYTES))
def test_engine_bytes_of_quantized_experts_are_the_planners(name, tp):
    """Scout's routed experts of one layer (16 x [5120 -> 8192 x 2 -> 5120]), as the engine allocates them and as
    ``hybridkv plan`` counts them (per expert linear, scales included): the same bytes."""
    config = {"model_type": "llama4_text", "num_hidden_layers": 1, "hidden_size": 5120, "num_attention_heads": 40,
              "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 8192, "num_local_experts": 16,
              "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "vocab_size": 1000}
    fmt = {"int4": INT4, "int4 zero points": replace(INT4, zero_points=True), "fp8": FP8}[name]
    with torch.device("meta"):
        experts = Experts(16, 5120, 8192, torch.bfloat16, TPGroup(0, tp))
        quantize_experts_layout(experts, fmt)
    engine = sum(p.numel() * p.element_size() for p in experts.parameters())
    planned = sum(_linear_bytes(linear, fmt, tp, 2) for linear in rank_linears(config, tp)
                  if ".experts." in linear.name)
    assert engine == planned == EXPERT_BYTES[name, tp]
