"""The quantized linears against float32 references: ``int4_gemm`` against ``F.linear`` of ``dequantize_int4``'s
weight, ``fp8_linear`` against the quantize-dequantize math in float32, ``quantize_fp8_per_token`` bit for bit
against its torch reference, and both linears captured in a CUDA graph.

Tolerances, bf16 (fp16) activations: the kernel rounds only its output to bf16 (8-bit mantissa: half an ulp is
2^-9 = 0.2% of a value) and accumulates in float32, in another order than the reference; so the relative error of
the output's norm ``|y - ref| / |ref|`` must stay under 4e-3, and every element within 1% of the output's largest
magnitude (an element near zero can be off by several of its own ulps, never by a share of the output's scale).
Float32 activations (interpreter runs) are held to 1e-5.

    pytest tests/gpu/test_quant_gemm.py           (on a GPU; about a minute, most of it Triton compiling)
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from hybridkv.kernels.quant_gemm import (  # noqa: E402
    dequantize_int4, fp8_linear, int4_gemm, pack_int4, quantize_fp8_per_token, quantize_fp8_per_token_reference,
)

DEVICE = "cpu" if INTERPRET else "cuda"
NORM_TOL, MAX_TOL = 4e-3, 1e-2


def random_int4(n: int, k: int, group_size: int, zero_points: bool, dtype: torch.dtype, seed: int):
    """A packed weight with scales near a real checkpoint's (|w| ~ 1 / sqrt(k)) and its dequantized float32."""
    g = torch.Generator().manual_seed(seed)
    groups = k // (group_size or k)
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, generator=g)
    scale = ((torch.rand(n, groups, generator=g) + 0.5) / (4 * k**0.5)).to(dtype)
    zero = torch.randint(-8, 8, (n, groups), dtype=torch.int8, generator=g) if zero_points else None
    packed = pack_int4(q)
    w = dequantize_int4(packed, scale, zero, group_size, torch.float32)
    return (packed.to(DEVICE), scale.to(DEVICE), zero.to(DEVICE) if zero_points else None), w


def assert_close_to(got: torch.Tensor, want: torch.Tensor, exact_float32: bool = False):
    got, want = got.double().cpu(), want.double().cpu()
    assert torch.isfinite(got).all()
    rel = ((got - want).norm() / want.norm()).item()
    worst = ((got - want).abs().max() / want.abs().max()).item()
    if exact_float32:
        assert rel < 1e-5 and worst < 1e-5, (rel, worst)
    else:
        assert rel < NORM_TOL and worst < MAX_TOL, (rel, worst)


SHAPES = [  # (n, k): a Scout rank's q/k/v, non-power-of-two N and K, an expert's down projection
    (896, 5120), (5120, 2048), (14336, 1024), (200, 384),
]


@pytest.mark.parametrize("rows", [1, 3, 8, 16, 33, 64, 65, 200, 1024])
@pytest.mark.parametrize("n,k", SHAPES)
def test_int4_gemm_rows_and_shapes(rows, n, k):
    """Group 128, symmetric: every row count across the decode tiles (<= 64) and the prefill tiles."""
    if INTERPRET and (rows > 8 or n * k > 200 * 384):
        pytest.skip("the interpreter runs small shapes only")
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    weight, w = random_int4(n, k, 128, False, dtype, seed=rows + n)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)
    got = int4_gemm(x.to(DEVICE), *weight, 128)
    assert got.shape == (rows, n) and got.dtype == dtype
    assert_close_to(got, x.float() @ w.T, exact_float32=INTERPRET)


@pytest.mark.parametrize("group_size", [32, 64, 128, 0])
@pytest.mark.parametrize("zero_points,bias", [(False, False), (True, False), (True, True), (False, True)])
@pytest.mark.parametrize("rows", [1, 16, 65, 300])
def test_int4_gemm_groups_zero_points_and_bias(group_size, zero_points, bias, rows):
    """Group sizes 32, 64, 128 and one group a row (0), with and without zero points and a bias."""
    if INTERPRET and rows > 16:
        pytest.skip("the interpreter runs small shapes only")
    n, k = (96, 512) if INTERPRET else (896, 4096)
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    weight, w = random_int4(n, k, group_size, zero_points, dtype, seed=group_size + rows)
    gen = torch.Generator().manual_seed(rows + 7)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    got = int4_gemm(x.to(DEVICE), *weight, group_size, b.to(DEVICE) if bias else None)
    want = x.float() @ w.T + (b.float() if bias else 0)
    assert_close_to(got, want, exact_float32=INTERPRET)


@pytest.mark.skipif(INTERPRET, reason="fp16 dots: on the GPU")
@pytest.mark.parametrize("rows", [1, 200])
def test_int4_gemm_fp16_and_leading_dims(rows):
    weight, w = random_int4(512, 1024, 128, True, torch.float16, seed=rows)
    x = torch.randn(2, rows, 1024).to(torch.float16)
    got = int4_gemm(x.to(DEVICE), *weight, 128)
    assert got.shape == (2, rows, 512) and got.dtype == torch.float16
    assert_close_to(got, x.float() @ w.T)


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("group_size,k,zero_points,bias,scale_weights", [
    (128, 512, False, False, False), (32, 512, True, True, False), (64, 512, False, True, True),
    (0, 200, True, False, True),  # one group a row, K not a multiple of the K tile
])
def test_int4_gemv_tile(rows, group_size, k, zero_points, bias, scale_weights):
    """The GEMV (no dots) at any tile, not only the defaults: columns past the last tile, K splits, every group
    size, zero points, a bias, the scale on the weights or on each K tile's sum."""
    from hybridkv.kernels.quant_triton import Int4Tile, launch_int4_gemm

    n = 100
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    weight, w = random_int4(n, k, group_size, zero_points, dtype, seed=rows + k)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    tile = Int4Tile(1, 32, 128, 4, 2, 1, scale_weights, gemv=True)
    got = launch_int4_gemm(x.to(DEVICE), *weight, group_size or k, b.to(DEVICE) if bias else None, tile=tile)
    want = x.float() @ w.T + (b.float() if bias else 0)
    assert_close_to(got, want, exact_float32=INTERPRET)


@pytest.mark.parametrize("rows", [2, 9])  # the GEMV, the dot tiles
def test_int4_gemm_same_bits_every_call(rows):
    """The K-splits are summed in a fixed order by each tile's last program: one input, the same output bits, with
    the caller's arrival counters kept across calls (as a linear keeps them) and left at zero by each."""
    from hybridkv.kernels.quant_triton import int4_gemm_counters

    dtype = torch.float32 if INTERPRET else torch.bfloat16
    weight, w = random_int4(128, 1024, 128, True, dtype, seed=3)
    x = torch.randn(rows, 1024).to(dtype).to(DEVICE)
    arrived = int4_gemm_counters(128, DEVICE)
    first = int4_gemm(x, *weight, 128, arrived=arrived)
    assert not arrived.any()
    assert_close_to(first, x.float().cpu() @ w.T, exact_float32=INTERPRET)
    assert torch.equal(int4_gemm(x, *weight, 128, arrived=arrived), first)


def test_int4_gemm_refuses_bad_inputs():
    weight, _ = random_int4(64, 256, 128, False, torch.float32, seed=0)
    with pytest.raises(ValueError, match="x has 128 features, the weight 256"):
        int4_gemm(torch.zeros(1, 128, device=DEVICE), *weight, 128)
    with pytest.raises(ValueError, match="scales of the same dtype"):
        int4_gemm(torch.zeros(1, 256, device=DEVICE, dtype=torch.float16), *weight, 128)
    with pytest.raises(ValueError, match="scales must be"):
        int4_gemm(torch.zeros(1, 256, device=DEVICE), *weight, 64)


@pytest.mark.skipif(INTERPRET, reason="the interpreter's float32 -> e4m3 conversion rounds some values wrong")
@pytest.mark.parametrize("rows,k", [(1, 5120), (7, 16384), (300, 8192), (2, 96)])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_quantization_matches_torch_bit_for_bit(rows, k, static):
    gen = torch.Generator().manual_seed(rows + k)
    x = (torch.randn(rows, k, generator=gen) * 3).to(torch.bfloat16).to(DEVICE)
    x[0, : k // 2] = 0  # exact zeros; a zero row below
    if rows > 2:
        x[1] = 0
        x[2, 1] = 3e4  # a large outlier: the rest of its row rounds to small e4m3 values
    scale = torch.tensor(0.02, device=DEVICE) if static else None
    q, s = quantize_fp8_per_token(x, scale)
    want_q, want_s = quantize_fp8_per_token_reference(x, scale)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (rows, 1)
    assert torch.equal(s, want_s)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


@pytest.mark.skipif(INTERPRET, reason="torch._scaled_mm: CUDA only")
@pytest.mark.parametrize("rows", [1, 3, 16, 33, 200, 1024])
@pytest.mark.parametrize("n,k", [(896, 5120), (5120, 2048), (14336, 1024)])
@pytest.mark.parametrize("static,bias", [(False, False), (True, True), (False, True)])
def test_fp8_linear_matches_the_quantized_math(rows, n, k, static, bias):
    """The product of the quantized operands, scaled, in float32: only float32 accumulation order and the final
    bf16 rounding differ."""
    gen = torch.Generator().manual_seed(rows + n)
    w = torch.randn(n, k, generator=gen) / k**0.5
    w_scale = w.abs().amax(dim=1) / 448
    weight = (w / w_scale[:, None]).to(torch.float8_e4m3fn)
    x = torch.randn(rows, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(n, generator=gen).to(torch.bfloat16) if bias else None
    input_scale = torch.tensor(4.0 / 448) if static else None
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    got = fp8_linear(dev(x), dev(weight), dev(w_scale), dev(input_scale), dev(b))
    assert got.shape == (rows, n) and got.dtype == torch.bfloat16
    xq, xs = quantize_fp8_per_token_reference(x, input_scale)
    want = (xq.float() * xs) @ (weight.float() * w_scale[:, None]).T + (b.float() if bias else 0)
    assert_close_to(got, want)


@pytest.mark.skipif(INTERPRET, reason="torch._scaled_mm: CUDA only")
def test_fp8_linear_refuses_shapes_scaled_mm_cannot_take():
    weight = torch.zeros(24, 64, device=DEVICE).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiples of 16"):
        fp8_linear(torch.zeros(1, 64, device=DEVICE, dtype=torch.bfloat16), weight,
                   torch.ones(24, device=DEVICE))


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs")
def test_both_linears_replay_in_a_cuda_graph():
    """Captured at batch 1 (the decode step's shape), each replays the eager result for new inputs in place."""
    weight, _ = random_int4(896, 5120, 128, True, torch.bfloat16, seed=1)
    gen = torch.Generator().manual_seed(5)
    w8 = (torch.randn(896, 5120, generator=gen) * 0.5).to(torch.float8_e4m3fn).to(DEVICE)
    w8_scale = torch.rand(896, generator=gen).to(DEVICE) * 1e-2
    bias = torch.randn(896, generator=gen).to(torch.bfloat16).to(DEVICE)
    x = torch.randn(1, 5120, generator=gen).to(torch.bfloat16).to(DEVICE)

    def step():
        return int4_gemm(x, *weight, 128, bias), fp8_linear(x, w8, w8_scale, None, bias)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out4, out8 = step()
    for seed in (6, 7):
        x.copy_(torch.randn(1, 5120, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16))
        graph.replay()
        want4, want8 = step()
        assert torch.equal(out4, want4) and torch.equal(out8, want8)
        assert out4.abs().sum() > 0 and out8.abs().sum() > 0
