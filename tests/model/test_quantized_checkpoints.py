"""Quantized checkpoints load exactly: tiny compressed-tensors (FP8 dynamic and static, W4A16 symmetric and
asymmetric) and AWQ checkpoints are built here from transformers models with the format's own library (AWQ with
AutoAWQ's published packing), then

- the weights hybridkv dequantizes equal compressed-tensors' own decompression, bit for bit;
- greedy generation equals transformers running the same dequantized weights in float32 (CPU);
- quantized linears kept quantized (as on a GPU; here through their reference GEMM) compute what the dequantized
  model computes, whole and split over two tensor-parallel ranks;
- a bf16 checkpoint quantized at load (``--quantization fp8 | int4``) holds the values the quantizers give.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")
import compressed_tensors  # noqa: E402,F401  (a test dependency: the format library itself)

from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor  # noqa: E402
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor  # noqa: E402
from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

from hybridkv.kv.weight_formats import FP8, INT4, WeightFormat, checkpoint_format, weight_format  # noqa: E402
from hybridkv.model.architectures.parallel import TPGroup  # noqa: E402
from hybridkv.model.loading.hf_config import load_hf_config  # noqa: E402
from hybridkv.model.loading.weights import load_safetensors_model  # noqa: E402
from hybridkv.model.quantization.checkpoint import AWQ_NIBBLE  # noqa: E402
from hybridkv.kernels.quant_gemm import dequantize_int4  # noqa: E402
from hybridkv.model.quantization.quantize import quantize_fp8, quantize_int4  # noqa: E402
from hybridkv.model.quantization.quantized_layers import is_quantized  # noqa: E402
from hybridkv.model.quantization.weight_plan import WeightPlan  # noqa: E402

VOCAB = 128
PRESETS = ("W4A16", "W4A16_ASYM", "FP8_DYNAMIC", "FP8")


def tiny_llama(hidden: int = 64):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256, initializer_range=0.2,
        attn_implementation="eager")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def tiny_llama4():
    config = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        attention_chunk_size=8, no_rope_layer_interval=2, interleave_moe_layer_step=2, num_local_experts=4,
        num_experts_per_tok=1, initializer_range=0.2, attn_implementation="eager")
    torch.manual_seed(1)
    return transformers.Llama4ForCausalLM(config).eval()


def scheme(preset: str, group_size: int):
    s = preset_name_to_scheme(preset, ["Linear"])
    if s.weights.strategy == "group":
        s.weights.group_size = group_size
    return s


def qparams(weight: torch.Tensor, s) -> tuple[torch.Tensor, torch.Tensor]:
    """The scales (and zero points) a min-max observer gives, by compressed-tensors' own formula."""
    w = weight.float()
    args = s.weights
    if args.strategy == "group":
        w = w.view(w.shape[0], -1, args.group_size)
        return calculate_qparams(w.amin(-1), w.amax(-1), args)
    if args.strategy == "channel":
        return calculate_qparams(w.amin(-1, keepdim=True), w.amax(-1, keepdim=True), args)
    return calculate_qparams(w.amin().reshape(1), w.amax().reshape(1), args)


def compressor(s):
    return PackedQuantizationCompressor if s.weights.type == "int" else FloatQuantizationCompressor


def compress_linear(weight: torch.Tensor, s) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the checkpoint's tensors of one linear, compressed-tensors' own decompression of them in float32)."""
    w = weight.to(torch.bfloat16)
    scale, zero = qparams(w, s)
    parts = {"weight": w, "weight_scale": scale.to(torch.bfloat16), "weight_zero_point": zero}
    if s.input_activations is not None and not s.input_activations.dynamic:
        parts["input_scale"] = torch.tensor([0.05])
    stored = compressor(s).compress(parts, s)
    back = dict(stored)
    back["weight_scale"] = back["weight_scale"].float()  # decompressed in float32: every product exact
    if "weight_zero_point" in parts and "weight_zero_point" not in back:
        back["weight_zero_point"] = zero
    return stored, compressor(s).decompress(back, s)["weight"].float()


def is_quantized_name(name: str) -> bool:
    return name.endswith("_proj.weight") and "embed" not in name


def save_compressed(hf, preset: str, path, group_size: int = 32, split_experts: bool = False):
    """``hf`` saved as a compressed-tensors checkpoint; returns {weight name: decompressed float32 weight}."""
    s = scheme(preset, group_size)
    tensors, dequantized = {}, {}
    for name, tensor in _linear_weights(hf, split_experts):
        if is_quantized_name(name):
            stored, dequantized[name] = compress_linear(tensor, s)
            tensors.update({f"{name[: -len('.weight')]}.{k}": v.contiguous() for k, v in stored.items()})
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    fmt = "pack-quantized" if s.weights.type == "int" else "float-quantized"
    qc = QuantizationConfig(config_groups={"group_0": s}, format=fmt, ignore=["lm_head"]).model_dump(mode="json")
    config = hf.config.to_dict() | {"quantization_config": qc}
    (path / "config.json").write_text(json.dumps(config))
    return dequantized


def _linear_weights(hf, split_experts: bool):
    """(name, tensor) of the checkpoint; Llama-4's fused experts split one linear per expert, as llm-compressor
    stores them."""
    for name, tensor in hf.state_dict().items():
        if split_experts and name.endswith("experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], tensor.shape[-1] // 2
            for e in range(tensor.shape[0]):
                yield f"{base}{e}.gate_proj.weight", tensor[e, :, :inter].t()
                yield f"{base}{e}.up_proj.weight", tensor[e, :, inter:].t()
        elif split_experts and name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                yield f"{base}{e}.down_proj.weight", tensor[e].t()
        else:
            yield name, tensor


def with_weights(hf, dequantized: dict[str, torch.Tensor]):
    """``hf`` with its linears set to ``dequantized`` (per-expert weights fused back)."""
    state = hf.state_dict()
    for name, w in dequantized.items():
        if ".experts." in name:
            base, e, proj = name.rsplit(".", 3)[0], int(name.rsplit(".", 3)[1]), name.rsplit(".", 3)[2]
            inter = state[f"{base}.down_proj"].shape[1]
            if proj == "gate_proj":
                state[f"{base}.gate_up_proj"][e, :, :inter] = w.t()
            elif proj == "up_proj":
                state[f"{base}.gate_up_proj"][e, :, inter:] = w.t()
            else:
                state[f"{base}.down_proj"][e] = w.t()
        else:
            state[name] = w
    hf.load_state_dict(state)
    return hf


def our_weight(model, hf_name: str) -> torch.Tensor:
    name = hf_name.removeprefix("model.").replace(".feed_forward.", ".mlp.")
    return dict(model.named_parameters())[name].detach()


@torch.no_grad()
def greedy(model, prompt: list[int], steps: int) -> list[int]:
    from hybridkv.kv.layer_specs import layer_specs_from_hf_config
    from hybridkv.model.attention.dense import DenseAttention

    ids = list(prompt)
    for _ in range(steps):
        attn = DenseAttention(layer_specs_from_hf_config(model.hf_config, kv_cache_dtype="float32"), [len(ids)])
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), attn)
        ids.append(int(model.compute_logits(hidden[-1:]).argmax()))
    return ids[len(prompt):]


@torch.no_grad()
def hf_greedy(hf, prompt: list[int], steps: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("preset", PRESETS)
def test_compressed_tensors_weights_dequantize_bit_for_bit_and_generate_like_transformers(tmp_path, preset):
    hf = tiny_llama()
    dequantized = save_compressed(hf, preset, tmp_path)
    fmt = checkpoint_format(load_hf_config(tmp_path))
    assert fmt.source == "compressed-tensors" and fmt.quantized
    assert fmt.zero_points == preset.endswith("ASYM")
    ours, config = load_safetensors_model(tmp_path, progress=False)
    for name, want in dequantized.items():
        assert torch.equal(our_weight(ours, name), want), name
    ours.hf_config = config
    prompt = [5, 17, 3, 99, 42, 7]
    assert greedy(ours, prompt, 8) == hf_greedy(with_weights(hf, dequantized), prompt, 8)


def test_int4_dequantized_in_bf16_equals_the_library_in_bf16():
    s = scheme("W4A16_ASYM", 32)
    w = torch.randn(48, 128) * 0.1
    stored, _ = compress_linear(w, s)
    scale, zero = qparams(w.to(torch.bfloat16), s)
    want = PackedQuantizationCompressor.decompress(stored, s)["weight"]  # its zero points as it packed them
    ours = dequantize_int4(stored["weight_packed"], scale.to(torch.bfloat16), zero, 32, torch.bfloat16)
    assert want.dtype == torch.bfloat16 and torch.equal(ours, want)


def test_llama4_experts_stored_one_by_one_load_fused(tmp_path):
    hf = tiny_llama4()
    dequantized = save_compressed(hf, "W4A16", tmp_path, split_experts=True)
    ours, config = load_safetensors_model(tmp_path, progress=False)
    reference = with_weights(hf, dequantized)
    fused = dict(reference.state_dict())
    moe = "model.layers.1.feed_forward.experts."
    assert torch.equal(our_weight(ours, moe + "gate_up_proj"), fused[moe + "gate_up_proj"])
    assert torch.equal(our_weight(ours, moe + "down_proj"), fused[moe + "down_proj"])
    ours.hf_config = config
    prompt = [3, 8, 1, 60, 9, 12, 70, 2, 31]
    assert greedy(ours, prompt, 6) == hf_greedy(reference, prompt, 6)


# ---- AWQ ----------------------------------------------------------------------------------------------------
def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing of unsigned 4-bit [R, C] along C: column 8 j + order[i] in nibble i of word j."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for j in range(packed.shape[1]):
        for i in range(8):
            packed[:, j] |= values[:, 8 * j + order[i]].to(torch.int32) << (4 * i)
    return packed


def test_awq_nibble_order_inverts_autoawqs():
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    assert [order.index(k) for k in range(8)] == list(AWQ_NIBBLE)


def save_awq(hf, path, group: int = 32) -> dict[str, torch.Tensor]:
    """``hf`` as an AWQ (GEMM) checkpoint; returns the float32 weights it holds, by AWQ's formula."""
    tensors, dequantized = {}, {}
    gen = torch.Generator().manual_seed(3)
    for name, tensor in hf.state_dict().items():
        if not is_quantized_name(name):
            tensors[name] = tensor.to(torch.float16)
            continue
        rows, cols = tensor.shape
        q = torch.randint(0, 16, (cols, rows), generator=gen)  # [K, N], AWQ's transposed layout
        zeros = torch.randint(0, 16, (cols // group, rows), generator=gen)
        scales = (torch.rand(cols // group, rows, generator=gen) * 0.02 + 0.01).to(torch.float16)
        prefix = name[: -len(".weight")]
        tensors |= {f"{prefix}.qweight": awq_pack(q), f"{prefix}.qzeros": awq_pack(zeros), f"{prefix}.scales": scales}
        w = (q - zeros.repeat_interleave(group, 0)) * scales.float().repeat_interleave(group, 0)
        dequantized[name] = w.t().contiguous()
    save_file(tensors, str(path / "model.safetensors"))
    qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    (path / "config.json").write_text(json.dumps(hf.config.to_dict() | {"quantization_config": qc}))
    return dequantized


def test_awq_checkpoint_loads_its_weights_exactly(tmp_path):
    hf = tiny_llama()
    dequantized = save_awq(hf, tmp_path)
    ours, config = load_safetensors_model(tmp_path, progress=False)
    for name, want in dequantized.items():
        assert torch.equal(our_weight(ours, name), want), name
    ours.hf_config = config
    # the reference: float32 transformers with the AWQ weights (its other tensors were saved as fp16: round them so)
    reference = with_weights(hf, dequantized)
    state = reference.state_dict()
    reference.load_state_dict({k: v if k in dequantized else v.half().float() for k, v in state.items()})
    prompt = [1, 2, 3, 4, 5]
    assert greedy(ours, prompt, 6) == hf_greedy(reference, prompt, 6)


# ---- kept quantized (a GPU's layout), through the reference GEMM on the CPU -----------------------------------
def kept(config, served: WeightFormat | None = None) -> WeightPlan:
    own = checkpoint_format(config)
    return WeightPlan(served or own, own, keep=True)


@pytest.mark.parametrize("preset", ["W4A16", "W4A16_ASYM"])
def test_int4_kept_quantized_computes_what_the_dequantized_model_does(tmp_path, preset):
    hf = tiny_llama()
    save_compressed(hf, preset, tmp_path)
    config = load_hf_config(tmp_path)
    plain, _ = load_safetensors_model(tmp_path, progress=False)
    packed, _ = load_safetensors_model(tmp_path, progress=False, weights=kept(config))
    q_proj = packed.layers[0].self_attn.q_proj
    assert is_quantized(q_proj) and q_proj.weight.dtype == torch.int32 and q_proj.weight.shape == (64, 8)
    ids = torch.tensor([5, 17, 3, 99, 42, 7])
    assert_same_hidden(plain, packed, config, ids)


def assert_same_hidden(plain, packed, config, ids, atol: float = 1e-5) -> None:
    from hybridkv.kv.layer_specs import layer_specs_from_hf_config
    from hybridkv.model.architectures.parallel import fuse_columns
    from hybridkv.model.attention.dense import DenseAttention

    def run(model):
        attn = DenseAttention(layer_specs_from_hf_config(config, kv_cache_dtype="float32"), [len(ids)])
        return model(ids, torch.arange(len(ids)), attn)

    with torch.no_grad():
        want = run(plain)
        got = run(packed)
        fuse_columns(packed)  # q/k/v and gate/up joined: their packed weights, scales and zero points too
        fused = run(packed)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    torch.testing.assert_close(fused, got, atol=atol, rtol=0)


def test_int4_shards_over_two_ranks_hold_their_columns_and_rows(tmp_path):
    hf = tiny_llama()
    save_compressed(hf, "W4A16_ASYM", tmp_path, group_size=16)
    config = load_hf_config(tmp_path)
    whole, _ = load_safetensors_model(tmp_path, progress=False, weights=kept(config))
    for rank in range(2):
        part, _ = load_safetensors_model(tmp_path, progress=False, tp=TPGroup(rank, 2), weights=kept(config))
        for name in ("self_attn.o_proj", "mlp.down_proj"):  # row-parallel: input columns split
            mine, full = part.get_submodule(f"layers.0.{name}"), whole.get_submodule(f"layers.0.{name}")
            cols = full.weight.shape[1] // 2
            assert torch.equal(mine.weight, full.weight[:, rank * cols : (rank + 1) * cols])
            groups = full.weight_scale.shape[1] // 2
            assert torch.equal(mine.weight_zero_point, full.weight_zero_point[:, rank * groups : (rank + 1) * groups])
        mine, full = part.layers[0].mlp.gate_proj, whole.layers[0].mlp.gate_proj  # column-parallel: rows split
        rows = full.weight.shape[0] // 2
        assert torch.equal(mine.weight_scale, full.weight_scale[rank * rows : (rank + 1) * rows])


def test_fp8_kept_quantized_matches_dequantized_weights_with_quantized_activations(tmp_path):
    from hybridkv.model.quantization.quantize import fake_quantize_fp8

    hf = tiny_llama()
    save_compressed(hf, "FP8_DYNAMIC", tmp_path)
    config = load_hf_config(tmp_path)
    plain, _ = load_safetensors_model(tmp_path, progress=False)
    packed, _ = load_safetensors_model(tmp_path, progress=False, weights=kept(config))
    linear = packed.layers[0].mlp.down_proj
    assert linear.weight.dtype == torch.float8_e4m3fn and linear.weight_scale.shape == (64,)
    x = torch.randn(5, 128)
    want = torch.nn.functional.linear(fake_quantize_fp8(x), plain.layers[0].mlp.down_proj.weight)
    torch.testing.assert_close(linear(x), want, atol=1e-5, rtol=0)
    assert not torch.allclose(linear(x), torch.nn.functional.linear(x, plain.layers[0].mlp.down_proj.weight),
                              atol=1e-4, rtol=0)  # the activations are quantized, not only the weights


# ---- quantized at load ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("quantization", ["fp8", "int4"])
def test_bf16_checkpoint_quantized_at_load(tmp_path, quantization):
    hf = tiny_llama(hidden=128).to(torch.bfloat16)  # every linear's inputs a multiple of INT4's group, 128
    hf.save_pretrained(tmp_path, safe_serialization=True)
    config = load_hf_config(tmp_path)
    served = weight_format(config, quantization)
    w = hf.model.layers[1].self_attn.k_proj.weight.detach()
    on_cpu, _ = load_safetensors_model(tmp_path, progress=False, weights=WeightPlan.of(config, quantization))
    packed, _ = load_safetensors_model(tmp_path, progress=False, weights=kept(config, served))
    linear = packed.layers[1].self_attn.k_proj
    if quantization == "fp8":
        q, scale = quantize_fp8(w)
        assert torch.equal(linear.weight.view(torch.uint8), q.view(torch.uint8))
        want = q.float() * scale[:, None]
    else:
        q, scale = quantize_int4(w, INT4.group_size, torch.bfloat16)
        assert torch.equal(linear.weight, q)
        want = dequantize_int4(q, scale, None, INT4.group_size, torch.float32)
    assert torch.equal(linear.weight_scale.float(), scale.float())
    # the CPU keeps the same values in float32 (the round trip), and the layers' names and the rest unchanged
    assert torch.equal(on_cpu.layers[1].self_attn.k_proj.weight, want)
    assert torch.equal(on_cpu.embed_tokens.weight, hf.model.embed_tokens.weight.float())
    assert not torch.equal(want, w.float())


def test_quantization_flags_name_their_limits():
    with pytest.raises(ValueError, match="needs a checkpoint in that format"):
        weight_format({"model_type": "llama"}, "awq")
    with pytest.raises(ValueError, match="unknown quantization 'gptq4'"):
        weight_format({}, "gptq4")
    awq = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}}
    with pytest.raises(ValueError, match="does not match the checkpoint's own"):
        weight_format(awq, "fp8")
    with pytest.raises(ValueError, match="not a multiple of the quantization group 128"):
        quantize_int4(torch.zeros(4, 96), 128, torch.bfloat16)


def test_int4_group_must_not_span_two_ranks(tmp_path):
    hf = tiny_llama(hidden=128)
    save_compressed(hf, "W4A16", tmp_path, group_size=128)  # o_proj: 128 inputs, 64 per rank
    config = load_hf_config(tmp_path)
    with pytest.raises(ValueError, match="not a multiple of the quantization group"):
        load_safetensors_model(tmp_path, progress=False, tp=TPGroup(0, 2), weights=kept(config))



def moe_config() -> dict:
    return transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, intermediate_size_mlp=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, interleave_moe_layer_step=2, num_local_experts=4,
        num_experts_per_tok=1).to_dict()


@pytest.mark.parametrize("fmt", [FP8, INT4, replace(INT4, group_size=32, zero_points=True)])
@pytest.mark.parametrize("moe", [False, True])
def test_the_planner_counts_the_bytes_a_quantized_model_holds(fmt, moe):
    """FP8 keeps a MoE's routed experts in the model dtype, and the planner counts them so."""
    from hybridkv.kv.planner import estimate_weights
    from hybridkv.model.factory import build_model

    config = moe_config() if moe else tiny_llama(hidden=128).config.to_dict()
    config |= {"torch_dtype": "bfloat16", "dtype": "bfloat16"}
    model = build_model(config, torch.bfloat16, weights=fmt)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    assert held == sum(estimate_weights(config, 1, fmt).values())
    assert held < sum(estimate_weights(config, 1).values())
