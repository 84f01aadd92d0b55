"""A MoE's routed experts kept quantized, INT4 (W4A16) or FP8 (W8A16): how their stacked tensors are laid out,
made, filled and read.

transformers fuses Llama-4's experts as ``gate_up_proj`` [E, H, 2I] (``x @ W``, gate columns first) and
``down_proj`` [E, I, H]: each an [E, K, N] stack. Kept quantized (``quantize_experts_layout``, on the meta device
like the linears' ``_swap_weight``), each expert's projection is stored output-major as a quantized linear's
[N, K] weight is (``kernels/quant_gemm.py``'s layouts), one expert after another:

    INT4  gate_up_proj  int32 [E, 2I, H // 8]   (rows: the expert's gate rows, then its up rows)
          gate_up_proj_scale   [E, 2I, H // G]  (the model dtype, as a linear's INT4 scales)
          gate_up_proj_zero_point  int8 [E, 2I, H // G]  (asymmetric formats only)
          down_proj     int32 [E, H, I // 8],  down_proj_scale [E, H, I // G]  (+ down_proj_zero_point)
    FP8   gate_up_proj  float8_e4m3fn [E, 2I, H],  gate_up_proj_scale float32 [E, 2I]  (one per output channel)
          down_proj     float8_e4m3fn [E, H, I],   down_proj_scale float32 [E, H]

E.g. Scout, one rank, INT4 group 128: gate_up_proj [16, 16384, 640] (671 MB) with scales [16, 16384, 40] (21 MB);
down_proj [16, 5120, 1024] (336 MB) with scales [16, 5120, 64] (10 MB): 1.04 GB a layer instead of 4.03 in bf16.
FP8: gate_up_proj [16, 16384, 5120] (1342 MB) with scales [16, 16384] (1 MB), down_proj [16, 5120, 8192]
(671 MB) with scales [16, 5120]: 2.01 GB a layer.

Under TP each rank holds every expert's slice of I (``Experts.load_shard``): gate_up's gate and up rows, down's
input columns, so an INT4 group must divide a rank's I. FP8's down scales are per output channel (H): every rank
holds them whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hybridkv.kernels.quant_gemm import dequantize_int4
from hybridkv.kv.weight_formats import WeightFormat
from hybridkv.model.quantization.checkpoint import QuantizedLinear
from hybridkv.model.quantization.quantize import dequantize_fp8, int4_scale_dtype, quantize_weight

# the parameters each stacked weight ``name`` adds to ``name`` itself when quantized
SUFFIXES = ("_scale", "_zero_point")


@dataclass(slots=True)
class StackedInt4:
    """One projection of every expert: ``packed`` int32 [E, N, K // 8], ``scale`` [E, N, K // G], ``zero`` int8
    [E, N, K // G] or None (symmetric)."""

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(packed, scale, zero): what the kernels take (``kernels/quant_moe.py``)."""
        return self.packed, self.scale, self.zero

    def select(self, experts: slice) -> StackedInt4:
        return StackedInt4(self.packed[experts], self.scale[experts],
                           None if self.zero is None else self.zero[experts])

    @property
    def group_size(self) -> int:
        return self.packed.shape[2] * 8 // self.scale.shape[2]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """[E, N, K] in ``dtype``: each expert's ``dequantize_int4``."""
        e, n, words = self.packed.shape
        flat = lambda t: None if t is None else t.reshape(e * n, -1)  # noqa: E731 (groups run along a row)
        w = dequantize_int4(flat(self.packed), flat(self.scale), flat(self.zero), self.group_size, dtype)
        return w.view(e, n, words * 8)


@dataclass(slots=True)
class StackedFp8:
    """One projection of every expert in FP8: ``weight`` float8_e4m3fn [E, N, K], ``scale`` float32 [E, N] (one per
    output channel). The same interface as ``StackedInt4``."""

    weight: torch.Tensor
    scale: torch.Tensor

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, None]:
        """(weight, scale, None): what the kernels take (``kernels/quant_moe.py``)."""
        return self.weight, self.scale, None

    def select(self, experts: slice) -> StackedFp8:
        return StackedFp8(self.weight[experts], self.scale[experts])

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """[E, N, K] in ``dtype``: each row's ``weight * scale`` in float32, rounded once (``dequantize_fp8``).

        E.g. a row stored [96, -448] with scale 0.005 -> [0.48, -2.24]."""
        e, n, k = self.weight.shape
        return dequantize_fp8(self.weight.reshape(e * n, k), self.scale.reshape(-1), dtype).view(e, n, k)


def is_stacked(module: nn.Module) -> bool:
    """``module`` holds experts as [E, K, N] stacks (it names them in ``stacked_weights``)."""
    return hasattr(module, "stacked_weights")


def quantized_stack(module: nn.Module, name: str) -> StackedInt4 | StackedFp8:
    """The quantized stack ``name`` of ``module`` (``gate_up_proj`` or ``down_proj``), by its weight's dtype."""
    weight, scale = getattr(module, name), getattr(module, name + "_scale")
    if weight.dtype == torch.float8_e4m3fn:
        return StackedFp8(weight, scale)
    return StackedInt4(weight, scale, getattr(module, name + "_zero_point", None))


def float_stack(module: nn.Module, name: str, dtype: torch.dtype, experts: slice = slice(None)) -> torch.Tensor:
    """``module``'s stack ``name`` (its ``experts``) as transformers' float [E, K, N]: the parameter itself, or
    (quantized) their weights dequantized to ``dtype`` and viewed transposed."""
    if getattr(module, "weight_format", None) is None:
        return getattr(module, name)[experts]
    return quantized_stack(module, name).select(experts).dequantized(dtype).transpose(1, 2)


def quantize_experts_layout(module: nn.Module, fmt: WeightFormat) -> None:
    """Swap ``module``'s float stacks [E, K, N] for ``fmt``'s INT4 or FP8 tensors (uninitialised, on the stacks'
    device)."""
    if not fmt.quantized:
        raise ValueError(f"{fmt.name} experts are kept in the model dtype (int4 and fp8 experts are quantized)")
    for name in module.stacked_weights:
        stack = getattr(module, name)
        e, k, n = stack.shape
        if fmt.bits == 8:
            setattr(module, name, _param((e, n, k), torch.float8_e4m3fn, stack.device))
            setattr(module, name + "_scale", _param((e, n), torch.float32, stack.device))
            continue
        groups = fmt.groups_per_row(k)
        setattr(module, name, _param((e, n, k // 8), torch.int32, stack.device))
        setattr(module, name + "_scale", _param((e, n, groups), int4_scale_dtype(stack.dtype), stack.device))
        if fmt.zero_points:
            setattr(module, name + "_zero_point", _param((e, n, groups), torch.int8, stack.device))
    module.weight_format = fmt


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _quantize_into(module: nn.Module, name: str, e: int, start: int, rows: torch.Tensor) -> None:
    """Quantize ``rows`` ([rows, K]: output rows start.. of expert ``e``) into the stack ``name``."""
    scale = getattr(module, name + "_scale")
    q, s = quantize_weight(rows, module.weight_format, scale.dtype)
    getattr(module, name)[e, start : start + q.shape[0]] = q
    scale[e, start : start + q.shape[0]] = s


@torch.no_grad()
def load_experts_quantizing(module: nn.Module, name: str, stack: torch.Tensor) -> tuple[str, ...]:
    """Quantize the float ``stack`` (this rank's [E, K, N] part of a checkpoint's fused experts) into ``module``'s
    stack ``name``, an expert at a time on the module's device; returns the parameters it filled. Groups run along
    each rank's own K (its slice of I, for down_proj), as they do for a row-parallel linear."""
    device = getattr(module, name).device
    for e in range(stack.shape[0]):
        _quantize_into(module, name, e, 0, stack[e].to(device).t().contiguous())
    zero = getattr(module, name + "_zero_point", None)
    if zero is not None:
        zero.zero_()  # quantized here symmetric: no zero point
    return tuple(name + s for s in ("", *SUFFIXES) if hasattr(module, name + s))


@torch.no_grad()
def random_quantized_experts(module: nn.Module, gen: torch.Generator, std: float = 0.02) -> None:
    """Dummy weights: N(0, std) drawn in bf16 and quantized, 64 MiB of float32 values at a time per expert (a
    Scout expert's [5120, 16384] gate/up is never whole in bf16)."""
    for name in module.stacked_weights:
        stack = getattr(module, name)
        experts, rows, cols = stack.shape
        cols *= 8 if stack.dtype == torch.int32 else 1  # INT4: 8 inputs a word
        step = max(1, (64 << 20) // (cols * 4))
        for e in range(experts):
            for start in range(0, rows, step):
                part = torch.empty(min(step, rows - start), cols, dtype=torch.bfloat16, device=stack.device)
                _quantize_into(module, name, e, start, part.normal_(0.0, std, generator=gen))
        zero = getattr(module, name + "_zero_point", None)
        if zero is not None:
            zero.zero_()


@torch.no_grad()
def round_trip_experts(module: nn.Module, fmt: WeightFormat) -> None:
    """Each float expert stack of ``module`` replaced by its ``fmt`` values (quantized and dequantized again, an
    expert at a time): what a GPU keeping them quantized computes with, in the model dtype."""
    for name in module.stacked_weights:
        stack = getattr(module, name)
        for e in range(stack.shape[0]):
            q, s = quantize_weight(stack[e].t().contiguous(), fmt, int4_scale_dtype(stack.dtype))
            stack[e].copy_(QuantizedLinear(q, s).dequantized(stack.dtype).t())
