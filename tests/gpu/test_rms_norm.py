"""The fused RMSNorm kernel against the eager torch arithmetic it replaces (``unit_rms`` times the weight)."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (torch.cuda.is_available() or INTERPRET):
    pytest.skip("needs CUDA (or TRITON_INTERPRET=1)", allow_module_level=True)
pytest.importorskip("triton")

from hybridkv.kernels.rms_norm import rms_norm  # noqa: E402
from hybridkv.model.architectures.norms import unit_rms  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"
# bitwise on a GPU; Triton 3.6's interpreter rounds float32 -> bf16 its own way (one bf16 step apart at most)
EXACT_ROUNDING = dict(rtol=8e-3, atol=0) if INTERPRET else dict(rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(37, 5120), (37, 5, 128), (3, 576)])
def test_matches_eager_torch(dtype, shape):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 3 + 0.5).to(dtype)
    w = torch.randn(shape[-1]).to(dtype)
    expected = unit_rms(x, 1e-5) * w  # CPU: the eager path
    got = rms_norm(x.to(DEVICE), 1e-5, w.to(DEVICE)).cpu()
    unweighted = rms_norm(x.to(DEVICE), 1e-5).cpu()
    assert got.dtype == dtype and got.shape == x.shape
    # bf16: the row statistics are summed in another order, which may move each of the two roundings by one step
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(got, expected, **tol)
    torch.testing.assert_close(unweighted, unit_rms(x, 1e-5), **tol)


def test_non_contiguous_rows():
    x = torch.randn(8, 2, 256)[:, 0, :]  # rows 512 apart
    torch.testing.assert_close(rms_norm(x.to(DEVICE), 1e-6).cpu(), unit_rms(x, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_residual_add_then_norm(dtype):
    """``residual=``: normalises x + residual and leaves the sum (rounded as eager torch's add) in residual."""
    torch.manual_seed(2)
    x, residual = (torch.randn(5, 320) * 3).to(dtype), torch.randn(5, 320).to(dtype)
    w = torch.randn(320).to(dtype)
    total = x + residual
    res = residual.to(DEVICE)
    got = rms_norm(x.to(DEVICE), 1e-5, w.to(DEVICE), residual=res).cpu()
    torch.testing.assert_close(res.cpu(), total, **EXACT_ROUNDING)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-2)
    torch.testing.assert_close(got, unit_rms(total, 1e-5) * w, **tol)


def test_into_rows_of_a_larger_tensor():
    """``out=``: the norm lands in the given rows (a prefill half's rows of the step's MoE input), nowhere else."""
    torch.manual_seed(3)
    x, w = torch.randn(6, 320, device=DEVICE), torch.randn(320, device=DEVICE)
    whole = torch.full((10, 320), 7.0, device=DEVICE)
    got = rms_norm(x, 1e-5, w, out=whole[4:])
    assert got.data_ptr() == whole[4:].data_ptr()
    torch.testing.assert_close(whole[4:], rms_norm(x, 1e-5, w), rtol=0, atol=0)
    assert bool((whole[:4] == 7.0).all())
    with pytest.raises(ValueError, match="out must be contiguous"):
        rms_norm(x, 1e-5, w, out=whole[:, :300])


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs Hopper or newer")
def test_programmatic_launches_read_what_the_kernel_before_wrote():
    """Launched programmatically dependent (``kernels/launch.py``), a kernel starts before the one before it ends,
    and must still read what that one wrote. 64 norms in a CUDA graph, each reading the row the one before wrote
    and the residual it updated in place, give bit for bit what the same launches give one at a time."""
    from hybridkv.kernels.launch import pdl

    torch.manual_seed(3)
    x0, r0 = (torch.randn(4, 5120, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(5120, device="cuda", dtype=torch.bfloat16)
    assert pdl(x0)
    want, want_r = x0.clone(), r0.clone()
    for _ in range(64):  # compiles the kernel too, before the graph captures it
        want = rms_norm(want, 1e-5, w, residual=want_r)
        torch.cuda.synchronize()
    static_x, static_r = x0.clone(), r0.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = static_x
        for _ in range(64):
            out = rms_norm(out, 1e-5, w, residual=static_r)
    static_x.copy_(x0)
    static_r.copy_(r0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want) and torch.equal(static_r, want_r)
    assert not torch.equal(want_r, r0)  # the chain did move the residual
