"""Device dispatch decided once, when a model is placed on its device (``bind_ops``), never per step.

A layer with a CUDA kernel for part of its work names those methods in ``dispatched`` and writes each twice:
``<name>_native`` (eager torch: the CPU's path, and the reference the kernels are tested against) and
``<name>_cuda``. Each name becomes an ``Op`` on the class, which gives the native method until ``bind_ops(model,
device)`` (``CausalLM.place`` calls it) picks the device's for every layer, so a model built on the CPU and never
placed runs as it is. A layer whose op is an object rather than a method (a linear's GEMM) overrides ``bind_ops`` to
choose it. vLLM's ``CustomOp`` (``forward_native`` / ``forward_cuda``) works the same way.

The picked method is kept as a plain function, not as a bound method in the instance's attributes: a bound
method refers back to its layer, and that cycle kept a dropped model's weights (most of a GPU with a full-size
model) until the cycle collector ran, so a second engine in the same process ran out of memory.

E.g. ``RMSNorm.dispatched == ("forward", "add_forward")``: after ``bind_ops(model, torch.device("cuda"))`` every
norm's ``forward`` is its ``forward_cuda`` (one Triton kernel); on the CPU it stays ``forward_native``.
"""

from __future__ import annotations

from typing import Callable, ClassVar

import torch
from torch import nn


class Op:
    """The dispatched method ``name`` of a ``DeviceOps`` class: the function ``bind_ops`` picked for the instance
    (in its ``_ops``), else ``<name>_native``, bound to the instance when read."""

    def __init__(self, name: str) -> None:
        self.name, self.native = name, f"{name}_native"

    def __get__(self, obj: object, owner: type) -> Callable:
        if obj is None:
            return getattr(owner, self.native)
        picked = obj.__dict__.get("_ops")
        return (picked[self.name] if picked else getattr(owner, self.native)).__get__(obj, owner)


class DeviceOps:
    """A layer (or a layer's helper object) whose ops depend on the device it runs on."""

    dispatched: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for name in cls.__dict__.get("dispatched", ()):
            setattr(cls, name, Op(name))

    def bind_ops(self, device: torch.device) -> None:
        suffix = "cuda" if device.type == "cuda" else "native"
        self.__dict__["_ops"] = {name: getattr(type(self), f"{name}_{suffix}") for name in self.dispatched}


def bind_ops(model: nn.Module, device: torch.device | str) -> None:
    """Bind the ops of every layer of ``model`` for ``device``, and of the helper objects the layers hold (a fused
    q/k/v group's GEMM)."""
    device = torch.device(device)
    for module in model.modules():
        for op in (module, *vars(module).values()):
            if isinstance(op, DeviceOps):
                op.bind_ops(device)
