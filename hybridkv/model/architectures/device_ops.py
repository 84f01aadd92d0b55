"""Device dispatch decided once, when a model is placed on its device (``bind_ops``), never per step.

A layer with a CUDA kernel for part of its work names those methods in ``dispatched`` and writes each twice:
``<name>_native`` (eager torch: the CPU's path, and the reference the kernels are tested against) and
``<name>_cuda``. The class points each name at its native method, so a model built on the CPU and never placed
runs as it is; ``bind_ops(model, device)`` (``CausalLM.place`` calls it) points every layer's at the device's. A
layer whose op is an object rather than a method (a linear's GEMM) overrides ``bind_ops`` to choose it. vLLM's
``CustomOp`` (``forward_native`` / ``forward_cuda``) works the same way.

E.g. ``RMSNorm.dispatched == ("forward", "add_forward")``: after ``bind_ops(model, torch.device("cuda"))`` every
norm's ``forward`` is its ``forward_cuda`` (one Triton kernel); on the CPU it stays ``forward_native``.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn


class DeviceOps:
    """A layer (or a layer's helper object) whose ops depend on the device it runs on."""

    dispatched: ClassVar[tuple[str, ...]] = ()

    def bind_ops(self, device: torch.device) -> None:
        suffix = "cuda" if device.type == "cuda" else "native"
        for name in self.dispatched:
            setattr(self, name, getattr(self, f"{name}_{suffix}"))


def bind_ops(model: nn.Module, device: torch.device | str) -> None:
    """Bind the ops of every layer of ``model`` for ``device``, and of the helper objects the layers hold (a fused
    q/k/v group's GEMM)."""
    device = torch.device(device)
    for module in model.modules():
        for op in (module, *vars(module).values()):
            if isinstance(op, DeviceOps):
                op.bind_ops(device)
