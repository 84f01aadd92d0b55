"""4-bit CPU linears: a Q4_1 weight's grid recovered exactly from its dequantised values, float weights left alone,
and the packed layer computing the float layer's output within bf16 rounding."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from torch import nn

from hybridkv.model.architectures.llama import MLP
from hybridkv.model.architectures.parallel import TPGroup, fuse_columns
from hybridkv.model.int4_cpu import (
    DENSE_ROWS, GROUP, Int4Columns, Int4Linear, Int4Rows, grid_of, int4_kernel_available, pack_int4_linears,
)
from hybridkv.model.q4_1_cpu import Q41Kernel

pytestmark = pytest.mark.skipif(not int4_kernel_available(), reason="torch has no CPU int4 kernel")


def q4_1(shape: tuple[int, int], seed: int) -> torch.Tensor:
    """A weight as a Q4_1 GGUF holds it: quantised by gguf (llama.cpp's reference code) and dequantised."""
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05
    quant = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    return torch.from_numpy(gguf.quants.dequantize(quant, gguf.GGMLQuantizationType.Q4_1).copy()).float()


def test_a_q4_1_weight_is_recovered_exactly_from_its_dequantised_values():
    w = q4_1((48, 4 * GROUP), seed=0)
    q, scale, minimum = grid_of(w)
    assert q.min() >= 0 and q.max() <= 15
    rebuilt = q.float().view(48, 4, GROUP) * scale[..., None] + minimum[..., None]
    torch.testing.assert_close(rebuilt.view_as(w), w, atol=1e-6, rtol=0)


def test_float_weights_and_rows_not_a_multiple_of_the_group_are_not_packed():
    assert grid_of(torch.randn(16, 4 * GROUP)) is None
    assert grid_of(q4_1((16, 4 * GROUP), seed=1)[:, :-8]) is None
    one_off = q4_1((16, 4 * GROUP), seed=2)
    one_off[3, 5] += 1e-3  # a single value off the grid keeps the whole weight dense
    assert grid_of(one_off) is None


@pytest.mark.parametrize("rows", [1, 5, 300])
def test_the_packed_layer_matches_the_float_layer_within_bf16_rounding(rows):
    w, bias = q4_1((96, 6 * GROUP), seed=3), torch.randn(96) * 0.1
    x = torch.randn(rows, 6 * GROUP)
    got = Int4Linear(*grid_of(w), bias)(x)
    want = nn.functional.linear(x, w, bias)
    assert got.dtype == torch.float32 and got.shape == want.shape
    # bf16 activations and scales: ~2^-8 relative per product, averaged over the dot product
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
    assert (got - want).abs().max() > 0  # really the 4-bit kernel, not the float weight


def test_a_prefill_runs_the_weight_the_kernel_reads_in_bf16():
    """From ``DENSE_ROWS`` rows on, the layer runs its bf16 weight: the kernel's own weight (read back through it with
    an identity input), and the same outputs as the kernel row by row within bf16 rounding."""
    w = q4_1((96, 6 * GROUP), seed=5)
    layer = Int4Linear(*grid_of(w), None)
    eye = torch.eye(6 * GROUP, dtype=torch.bfloat16)
    kernel_weight = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, layer.packed, GROUP, layer.scales_zeros).t()
    torch.testing.assert_close(layer.bf16_weight(), kernel_weight, rtol=2**-8, atol=0)
    x = torch.randn(DENSE_ROWS, 6 * GROUP)
    one_by_one = torch.cat([layer(row[None]) for row in x])
    torch.testing.assert_close(layer(x), one_by_one, rtol=2e-2, atol=2e-2 * one_by_one.abs().max().item())


def test_pack_replaces_only_the_layers_on_a_grid():
    model = nn.Sequential(nn.Linear(4 * GROUP, 32), nn.Linear(32, 4 * GROUP, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(q4_1((32, 4 * GROUP), seed=4))
    assert pack_int4_linears(model) == 1
    assert isinstance(model[0], Int4Linear) and isinstance(model[1], nn.Linear)
    assert model(torch.randn(2, 4 * GROUP)).shape == (2, 4 * GROUP)


@pytest.mark.parametrize("fused_first", [False, True])
def test_a_fused_gate_up_group_runs_its_packed_linears(fused_first):
    """Llama's MLP: gate and up run as a ``FusedColumns`` group; packed before or after ``fuse_columns``, the group
    calls the 4-bit linears (and holds no float weight) and the MLP still computes its float output."""
    mlp = MLP(4 * GROUP, 6 * GROUP, False, None, TPGroup())
    with torch.no_grad():
        for i, linear in enumerate((mlp.gate_proj, mlp.up_proj, mlp.down_proj)):
            linear.weight.copy_(q4_1(tuple(linear.weight.shape), seed=10 + i))
    x = torch.randn(3, 4 * GROUP)
    want = mlp(x)
    if fused_first:
        fuse_columns(mlp)
    assert pack_int4_linears(mlp) == 3
    fuse_columns(mlp)  # what ModelRunner does after the engine packed: a packed group is left alone
    assert isinstance(mlp.gate_up, Int4Columns)
    assert mlp.gate_up.whole.out_features == 12 * GROUP  # gate and up: one 4-bit GEMM
    assert isinstance(mlp.gate_proj, Int4Rows) and isinstance(mlp.down_proj, Int4Linear)
    assert not any(isinstance(p, nn.Parameter) and p.dim() == 2 for p in mlp.parameters())  # float weights gone
    got = mlp(x)
    assert (got - want).abs().max() <= 3e-2 * want.abs().max()
    # each linear's name still computes its own rows
    torch.testing.assert_close(mlp.up_proj(x), mlp.gate_up(x)[1], rtol=0, atol=0)


def test_a_group_with_a_float_linear_runs_each_linear_alone():
    """q/k/v where only q is on a grid: q is packed alone, k and v stay float, and the group still splits right."""
    from hybridkv.model.architectures.parallel import FusedColumns

    model = nn.Module()
    model.q, model.k = nn.Linear(4 * GROUP, 64, bias=False), nn.Linear(4 * GROUP, 32, bias=False)
    with torch.no_grad():
        model.q.weight.copy_(q4_1((64, 4 * GROUP), seed=20))
    model.qk = FusedColumns(model.q, model.k)
    x = torch.randn(2, 4 * GROUP)
    want_k = model.k(x)
    assert pack_int4_linears(model) == 1
    assert model.qk.whole is None and isinstance(model.qk.linears[0], Int4Linear) and model.qk.linears[1] is model.k
    q, k = model.qk(x)
    assert q.shape == (2, 64)
    torch.testing.assert_close(k, want_k, rtol=0, atol=0)


def test_packed_layer_survives_a_move_to_another_dtype():
    """A second engine over the same loaded model moves it to its dtype again: the packed scales stay bf16."""
    from hybridkv.model.int4_cpu import Int4Linear, grid_of

    torch.manual_seed(3)
    low = torch.randn(16, 2, 1)
    step = torch.rand(16, 2, 1) * 0.1 + 0.01
    q = torch.randint(0, 16, (16, 2, 32)).float()
    q[..., 0], q[..., 1] = 0, 15  # every group spans its whole grid, as Q4_1's do
    weight = (low + step * q).view(16, 64)
    layer = Int4Linear(*grid_of(weight), None)
    x = torch.randn(3, 64)
    before = layer(x)
    layer.to(dtype=torch.float32)
    assert layer.scales_zeros.dtype == torch.bfloat16
    torch.testing.assert_close(layer(x), before, rtol=0, atol=0)


def test_a_packed_llamas_residual_branch_ends_keep_bf16_and_the_hidden_states_do_not_change():
    """o_proj and down_proj feed only residual adds, which promote their bf16 output to float32 exactly: the same
    hidden states bit for bit as converting it first, and one conversion fewer a layer."""
    import copy

    from hybridkv.kv.layer_specs import layer_specs_from_hf_config
    from hybridkv.model.architectures.llama import LlamaForCausalLM
    from hybridkv.model.architectures.llama_config import ModelConfig
    from hybridkv.model.attention.dense import DenseAttention

    hf = {"model_type": "llama", "vocab_size": 64, "hidden_size": 2 * GROUP, "intermediate_size": 3 * GROUP,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": GROUP,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True}
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf(hf))
    with torch.no_grad():
        for i, linear in enumerate(m for m in model.modules() if isinstance(m, nn.Linear)):
            linear.weight.copy_(q4_1(tuple(linear.weight.shape), seed=30 + i))
    fuse_columns(model)
    converting = copy.deepcopy(model)
    assert pack_int4_linears(model, model.residual_branch_ends) == pack_int4_linears(converting) == 2 * 7
    layer = model.layers[0]
    assert layer.self_attn.o_proj.keep_bf16 and layer.mlp.down_proj.keep_bf16
    assert not layer.self_attn.qkv.whole.keep_bf16 and not layer.mlp.gate_up.whole.keep_bf16
    assert not any(m.keep_bf16 for m in converting.modules() if isinstance(m, Int4Linear))  # none named
    assert layer.mlp.down_proj(torch.randn(1, 3 * GROUP)).dtype == torch.bfloat16
    specs = layer_specs_from_hf_config(hf, kv_cache_dtype="float32")
    ids = torch.randint(0, 64, (11,))
    with torch.no_grad():
        for n in (11, 1):  # a prompt and a single token (the int4 kernel either way: below DENSE_ROWS)
            got = model(ids[:n], torch.arange(n), DenseAttention(specs, [n]))
            want = converting(ids[:n], torch.arange(n), DenseAttention(specs, [n]))
            assert got.dtype == torch.float32 and torch.equal(got, want)


def packed_llama(hf_extra: dict, float_layer: str | None = None, kernel: Q41Kernel | None = None):
    """A 2-layer Llama whose linears hold Q4_1 weights (except ``float_layer``), packed as the engine packs them
    (their 4-bit rows through ``kernel``; None: torch's int4 kernel)."""
    from hybridkv.model.architectures.llama import LlamaForCausalLM
    from hybridkv.model.architectures.llama_config import ModelConfig

    hf = {"model_type": "llama", "vocab_size": 64, "hidden_size": 2 * GROUP, "intermediate_size": 3 * GROUP,
          "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": GROUP,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
          **hf_extra}
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf(hf))
    with torch.no_grad():
        for i, (name, linear) in enumerate((n, m) for n, m in model.named_modules() if isinstance(m, nn.Linear)):
            if name != float_layer:
                linear.weight.copy_(q4_1(tuple(linear.weight.shape), seed=30 + i))
    pack_int4_linears(model, model.residual_branch_ends, kernel=kernel)
    fuse_columns(model)
    return model, hf


@pytest.mark.parametrize("ours", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_small_steps_of_a_4bit_llama_run_one_flat_loop_with_the_layers_own_hidden_states(bias, ours, monkeypatch):
    """Placed on the CPU, a 4-bit Llama comes back as ``CpuDecodeLlama``: steps below ``DENSE_ROWS`` tokens go
    through ``CpuDecodeLayers`` (the layers' modules skipped), and their hidden states are the layers' own
    forward's bit for bit; larger steps take the layers' forward. With torch's int4 kernel and with ours."""
    from hybridkv.kv.layer_specs import layer_specs_from_hf_config
    from hybridkv.model.architectures.llama_cpu_decode import CpuDecodeLayers, CpuDecodeLlama
    from hybridkv.model.attention.dense import DenseAttention

    kernel = Q41Kernel.load(threads=2) if ours else None
    if ours and kernel is None:
        pytest.skip("our Q4_1 kernel was not built")
    own, hf = packed_llama({"attention_bias": bias}, kernel=kernel)
    model = own.place("cpu")
    assert isinstance(model, CpuDecodeLlama) and model.model is own and model.embed_tokens is own.embed_tokens
    assert dict(model.named_parameters()) == {f"model.{n}": p for n, p in own.named_parameters()}
    loops = []
    call = CpuDecodeLayers.__call__
    monkeypatch.setattr(CpuDecodeLayers, "__call__", lambda self, *a: loops.append(len(a[0])) or call(self, *a))
    specs = layer_specs_from_hf_config(hf, kv_cache_dtype="float32")
    ids = torch.randint(0, 64, (DENSE_ROWS + 1,))
    with torch.no_grad():
        for n in (11, 1, DENSE_ROWS + 1):
            got = model(ids[:n], torch.arange(n), DenseAttention(specs, [n]))
            want = own(ids[:n], torch.arange(n), DenseAttention(specs, [n]))  # the layers' own forward only
            assert torch.equal(got, want)
    assert loops == [11, 1]
    assert model.place("cpu").model is own  # placed again (a second engine over the same model): wrapped again


def test_a_llama_with_a_float_linear_runs_its_layers_own_forward():
    model, _ = packed_llama({}, float_layer="layers.1.mlp.down_proj")
    assert isinstance(model.layers[0].mlp.down_proj, Int4Linear)
    assert model.place("cpu") is model
