"""The quantized MoE kernels (``kernels/quant_moe.py``), INT4 (W4A16) and FP8 (W8A16), against the float MoE over
the dequantized experts.

Reference: each stack dequantized (``StackedInt4.dequantized``, the weights the INT4 kernels form in registers;
``StackedFp8.dequantized``, each e4m3 value times its channel's scale, which the FP8 kernels apply to the float32
sums after the dots instead) and the per-(token, choice) arithmetic in float64. Float32 activations (the
interpreter) run IEEE dots: held to 1e-5 of the output's norm. bf16 (a GPU): the kernels round the gated input, the
projections, ``silu`` and each pair's output where eager torch rounds them, and sum K in another order in float32,
so they agree to bf16 rounding: 1.5e-2 of the output's norm, as the bf16 fused MoE is held (``test_fused_moe.py``).

    pytest tests/gpu/test_quant_moe.py            (on a GPU)
    TRITON_INTERPRET=1 pytest tests/gpu/test_quant_moe.py   (float32 cases on the CPU)
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from hybridkv.kernels.fused_moe import MAX_PAIRS  # noqa: E402
from hybridkv.kernels.quant_gemm import pack_int4  # noqa: E402
from hybridkv.kernels.quant_moe import quant_grouped_gemm, quant_moe_decode  # noqa: E402
from hybridkv.model.quantization.quantize import quantize_fp8  # noqa: E402
from hybridkv.model.quantization.quantized_experts import StackedFp8, StackedInt4  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
DTYPES = [torch.float32] if INTERPRET else [torch.float32, torch.bfloat16]


def random_stack(experts: int, n: int, k: int, group: int, zero_points: bool, dtype, seed: int) -> StackedInt4:
    """INT4 experts with scales near a real checkpoint's (|w| ~ 1 / sqrt(k))."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (experts * n, k), dtype=torch.int8, generator=g)
    scale = ((torch.rand(experts, n, k // group, generator=g) + 0.5) / (4 * k**0.5)).to(dtype)
    zero = torch.randint(-8, 8, scale.shape, dtype=torch.int8, generator=g) if zero_points else None
    return StackedInt4(pack_int4(q).view(experts, n, k // 8), scale, zero)


def random_fp8_stack(experts: int, n: int, k: int, seed: int) -> StackedFp8:
    """FP8 experts as ``quantize_fp8`` makes them from N(0, 1 / k) weights, with row scales spread over 4x (rows of
    different sizes), so a scale applied to the wrong channel would show."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(experts * n, k, generator=g) / k**0.5 * (torch.rand(experts * n, 1, generator=g) * 3 + 1)
    q, scale = quantize_fp8(w)
    return StackedFp8(q.view(experts, n, k), scale.view(experts, n))


def on_device(stack: StackedInt4 | StackedFp8) -> tuple:
    return tuple(None if t is None else t.to(DEVICE) for t in stack.parts())


def reference(x, gates, ids, gate_up: StackedInt4 | StackedFp8, down: StackedInt4 | StackedFp8) -> torch.Tensor:
    """float64: per (token, choice) the expert's MLP on the gated input, summed over choices."""
    wg, wd = gate_up.dequantized(torch.float64), down.dequantized(torch.float64)  # [E, 2I, H], [E, H, I]
    x, gates = x.double(), gates.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for c in range(ids.shape[1]):
            e = int(ids[t, c])
            g, u = (wg[e] @ (x[t] * gates[t, c])).chunk(2)
            out[t] += wd[e] @ (F.silu(g) * u)
    return out


def relative_error(got, want) -> float:
    return ((got.double().cpu() - want).norm() / want.norm()).item()


def tolerance(dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1.5e-2


def routing(tokens: int, experts: int, top_k: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    top, ids = torch.topk(torch.randn(tokens, experts, generator=g), top_k, dim=-1)
    return torch.sigmoid(top).to(dtype), ids


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,top_k,tokens,hidden,inter,group,zero_points", [
    (16, 1, 1, 256, 128, 128, False),  # batch 1: one busy slot, K split
    (16, 1, 1, 256, 128, 64, True),    # asymmetric, smaller groups
    (4, 2, 5, 384, 160, 32, False),    # top-2 summed; I not a multiple of the column tile
    (8, 2, 32, 128, 64, 0, True),      # MAX_PAIRS rows; one group a row (channel)
])
def test_decode_matches_the_dequantized_reference(dtype, experts, top_k, tokens, hidden, inter, group, zero_points):
    gate_up = random_stack(experts, 2 * inter, hidden, group or hidden, zero_points, dtype, seed=tokens)
    down = random_stack(experts, hidden, inter, group or inter, zero_points, dtype, seed=tokens + 1)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(3)).to(dtype)
    gates, ids = routing(tokens, experts, top_k, dtype, seed=4)
    args = (x.to(DEVICE), gates.to(DEVICE), ids.to(DEVICE), on_device(gate_up), on_device(down))
    got = quant_moe_decode(*args)
    assert got.shape == x.shape and got.dtype == dtype and torch.isfinite(got).all()
    err = relative_error(got, reference(x, gates, ids, gate_up, down))
    assert err < tolerance(dtype), err
    assert torch.equal(quant_moe_decode(*args), got)  # splits summed in order: the same bits every call


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("experts,top_k,tokens,hidden,inter", [
    (16, 1, 1, 512, 256),    # batch 1 of a Scout-like layer (16 experts, top-1): one busy slot, K split
    (16, 1, 7, 256, 128),    # a few tokens, some sharing an expert
    (16, 2, 5, 384, 160),    # top-2 summed; I (down's K) 160: K tiles of 32, I not a multiple of the column tile
    (16, 1, 64, 256, 128),   # MAX_PAIRS tokens, top-1
    (8, 2, 32, 128, 64),     # MAX_PAIRS pairs, top-2
])
def test_fp8_decode_matches_the_dequantized_reference(dtype, experts, top_k, tokens, hidden, inter):
    gate_up = random_fp8_stack(experts, 2 * inter, hidden, seed=tokens)
    down = random_fp8_stack(experts, hidden, inter, seed=tokens + 1)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(3)).to(dtype)
    gates, ids = routing(tokens, experts, top_k, dtype, seed=4)
    args = (x.to(DEVICE), gates.to(DEVICE), ids.to(DEVICE), on_device(gate_up), on_device(down))
    got = quant_moe_decode(*args)
    assert got.shape == x.shape and got.dtype == dtype and torch.isfinite(got).all()
    err = relative_error(got, reference(x, gates, ids, gate_up, down))
    assert err < tolerance(dtype), err
    assert torch.equal(quant_moe_decode(*args), got)  # splits summed in order: the same bits every call


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_decode_reads_only_the_picked_experts(fmt):
    """Experts nobody picked have NaN scales: a slot that read one would show."""
    experts, hidden, inter = 8, 128, 64
    if fmt == "int4":
        gate_up = random_stack(experts, 2 * inter, hidden, 128, False, torch.float32, seed=5)
        down = random_stack(experts, hidden, inter, 64, False, torch.float32, seed=6)
    else:
        gate_up, down = random_fp8_stack(experts, 2 * inter, hidden, 5), random_fp8_stack(experts, hidden, inter, 6)
    ids = torch.tensor([[5, 2], [5, 6], [2, 5]])
    x = torch.randn(3, hidden)
    gates = torch.rand(3, 2)
    want = reference(x, gates, ids, gate_up, down)
    for e in set(range(experts)) - {2, 5, 6}:
        gate_up.scale[e], down.scale[e] = float("nan"), float("nan")
    got = quant_moe_decode(x.to(DEVICE), gates.to(DEVICE), ids.to(DEVICE), on_device(gate_up), on_device(down))
    assert relative_error(got, want) < 1e-5


def test_decode_refuses_too_many_pairs():
    stack = on_device(random_stack(1, 32, 128, 128, False, torch.float32, seed=0))
    x = torch.zeros(MAX_PAIRS + 1, 128, device=DEVICE)
    ids = torch.zeros(MAX_PAIRS + 1, 1, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=f"at most {MAX_PAIRS}"):
        quant_moe_decode(x, x[:, :1], ids, stack, stack)


def test_fp8_stacks_with_the_wrong_scales_are_refused():
    q, scale, _ = on_device(random_fp8_stack(2, 32, 64, seed=0))
    a = torch.zeros(4, 64, device=DEVICE)
    ends = torch.tensor([2, 4], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=r"float32 \[2, 32\] \(one per output channel\)"):
        quant_grouped_gemm(a, ends, q, scale.to(torch.bfloat16))
    with pytest.raises(ValueError, match="float32"):
        quant_grouped_gemm(a, ends, q, scale[:, :, None])
    with pytest.raises(ValueError, match=r"fp8 experts are float8_e4m3fn \[E, N, 32\]"):
        quant_grouped_gemm(a[:, :32], ends, q, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts,n,k,group,zero_points", [
    ([5, 0, 70, 1], 96, 128, 32, False),   # an empty expert; an expert over several row tiles
    ([0, 0, 33], 200, 256, 128, True),     # leading empty experts; N not a multiple of the column tile
    ([130], 64, 64, 0, False),             # one expert, one group a row
])
def test_grouped_gemm_matches_each_experts_product(dtype, counts, n, k, group, zero_points):
    experts = len(counts)
    stack = random_stack(experts, n, k, group or k, zero_points, dtype, seed=sum(counts))
    a = torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(7)).to(dtype)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = quant_grouped_gemm(a.to(DEVICE), ends.to(DEVICE), *on_device(stack))
    assert got.shape == (sum(counts), n) and got.dtype == dtype
    assert relative_error(got, each_experts_product(a, ends, stack)) < tolerance(dtype)


def each_experts_product(a, ends, stack) -> torch.Tensor:
    """float64: each expert's rows of ``a`` times its dequantized weight."""
    w = stack.dequantized(torch.float64)
    return torch.cat([a[int(lo):int(hi)].double() @ w[e].T
                      for e, (lo, hi) in enumerate(zip([0, *ends[:-1].tolist()], ends.tolist()))])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts,n,k", [
    ([5, 0, 70, 1], 96, 128),                # an empty expert; an expert over several row tiles
    ([0, 0, 33], 200, 160),                  # leading empty experts; N not a multiple of the column tile, K of 64
    ([130], 64, 64),                         # one expert
    ([40, 3, 0, 90, 7, 0, 1, 12] * 2, 256, 512),  # 16 experts (Scout's count), a prefill's uneven routing
])
def test_fp8_grouped_gemm_matches_each_experts_product(dtype, counts, n, k):
    stack = random_fp8_stack(len(counts), n, k, seed=sum(counts))
    a = torch.randn(sum(counts), k, generator=torch.Generator().manual_seed(7)).to(dtype)
    ends = torch.tensor(counts).cumsum(0).to(torch.int32)
    got = quant_grouped_gemm(a.to(DEVICE), ends.to(DEVICE), *on_device(stack))
    assert got.shape == (sum(counts), n) and got.dtype == dtype
    assert relative_error(got, each_experts_product(a, ends, stack)) < tolerance(dtype)


def quantized_moe(dtype, top_k: int, fmt: str = "int4"):
    """A MoE layer (16 experts of 128 x 2 x 64) with INT4 (group 64) or FP8 experts kept quantized, dummy
    weights."""
    from hybridkv.kv.weight_formats import FP8, INT4
    from hybridkv.model.architectures.llama import MoE
    from hybridkv.model.architectures.llama_config import ModelConfig
    from hybridkv.model.architectures.parallel import TPGroup
    from hybridkv.model.quantization.quantized_layers import random_quantized
    from hybridkv.model.quantization.quantized_experts import quantize_experts_layout

    cfg = ModelConfig.from_hf({
        "model_type": "llama4_text", "vocab_size": 64, "hidden_size": 128, "intermediate_size": 64,
        "intermediate_size_mlp": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "num_local_experts": 16, "num_experts_per_tok": top_k, "interleave_moe_layer_step": 1,
    })
    with torch.device("meta"):
        moe = MoE(cfg, dtype, TPGroup())
        quantize_experts_layout(moe.experts, replace(INT4, group_size=64) if fmt == "int4" else FP8)
    moe = moe.to_empty(device=DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    for p in (moe.router.weight, *moe.shared_expert.parameters()):
        p.data.normal_(0, 0.1, generator=gen)
    random_quantized(moe.experts, gen, std=0.1)
    return moe


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,top_k", [(1, 1), (9, 2), (64, 1), (32, 2)])
def test_moe_decode_and_prefill_paths_match_the_native_one(dtype, tokens, top_k, fmt):
    """The MoE layer's CUDA paths (``_fused_decode``, ``_routed_by_quantized_kernels``) against its native path,
    which dequantizes the stacks and runs the float grouped GEMMs (or the per-expert loop)."""
    moe = quantized_moe(dtype, top_k, fmt)
    x = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    with torch.no_grad():
        want = moe.forward_native(x).double().cpu()
        decoded = moe._fused_decode(x)
        top_ids, gates = moe._route(x)
        routed = moe._routed_by_quantized_kernels(x, top_ids, gates).added_to(moe.shared_expert(x))
    for got in (decoded, routed):
        assert relative_error(got, want) < tolerance(dtype)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_decode_replays_in_a_cuda_graph(fmt):
    moe = quantized_moe(torch.bfloat16, 2, fmt)
    x = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        eager = moe._fused_decode(x)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe._fused_decode(x)  # warm up (Triton compiles) off the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = moe._fused_decode(x)
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, moe._fused_decode(x))  # the replay read the new input
        assert not torch.equal(captured, eager)
