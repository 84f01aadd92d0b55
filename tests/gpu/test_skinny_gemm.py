"""The decode-sized GEMM against float64 ``x @ W^T + b``: float32 (IEEE dots) to rounding, bf16 to its rounding;
its K-splits summed in a fixed order (the same bits on every call) and its arrival counters left at zero."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from hybridkv.kernels.skinny_gemm import MAX_ROWS, skinny_gemm, skinny_gemm_counters, skinny_gemm_fits  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n,k,bias,tile", [
    (1, 896, 5120, False, None),                # a Scout rank's q/k/v at batch 1: many K-splits
    (1, 5120, 640, False, None),                # its o projection: many column tiles, few splits
    (MAX_ROWS, 200, 300, True, None),           # N and K not multiples of the tiles, a bias
    (5, 77, 1000, True, (16, 256, 4, 4, 3)),
    (3, 64, 96, False, (32, 64, 1, 4, 2)),      # one split: no partials, no counters
])
def test_matches_reference(dtype, rows, n, k, bias, tile):
    if INTERPRET and (dtype == torch.bfloat16 or k > 1000):
        pytest.skip("the interpreter gets bf16 dots wrong, and large shapes take minutes there")
    torch.manual_seed(rows * 1000 + n)
    x = torch.randn(rows, k).to(dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    b = torch.randn(n).to(dtype) if bias else None
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    arrived = skinny_gemm_counters(n, DEVICE)
    xd, wd, bd = x.to(DEVICE), w.to(DEVICE), b.to(DEVICE) if bias else None
    assert skinny_gemm_fits(xd, wd) or INTERPRET
    got = skinny_gemm(xd, wd, bd, arrived, tile)
    assert not arrived.any()  # left as found: the next launch's counters start at zero
    assert got.shape == (rows, n) and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.cpu().double(), want, rtol=1e-5, atol=1e-5)
    else:
        # bf16 output: within one rounding of the exact value (plus float32 accumulation)
        torch.testing.assert_close(got.cpu().double(), want, rtol=8e-3, atol=1e-2)
    assert torch.equal(skinny_gemm(xd, wd, bd, arrived, tile), got)


@pytest.mark.skipif(INTERPRET, reason="only CUDA inputs fit")
def test_fits_only_decode_sized_inputs():
    w = torch.zeros(32, 64, device=DEVICE)
    assert skinny_gemm_fits(torch.zeros(MAX_ROWS, 64, device=DEVICE), w)
    assert not skinny_gemm_fits(torch.zeros(MAX_ROWS + 1, 64, device=DEVICE), w)
    assert not skinny_gemm_fits(torch.zeros(0, 64, device=DEVICE), w)
    assert not skinny_gemm_fits(torch.zeros(64, 4, device=DEVICE).t(), w)  # K not contiguous
    assert not skinny_gemm_fits(torch.zeros(2, 64, device=DEVICE, dtype=torch.bfloat16), w)


def test_too_few_counters_is_refused():
    x, w = torch.zeros(1, 64, device=DEVICE), torch.zeros(512, 64, device=DEVICE)
    with pytest.raises(ValueError, match="arrival counters"):
        skinny_gemm(x, w, None, torch.zeros(1, dtype=torch.int32, device=DEVICE))
