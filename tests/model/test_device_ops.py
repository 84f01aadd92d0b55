"""Device dispatch is decided when a model is placed (``device_ops.bind_ops``, ``CausalLM.place``): a model never
placed runs its eager torch ops, and placing it binds every layer's ops for the device, the fused q/k/v groups'
GEMMs included. (What the CUDA ops compute is ``tests/gpu``'s business; binding them needs no GPU.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.model.architectures.device_ops import DeviceOps, bind_ops
from hybridkv.model.architectures.llama import MLP, Attention, LlamaForCausalLM, MoE
from hybridkv.model.architectures.llama_config import ModelConfig
from hybridkv.model.architectures.norms import RMSNorm
from hybridkv.model.architectures.parallel import DecodeGemm, FusedColumns, LinearOps

LLAMA4 = {"model_type": "llama4_text", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16,
          "intermediate_size_mlp": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
          "head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2}


def bound(model: LlamaForCausalLM) -> dict[str, set[str]]:
    """Per op class, the names of the methods its dispatched ops point at (every instance)."""
    out: dict[str, set[str]] = {}
    for module in model.modules():
        if isinstance(module, DeviceOps) and module.dispatched:
            names = {getattr(module, name).__func__.__name__ for name in module.dispatched}
            out.setdefault(type(module).__name__, set()).update(names)
    return out


def gemms(model: LlamaForCausalLM) -> list:
    ops = [m for m in model.modules() if isinstance(m, LinearOps)]
    ops += [g for m in model.modules() for g in vars(m).values() if isinstance(g, FusedColumns)]
    return [op.gemm for op in ops]


def test_a_model_never_placed_runs_its_torch_ops_and_placing_binds_the_devices():
    model = LlamaForCausalLM(ModelConfig.from_hf(LLAMA4))
    native = {"RMSNorm": {"forward_native", "add_forward_native"}, "Attention": {"_encode_native"},
              "MLP": {"forward_native"}, "MoE": {"forward_native", "fused_native", "routed_native"},
              "LlamaForCausalLM": {"position_tables_native"}, "VocabParallelEmbedding": {"logits_native"},
              "ParallelLMHead": {"logits_native"}}
    assert bound(model) == native
    assert {type(m) for m in model.modules()} >= {RMSNorm, Attention, MLP, MoE}
    linears = gemms(model)
    # per layer q, k, v, o and a MLP's gate, up, down (layer 1's the MoE's shared expert), and the q/k/v and
    # gate/up groups
    assert len(linears) == 2 * (4 + 3 + 2) and all(g is F.linear for g in linears)

    bind_ops(model, torch.device("cuda"))  # only binds: nothing runs
    assert bound(model) == {op: {n.replace("_native", "_cuda") for n in names} for op, names in native.items()}
    cuda = gemms(model)
    assert all(isinstance(g, DecodeGemm) for g in cuda) and len({id(g) for g in cuda}) == len(cuda)  # own counters

    bind_ops(model, "cpu")
    assert bound(model) == native and all(g is F.linear for g in gemms(model))


def test_placing_on_the_cpu_keeps_the_hidden_states_bit_for_bit():
    from hybridkv.kv.layer_specs import layer_specs_from_hf_config
    from hybridkv.model.attention.dense import DenseAttention

    hf = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf(hf))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    specs = layer_specs_from_hf_config(hf, kv_cache_dtype="float32")
    ids = torch.randint(0, 64, (9,))
    with torch.no_grad():
        before = model(ids, torch.arange(9), DenseAttention(specs, [9]))
        placed = model.place("cpu", torch.float32)
        assert placed is model and not model.training
        assert torch.equal(placed(ids, torch.arange(9), DenseAttention(specs, [9])), before)


def test_a_placed_model_holds_no_reference_cycle_so_dropping_it_frees_its_weights_at_once():
    """The ops a layer is bound to are not kept as bound methods of the layer (a cycle through the layer): with
    the cycle collector off, the last reference dropped frees the model, as a second engine on a full GPU needs."""
    import gc
    import weakref

    from hybridkv.model.architectures.parallel import ColumnParallelLinear
    from hybridkv.model.quantization.quantized_layers import QuantizedGemm

    model = LlamaForCausalLM(ModelConfig.from_hf(LLAMA4))
    bind_ops(model, torch.device("cuda"))
    norm = next(m for m in model.modules() if isinstance(m, RMSNorm))
    assert norm.forward.__func__ is RMSNorm.forward_cuda and "forward" not in vars(norm)
    linear = next(m for m in model.modules() if isinstance(m, ColumnParallelLinear))
    gemm = QuantizedGemm(linear, torch.device("cuda"))  # a quantized linear's GEMM refers to its owner
    linear.gemm = gemm
    dropped = [weakref.ref(x) for x in (model, norm, linear)]
    del norm, linear
    gc.collect()
    gc.disable()
    try:
        del model
        assert [r() for r in dropped] == [None, None, None]
    finally:
        gc.enable()
    del gemm
