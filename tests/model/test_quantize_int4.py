"""The INT4 quantizer at load (``quantize_int4``): each group's scale searched for the least |w|-weighted squared
error, never more than compressed-tensors' ``absmax / 7`` gives, worked examples exact, and the values in the
layout every INT4 consumer reads (q in [-8, 7], one scale a group in the scale dtype, ``q * scale``)."""

from __future__ import annotations

import pytest
import torch

import hybridkv.model.quantization.quantize as quantize
from hybridkv.kernels.quant_gemm import dequantize_int4, unpack_int4
from hybridkv.model.quantization.quantize import quantize_int4


def absmax_over_7(w: torch.Tensor, group: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """The dequantized weight of symmetric round-to-nearest with scale absmax / 7 (the quantizer before the search)."""
    groups = w.double().view(w.shape[0], -1, group)
    scale = (groups.abs().amax(-1).float() / 7).to(scale_dtype).double()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))[..., None]
    return ((groups / scale).round().clamp(-8, 7) * scale).view_as(w)


def weighted_error(w: torch.Tensor, got: torch.Tensor, group: int) -> torch.Tensor:
    """Per group: sum |w| (w - got)^2, the error the search minimizes."""
    w, got = w.double(), got.double()
    return (w.abs() * (w - got) ** 2).view(w.shape[0], -1, group).sum(-1)


def searched(w: torch.Tensor, group: int, scale_dtype: torch.dtype = torch.bfloat16):
    packed, scale = quantize_int4(w, group, scale_dtype)
    return unpack_int4(packed), scale, dequantize_int4(packed, scale, None, group, torch.float64)


def test_worked_examples():
    # the docstring's: -0.8 takes -8 (scale 0.1), where absmax / 7 takes -7 at 0.1143 and moves 0.3 by 0.043
    w = torch.tensor([[-0.8, 0.1, 0.3, 0.7, 0.8, -0.7, 0.3, -0.1]])
    q, scale, got = searched(w, 4)
    assert q.tolist() == [[-8, 1, 3, 7, -8, 7, -3, 1]]
    assert scale.dtype == torch.bfloat16 and scale.tolist() == [[0.10009765625, -0.10009765625]]
    assert (got - w.double()).abs().max() < 0.0008
    assert (absmax_over_7(w, 4, torch.bfloat16) - w.double()).abs().max() > 0.04


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_the_search_never_does_worse_than_absmax_over_7(group, scale_dtype):
    torch.manual_seed(group)
    w = torch.randn(256, 4 * group) * 0.02
    w[:64] *= torch.rand(64, 1) * 3  # rows of other scales
    w[64:128].view(-1, group)[:, 0] *= 8  # an outlier a group
    w[128:160] = (w[128:160] * 50).round() / 50 * 0.02  # a coarse grid (a 4-bit checkpoint's values)
    w[160:161] = 0  # groups of zeros: scale 1, q 0
    q, scale, got = searched(w, group, scale_dtype)
    assert q.min() >= -8 and q.max() <= 7 and (q == -8).any()
    assert scale.dtype == scale_dtype and scale.shape == (256, 4) and (scale[160] == 1).all() and (q[160] == 0).all()
    ours = weighted_error(w, got, group)
    rtn = weighted_error(w, absmax_over_7(w, group, scale_dtype), group)
    slack = 1e-5 * (w.double().abs() ** 3).view(256, 4, group).sum(-1)  # float32 sums' rounding
    assert (ours <= rtn + slack).all()  # absmax / 7 is one of the candidates, and re-rounding only lowers it
    assert ours.sum() < 0.8 * rtn.sum()  # and the search finds better in most groups
    assert (ours < rtn - slack).float().mean() > 0.9


def test_the_result_does_not_depend_on_the_rows_searched_at_a_time(monkeypatch):
    torch.manual_seed(0)
    w = torch.randn(100, 192).to(torch.bfloat16)
    whole = quantize_int4(w, 64, torch.bfloat16)
    monkeypatch.setattr(quantize, "INT4_CPU_CHUNK", 3 * 192)  # 3 rows a step, the last step 1 row
    chunked = quantize_int4(w, 64, torch.bfloat16)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_group_size_0_is_one_group_a_row():
    torch.manual_seed(1)
    w = torch.randn(8, 64)
    packed, scale = quantize_int4(w, 0, torch.bfloat16)
    assert scale.shape == (8, 1)
    assert torch.equal(packed, quantize_int4(w, 64, torch.bfloat16)[0])
