"""Llama's RMSNorm: ``x * rsqrt(mean(x^2) + eps) * w`` with float32 statistics, in eager torch or (placed on CUDA)
one Triton kernel (``kernels/rms_norm.py``), which also fuses the residual add before it.

E.g. x = [3, 4], w = [1, 2], eps 0: rms = sqrt((9 + 16) / 2) = 3.54, so [0.85, 2.26].
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.model.architectures.device_ops import DeviceOps
from hybridkv.model.architectures.parallel import TPGroup


class RMSNorm(DeviceOps, nn.Module):
    dispatched = ("forward", "add_forward")

    def __init__(self, size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if x.dtype == weight.dtype == torch.float32:
            # the same arithmetic as below (float32 statistics, then the weight) in one call: fewer small ops
            return torch.rms_norm(x, weight.shape, weight, self.eps)
        return unit_rms(x, self.eps) * weight

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        from hybridkv.kernels.rms_norm import rms_norm  # triton is only needed on GPU

        return rms_norm(x, self.eps, self.weight)

    def add_forward_native(self, x: torch.Tensor, residual: torch.Tensor, tp: TPGroup | None = None,
                           out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): a layer's residual add and the next norm, the norm into ``out`` if
        given. ``tp`` while it is ``summing_in_norms``: ``x`` is this rank's part of a sum over ranks, which the
        same kernel sums (or while ``pushing_half``)."""
        if tp is not None and tp.sums_in_norms:
            return tp.add_norm(x, residual, self.weight, self.eps, out), residual
        residual = x + residual
        y = self.forward_native(residual)  # (no hooks on a norm: nn.Module's call is ~10 us a layer on CPU)
        return (y if out is None else out.copy_(y)), residual

    def add_forward_cuda(self, x: torch.Tensor, residual: torch.Tensor, tp: TPGroup | None = None,
                         out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``add_forward_native`` in one kernel, which leaves the sum in ``residual``'s memory."""
        if tp is not None and tp.sums_in_norms:
            return tp.add_norm(x, residual, self.weight, self.eps, out), residual
        from hybridkv.kernels.rms_norm import rms_norm

        return rms_norm(x, self.eps, self.weight, residual=residual, out=out), residual



def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x^2) + eps)`` over the last dim, no weight; float32 statistics so bf16/fp16 models
    normalise like transformers does."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def unit_rms_kernel(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``unit_rms`` on CUDA, in the RMSNorm kernel."""
    from hybridkv.kernels.rms_norm import rms_norm  # triton is only needed on GPU

    return rms_norm(x, eps)
