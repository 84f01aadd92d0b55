"""Our Q4_1 CPU kernel: the GGUF's blocks held exactly, the products within the activations' two-digit rounding of
the float matmul, every instruction set and thread count bit for bit the scalar C kernel's, and a row's output the
same whatever the other rows of the call."""

from __future__ import annotations

import platform

import gguf
import numpy as np
import pytest
import torch

from hybridkv.model.int4_cpu import DENSE_ROWS, Int4Linear, grid_of
from hybridkv.model.q4_1_cpu import GROUP, TILE, Q41Kernel, pack

KERNEL = Q41Kernel.load(threads=2)
needs_kernel = pytest.mark.skipif(KERNEL is None, reason="the Q4_1 kernel was not built (no C compiler at install)")


def gguf_q4_1(shape: tuple[int, int], seed: int) -> tuple[np.ndarray, torch.Tensor]:
    """(the GGUF's Q4_1 blocks [N, K/32, 20] as bytes, their dequantised float32 weight), by gguf's own code."""
    w = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05
    blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)
    weight = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.Q4_1)
    return blocks.reshape(shape[0], -1, 20), torch.from_numpy(weight.copy())


def unpack(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K], d, m [N, K/32] as float32) read back from ``pack``'s layout, as the docstring states it."""
    tiles, blocks, _ = packed.shape
    nibbles = packed[..., :256].view(tiles, blocks, 4, TILE, 4).permute(0, 3, 1, 2, 4)  # [t, j, b, c, i]
    q = torch.stack((nibbles & 15, nibbles >> 4), dim=3).reshape(tiles * TILE, blocks * GROUP)
    d, m = (packed[..., at:at + 32].contiguous().view(torch.float16).transpose(1, 2).reshape(-1, blocks).float()
            for at in (256, 288))
    return q[:n].int(), d[:n], m[:n]


@needs_kernel
def test_the_gguf_blocks_are_held_exactly():
    """The scales and minimums are the file's fp16 bits, and d q + m (in float32, as gguf dequantises) is the
    dequantised weight bit for bit, for rows not a multiple of the tile."""
    blocks, weight = gguf_q4_1((37, 9 * GROUP), seed=0)
    packed = pack(*grid_of(weight))
    assert packed.shape == (3, 9, 320) and packed.dtype == torch.uint8
    q, d, m = unpack(packed, 37)
    file_d, file_m = (torch.from_numpy(blocks[..., at:at + 2].copy()).view(torch.float16)[..., 0] for at in (0, 2))
    assert torch.equal(d.half(), file_d) and torch.equal(m.half(), file_m)
    rebuilt = (q.view(37, 9, GROUP).float() * d[..., None] + m[..., None]).view(37, -1)
    assert torch.equal(rebuilt, weight)
    assert unpack(packed, 48)[0][37:].eq(0).all()  # rows 37..47 of the last tile: padding


def bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output, the largest error the kernel may make: each input within max|x| / 65024 of its block (half a
    step of the two digits' grid) times the block's |w|, plus float32 rounding of the sums."""
    rows, k = x.shape
    step = x.abs().view(rows, k // GROUP, GROUP).amax(-1) / 65024  # [R, K/32]
    w_abs = w.abs().view(w.shape[0], k // GROUP, GROUP).sum(-1)  # [N, K/32]
    return 1.01 * step.double() @ w_abs.double().t() + 1e-6 * (x.abs().double() @ w.abs().double().t())


@needs_kernel
@pytest.mark.parametrize("n,k", [(16, GROUP), (37, 3 * GROUP), (100, 9 * GROUP), (48, 25 * GROUP)])
def test_the_kernel_is_the_float_matmul_within_its_activation_rounding(n, k):
    """K of 1, 3, 9 and 25 blocks (not multiples of 256), N not a multiple of 16, 1..8 rows at once."""
    _, weight = gguf_q4_1((n, k), seed=n)
    packed = pack(*grid_of(weight))
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(k))
    x[:, 3] *= 20  # an outlier channel, as hidden states have
    for rows in range(1, 9):
        got = KERNEL(packed, n, x[:rows]).double()
        want = x[:rows].double() @ weight.double().t()
        assert got.shape == (rows, n)
        assert ((got - want).abs() <= bound(x[:rows], weight)).all()
        assert (got - want).abs().max() > 0  # really the kernel's rounding, not a float matmul


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_every_instruction_set_and_thread_count_gives_the_scalar_kernels_bits(threads):
    _, weight = gguf_q4_1((100, 18 * GROUP), seed=1)
    packed = pack(*grid_of(weight))
    x = torch.randn(7, 18 * GROUP, generator=torch.Generator().manual_seed(2))
    want = KERNEL(packed, 100, x, isa=0, threads=1)
    for isa in range(KERNEL.isa + 1):
        assert torch.equal(KERNEL(packed, 100, x, isa=isa, threads=threads), want), isa


@needs_kernel
def test_a_rows_output_does_not_depend_on_the_other_rows():
    """Rows go through the tile 4 at a time: row 5 alone, with 2 others, or among 9 gives the same bits."""
    _, weight = gguf_q4_1((64, 6 * GROUP), seed=3)
    packed = pack(*grid_of(weight))
    x = torch.randn(9, 6 * GROUP, generator=torch.Generator().manual_seed(4))
    alone = KERNEL(packed, 64, x[5:6])
    assert torch.equal(KERNEL(packed, 64, x[3:6])[2:], alone)
    assert torch.equal(KERNEL(packed, 64, x)[5:6], alone)


@needs_kernel
def test_bf16_activations_give_the_bits_of_the_same_values_in_float32():
    _, weight = gguf_q4_1((32, 4 * GROUP), seed=5)
    packed = pack(*grid_of(weight))
    x = torch.randn(3, 4 * GROUP).bfloat16()
    assert torch.equal(KERNEL(packed, 32, x), KERNEL(packed, 32, x.float()))


@needs_kernel
def test_the_docstrings_worked_example():
    q = torch.zeros(16, GROUP, dtype=torch.int32)
    q[0, :4] = torch.tensor([1, 2, 3, 4])
    d, m = torch.full((16, 1), 0.5), torch.full((16, 1), -1.0)
    x = torch.zeros(1, GROUP)
    x[0, :4] = torch.tensor([0.5, -1.0, 0.25, 0.0])
    y = KERNEL(pack(q, d, m), 16, x)
    assert y[0, 0].item() == pytest.approx(-0.125, abs=1e-6)
    assert y[0, 1].item() == pytest.approx(-1.0 * -0.25, abs=1e-6)  # q = 0: m sx alone


@needs_kernel
def test_bad_shapes_name_the_problem():
    _, weight = gguf_q4_1((16, 2 * GROUP), seed=6)
    packed = pack(*grid_of(weight))
    with pytest.raises(ValueError, match="x has 96 inputs a row; this weight takes 64"):
        KERNEL(packed, 16, torch.randn(1, 3 * GROUP))
    with pytest.raises(ValueError, match="K a multiple of 32"):
        pack(torch.zeros(16, 40, dtype=torch.int32), torch.zeros(16, 1), torch.zeros(16, 1))


@needs_kernel
def test_a_layer_on_the_kernel_runs_its_rows_through_it_and_a_prefill_through_the_bf16_copy():
    _, weight = gguf_q4_1((96, 6 * GROUP), seed=7)
    bias = torch.randn(96) * 0.1
    layer = Int4Linear(*grid_of(weight), bias, kernel=KERNEL)
    layer.keep_bf16 = True  # torch's kernel's bf16 output; ours is float32 already
    assert not hasattr(layer, "packed") and layer.q4_1.shape == (6, 6, 320)
    x = torch.randn(DENSE_ROWS, 6 * GROUP)
    rows = layer(x[:3])
    assert rows.dtype == torch.float32
    assert torch.equal(rows, KERNEL(layer.q4_1, 96, x[:3]) + bias)
    prefill = layer(x)  # the bf16 copy: each weight rounded to bf16, the activations too
    want = x @ weight.t() + bias
    assert (prefill - want).abs().max() <= 2e-2 * want.abs().max()
    assert (rows - want[:3]).abs().max() <= 1e-3 * want.abs().max()


@pytest.mark.skipif(platform.system() != "Linux" or platform.machine() != "x86_64", reason="Linux x86-64 only")
def test_the_kernel_is_built_and_uses_this_cpus_best_instructions():
    """``pip install -e .`` (``make install``) builds it wherever there is a C compiler, as on every Linux CI
    runner; on an x86-64 CPU with AVX2 it must not fall back to the scalar C kernel."""
    assert KERNEL is not None
    flags = open("/proc/cpuinfo").read()
    if " avx512_vnni" in flags and " avx512bw" in flags:
        assert KERNEL.isa == 2
    elif " avx2" in flags:
        assert KERNEL.isa == 1


@needs_kernel
def test_the_default_models_q4_1_tensors_are_held_as_the_file_stores_them():
    """Every Q4_1 tensor of the default model's GGUF: its recovered scales, minimums and codes are the file's bytes
    (the file's block: fp16 d, fp16 m, then byte i holding q[i] | q[16 + i] << 4)."""
    from hybridkv.model.loading.known_models import resolve_model

    reader = gguf.GGUFReader(str(resolve_model(None).path))
    tensors = [t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_1]
    assert len(tensors) == 210
    for tensor in tensors:
        raw = np.asarray(tensor.data)
        weight = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).copy())
        n, k = weight.shape
        q, d, m = unpack(pack(*grid_of(weight)), n)
        blocks = torch.from_numpy(raw.reshape(n, k // GROUP, 20).copy())
        assert torch.equal(d.half(), blocks[..., 0:2].contiguous().view(torch.float16)[..., 0]), tensor.name
        assert torch.equal(m.half(), blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]), tensor.name
        codes = blocks[..., 4:]
        assert torch.equal(torch.cat((codes & 15, codes >> 4), -1).view(n, k).int(), q), tensor.name



@needs_kernel
@pytest.mark.parametrize("shape", [(16, GROUP), (40, 3 * GROUP), (7, 2 * GROUP), (576, 18 * GROUP)])
@pytest.mark.parametrize("threads", [1, 3])
def test_a_prompt_rows_bf16_weight_is_expanded_from_the_kernels_bytes(shape, threads):
    """A layer under our kernel keeps no bf16 copy: its prompt rows' bf16 weight is expanded from the kernel's
    bytes (read back independently here) as torch's int4 kernel's (``_expand`` of ``d`` and ``m + 8 d`` in bf16),
    bit for bit, at any thread count."""
    from dataclasses import replace

    from hybridkv.model.int4_cpu import _expand

    g = torch.Generator().manual_seed(1)
    n, k = shape
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    d, m = torch.rand(n, k // GROUP, generator=g) * 0.01, torch.randn(n, k // GROUP, generator=g) * 0.05
    layer = Int4Linear(q, d, m, None, kernel=replace(KERNEL, threads=threads))
    q_back, d_back, m_back = unpack(layer.q4_1, n)
    scales_zeros = torch.stack((d_back.t(), (m_back + 8 * d_back).t()), dim=-1).bfloat16()
    assert layer.dense is None and torch.equal(layer.bf16_weight(), _expand(q_back, scales_zeros))
