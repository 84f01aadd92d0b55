"""The INT4 layout the loader hands the kernels (compressed-tensors' pack-quantized), in plain torch on the CPU:
packing and unpacking are inverse, a row worked by hand packs to the int32 computed below, and dequantization is
``(q - zero) * scale`` per group, rounded once. Also the FP8 per-token quantization's reference."""

from __future__ import annotations

import pytest
import torch

from hybridkv.kernels.quant_gemm import (
    FP8_MIN_SCALE, check_int4, dequantize_int4, pack_int4, quantize_fp8_per_token_reference, unpack_int4,
)


def test_a_row_worked_by_hand():
    # q + 8 = [0, 7, 8, 9, 15, 10, 11, 12], nibble i at bits 4i: 0xCBAF9870 = 3,417,282,672 = -877,684,624 as int32
    q = torch.tensor([[-8, -1, 0, 1, 7, 2, 3, 4]], dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.int32 and packed.tolist() == [[0xCBAF9870 - (1 << 32)]]
    assert packed.item() == -877684624
    assert unpack_int4(packed).tolist() == q.tolist()
    # a second word: column 8 + i is nibble i of word 1
    two = torch.tensor([[0] * 8 + [7, -8, 0, 0, 0, 0, 0, 1]], dtype=torch.int8)
    assert pack_int4(two).tolist() == [[0x88888888 - (1 << 32), 0x9888880F - (1 << 32)]]


def test_round_trip_every_value_in_every_position():
    torch.manual_seed(0)
    q = torch.randint(-8, 8, (37, 8 * 24), dtype=torch.int8)
    q[0, :16] = torch.arange(-8, 8, dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.shape == (37, 24)
    assert torch.equal(unpack_int4(packed), q)
    assert torch.equal(pack_int4(unpack_int4(packed)), packed)


@pytest.mark.parametrize("group_size", [32, 64, 128, 0])
@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dequantize_matches_the_formula(group_size, zero_points, dtype):
    torch.manual_seed(group_size + zero_points)
    n, k = 24, 256
    g = group_size or k
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scale = (torch.rand(n, k // g) * 0.1 + 1e-3).to(dtype)
    zero = torch.randint(-8, 8, (n, k // g), dtype=torch.int8) if zero_points else None
    got = dequantize_int4(pack_int4(q), scale, zero, group_size)
    assert got.dtype == dtype and got.shape == (n, k)
    want = torch.empty(n, k, dtype=torch.float64)
    for col in range(k):
        z = zero[:, col // g].double() if zero_points else 0.0
        want[:, col] = (q[:, col].double() - z) * scale[:, col // g].double()
    assert torch.equal(got, want.to(dtype))  # the exact product, rounded once
    assert torch.equal(dequantize_int4(pack_int4(q), scale, zero, group_size, torch.float32), want.float())


def test_a_small_example():
    packed = pack_int4(torch.tensor([[-8, 7, 0, 1, 2, 3, 4, 5]], dtype=torch.int8))
    w = dequantize_int4(packed, torch.tensor([[0.5]], dtype=torch.bfloat16), torch.tensor([[-1]], dtype=torch.int8), 0)
    assert w.tolist() == [[-3.5, 4.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0]]


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="multiple of 8 columns"):
        pack_int4(torch.zeros(2, 12, dtype=torch.int8))
    with pytest.raises(ValueError, match=r"lie in \[-8, 7\]"):
        pack_int4(torch.full((1, 8), 8, dtype=torch.int8))
    packed = torch.zeros(4, 16, dtype=torch.int32)  # K = 128
    with pytest.raises(ValueError, match="does not divide"):
        check_int4(packed, torch.ones(4, 3), None, 48)
    with pytest.raises(ValueError, match=r"scales must be \[4, 2\]"):
        check_int4(packed, torch.ones(4, 1), None, 64)
    with pytest.raises(ValueError, match="zero points must be int8"):
        check_int4(packed, torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.int32), 64)
    assert check_int4(packed, torch.ones(4, 1), None, 0) == 128


def test_fp8_reference_scales_rows_and_saturates():
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 0.5, 448.0 / 224.0], [3.0, -1.0, 0.0, 0.0]],
                     dtype=torch.bfloat16)
    q, scale = quantize_fp8_per_token_reference(x)
    assert scale.shape == (3, 1) and scale.dtype == torch.float32
    assert scale[0].item() == pytest.approx(FP8_MIN_SCALE) and not q[0].float().any()  # a zero row: zeros
    assert scale[1].item() == pytest.approx(2.0 / 448) and q[1].float().tolist() == [224.0, -448.0, 112.0, 448.0]
    q, scale = quantize_fp8_per_token_reference(x, torch.tensor(1 / 64))
    assert scale.flatten().tolist() == [1 / 64] * 3
    assert q[2].float().tolist() == [192.0, -64.0, 0.0, 0.0] and q[1, 3].float().item() == 128.0
    q, _ = quantize_fp8_per_token_reference(torch.tensor([[100.0]]), torch.tensor(0.01))
    assert q.float().item() == 448.0  # saturated, not NaN
