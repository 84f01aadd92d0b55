"""Fused RMSNorm for CUDA: one pass over each row instead of eager torch's seven (upcast, square, mean, rsqrt,
scale, downcast, weight), which made norms the largest non-GEMM cost of a long prefill.

Same arithmetic as ``hybridkv.model.architectures.llama.unit_rms`` followed by the weight: statistics in float32, the normalised
row rounded to the input dtype, then multiplied by the weight and rounded again (transformers' order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.kernels.launch import pdl, pdl_start


@triton.jit
def rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, res_ptr, num_rows, stride_x, stride_o, stride_r, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, HAS_WEIGHT: tl.constexpr, ADD: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """ROWS rows of N elements per program. ``ADD``: the row is x + residual (rounded to the dtype, as eager
    torch's sum), written back to the residual before it is normalised."""
    if PDL:
        pdl_start()
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    ok = (rows < num_rows) & (cols < N)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=ok, other=0.0)
    if ADD:
        r = tl.load(res_ptr + rows * stride_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + rows * stride_r + cols, x, mask=ok)
    x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 1) / N + eps)
    y = (x * inv_rms[:, None]).to(out_ptr.dtype.element_ty)
    if HAS_WEIGHT:
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0)
        y = (y.to(tl.float32) * w.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows * stride_o + cols, y, mask=ok)


def rms_norm(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm over the last dimension of ``x`` (any leading shape), times ``weight`` when given; into ``out``
    (contiguous, x's shape and dtype) when given.

    With ``residual`` (contiguous, x's shape): normalises ``x + residual`` and leaves that sum in ``residual``
    (a decoder layer's residual add and the next norm in one pass)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if out is None:
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    elif not out.is_contiguous() or out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must be contiguous {x.dtype} {tuple(x.shape)}, got {out.dtype} {tuple(out.shape)}")
    out = out.view(rows.shape)
    res = out if residual is None else residual.view(-1, n)
    block = triton.next_power_of_2(n)
    per_program = max(1, min(16, 4096 // block))  # short rows (QK-norm's head_dim) share a program
    grid = (triton.cdiv(rows.shape[0], per_program),)
    on = pdl(x)
    rms_norm_kernel[grid](
        rows, out if weight is None else weight, out, res, rows.shape[0], rows.stride(0), out.stride(0),
        res.stride(0), eps, N=n, BLOCK=block, ROWS=per_program, HAS_WEIGHT=weight is not None,
        ADD=residual is not None, PDL=on, num_warps=8 if block >= 4096 else 4, launch_pdl=on,
    )
    return out.view(x.shape)
