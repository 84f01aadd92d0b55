"""Linear layers that keep their weights quantized (on a GPU), and how their tensors are made, filled and run.

``quantize_layout(model, fmt)`` runs on a model still on the meta device (``factory.build_model``): every linear of
attention and the MLPs (``ColumnParallelLinear``, ``RowParallelLinear``) not in the format's ignore list swaps its
``weight`` for the format's tensors, so the model is allocated at its quantized size. For a [N, K] linear:

    FP8:  weight e4m3 [N, K], weight_scale float32 [N] (+ input_scale float32 [1], static activations)
    INT4: weight int32 [N, K // 8] (``kernels/quant_gemm.py``), weight_scale [N, K // G] bf16
          (fp16 models: fp16; a checkpoint's: as stored)
          (+ weight_zero_point int8 [N, K // G], asymmetric)

A MoE's routed experts (a module of ``kinds`` with ``stacked_weights``) are stacked INT4 or FP8 tensors
(``quantized_experts.py``). The router, embeddings, LM head and norms
are left in the model dtype. A quantized linear then loads a quantized checkpoint's tensors as they come
(``checkpoint.QuantizedReader``), or quantizes a float weight as it loads (``load_quantizing``).

Its GEMM (``quantized_gemm``) is chosen when the model is placed, as every linear's: on CUDA the INT4 and FP8
kernels (``kernels/quant_gemm.py``); elsewhere the weight dequantized, then ``F.linear`` (the reference).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kv.weight_formats import WeightFormat
from hybridkv.model.quantization.checkpoint import QuantizedLinear
from hybridkv.model.quantization.quantize import fake_quantize_fp8, int4_scale_dtype, quantize_weight
from hybridkv.model.quantization.quantized_experts import (
    is_stacked, load_experts_quantizing, quantize_experts_layout, random_quantized_experts, round_trip_experts,
)

QUANT_PARAMS = ("weight_scale", "weight_zero_point", "input_scale")


def quantizable_linears(model: nn.Module, fmt: WeightFormat, kinds: tuple[type, ...]) -> list[tuple[str, nn.Linear]]:
    """(name, linear) of every linear of ``kinds`` (the tensor-parallel linears of attention and MLPs, not the
    router; and the experts, where the format quantizes them) less those the format's ignore list names (matched
    against transformers' names too; experts by their fused names and expert 0's own)."""
    found = []
    for name, module in model.named_modules():
        if not isinstance(module, kinds) or (is_stacked(module) and not fmt.quantized):
            continue
        names = (name, f"model.{name}", f"model.{name}".replace(".mlp.", ".feed_forward."))
        if is_stacked(module):
            names = tuple(f"{n}{part}" for n in names for part in ("", ".gate_up_proj", ".down_proj",
                                                                     ".0.gate_proj", ".0.up_proj", ".0.down_proj"))
        if not any(fmt.keeps_unquantized(n) for n in names):
            found.append((name, module))
    return found


def quantize_layout(model: nn.Module, fmt: WeightFormat, kinds: tuple[type, ...]) -> int:
    """Swap the weights of ``model``'s quantizable linears (of ``kinds``) for ``fmt``'s tensors (uninitialised, on
    the weights' device: meta before ``to_empty``); returns how many linears were swapped."""
    linears = quantizable_linears(model, fmt, kinds)
    for _, linear in linears:
        (quantize_experts_layout if is_stacked(linear) else _swap_weight)(linear, fmt)
    return len(linears)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


def _swap_weight(linear: nn.Linear, fmt: WeightFormat) -> None:
    rows, cols = linear.weight.shape
    device, model_dtype = linear.weight.device, linear.weight.dtype
    if fmt.bits == 8:
        linear.weight = _param((rows, cols), torch.float8_e4m3fn, device)
        linear.weight_scale = _param((rows,), torch.float32, device)
        if not fmt.dynamic_activations:
            linear.input_scale = _param((1,), torch.float32, device)
    else:
        groups = fmt.groups_per_row(cols)
        linear.weight = _param((rows, cols // 8), torch.int32, device)
        linear.weight_scale = _param((rows, groups), int4_scale_dtype(model_dtype), device)
        if fmt.zero_points:
            linear.weight_zero_point = _param((rows, groups), torch.int8, device)
    linear.weight_format = fmt


def is_quantized(linear: nn.Module) -> bool:
    return getattr(linear, "weight_format", None) is not None


def quantized_tensors(linear: nn.Module) -> QuantizedLinear:
    """The quantized linear's tensors (a fused group's too, once ``FusedColumns.fuse`` has joined them)."""
    return QuantizedLinear(linear.weight, linear.weight_scale, getattr(linear, "weight_zero_point", None),
                           getattr(linear, "input_scale", None))


@torch.no_grad()
def load_quantizing(linear: nn.Module, weight: torch.Tensor, name: str = "weight") -> tuple[str, ...]:
    """Quantize the float ``weight`` (this rank's [N, K] part; for experts, the [E, K, N] stack ``name``) into the
    quantized ``linear``; returns the names of the parameters it filled. Quantized by column slices of a rank's own
    part, so an INT4 group never spans two ranks' columns (``K`` of each rank a multiple of the group, or the
    quantizer says so)."""
    if is_stacked(linear):
        return load_experts_quantizing(linear, name, weight)
    fmt: WeightFormat = linear.weight_format
    if fmt.bits == 8 and not fmt.dynamic_activations:
        raise ValueError("FP8 with static activation scales needs a checkpoint that holds them (input_scale)")
    q, scale = quantize_weight(weight.to(linear.weight.device), fmt, linear.weight_scale.dtype)
    linear.weight.copy_(q)
    linear.weight_scale.copy_(scale)
    return ("weight", "weight_scale")


@torch.no_grad()
def random_quantized(linear: nn.Module, gen: torch.Generator, std: float = 0.02) -> None:
    """Dummy weights: N(0, std) drawn in the model dtype and quantized, a few rows at a time (a full-size weight is
    never whole in bf16)."""
    if is_stacked(linear):
        random_quantized_experts(linear, gen, std)
        return
    rows, _ = linear.weight.shape
    cols = linear.in_features
    dtype = torch.bfloat16
    step = max(1, (64 << 20) // (cols * 4))
    for start in range(0, rows, step):
        part = torch.empty(min(step, rows - start), cols, dtype=dtype, device=linear.weight.device)
        part.normal_(0.0, std, generator=gen)
        q, scale = quantize_weight(part, linear.weight_format, linear.weight_scale.dtype)
        linear.weight[start : start + len(part)] = q
        linear.weight_scale[start : start + len(part)] = scale
    if getattr(linear, "weight_zero_point", None) is not None:
        linear.weight_zero_point.zero_()
    if getattr(linear, "input_scale", None) is not None:
        linear.input_scale.fill_(1.0)


def quantized_gemm_native(linear: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The reference: the weight dequantized to ``x``'s dtype, then ``F.linear``. FP8 activations are quantized
    per token first, as the kernels do, so the reference computes what they compute."""
    tensors = quantized_tensors(linear)
    if tensors.is_fp8:
        x = fake_quantize_fp8(x, tensors.input_scale)
    return F.linear(x, tensors.dequantized(x.dtype), bias)


def quantized_gemm_cuda(linear: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
                        arrived: torch.Tensor | None = None) -> torch.Tensor:
    """The kernels: ``fp8_linear``, or ``int4_gemm`` with the linear's arrival counters ``arrived``."""
    from hybridkv.kernels.quant_gemm import fp8_linear, int4_gemm  # triton is only needed on GPU

    t = quantized_tensors(linear)
    if t.is_fp8:
        return fp8_linear(x, t.weight, t.scale, t.input_scale, bias)
    return int4_gemm(x, t.weight, t.scale, t.zero, linear.weight_format.group_size, bias, arrived)


class QuantizedGemm:
    """A quantized linear's GEMM ``(x, weight, bias) -> y`` (the signature of every linear's, ``parallel.gemm_for``):
    ``weight`` is the owner's own, read with its scales from the owner, so a fused group's GEMM reads the joined
    tensors. On CUDA it holds the INT4 kernel's arrival counters (made at the first call)."""

    def __init__(self, owner: nn.Module, device: torch.device) -> None:
        # a proxy: the owner holds this GEMM, and a strong reference back would be a cycle keeping a dropped
        # model's quantized weights until the cycle collector runs (device_ops.py)
        self.owner = weakref.proxy(owner)
        self.cuda = device.type == "cuda"
        # INT4 kernels split K with counters; FP8's go to _scaled_mm (decided once, not per call)
        self.int4 = is_quantized(owner) and owner.weight_format.bits == 4
        self.arrived: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self.cuda:
            return quantized_gemm_native(self.owner, x, bias)
        if self.arrived is None and self.int4:
            from hybridkv.kernels.quant_triton import int4_gemm_counters  # GPU only

            self.arrived = int4_gemm_counters(weight.shape[0], x.device)
        return quantized_gemm_cuda(self.owner, x, bias, self.arrived)


@torch.no_grad()
def round_trip_linears(model: nn.Module, fmt: WeightFormat, kinds: tuple[type, ...]) -> int:
    """Each of ``model``'s quantizable float linears (of ``kinds``) given its weight quantized to ``fmt`` and
    dequantized again: the values a quantized model computes with, in the model dtype; returns how many."""
    linears = quantizable_linears(model, fmt, kinds)
    for _, linear in linears:
        if is_stacked(linear):
            round_trip_experts(linear, fmt)
            continue
        w = linear.weight
        q, scale = quantize_weight(w, fmt, int4_scale_dtype(w.dtype))
        w.copy_(QuantizedLinear(q, scale).dequantized(w.dtype))
    return len(linears)


def move_model(model: nn.Module, device: torch.device | str, dtype: torch.dtype | None) -> None:
    """``model`` to ``device``, its float tensors cast to ``dtype`` (None: kept) but a quantized linear's (or
    experts') own: e4m3 weights and float32 FP8 scales stay as they are (``Module.to`` would cast e4m3 too: it is a
    float dtype); INT4 scales take ``dtype``, the activations' dtype the INT4 kernel reads them in."""
    if dtype is not None:  # cast where the tensors are, then move: no tensor is on the device twice
        kept = {id(p) for m in model.modules() if is_quantized(m) for n, p in m.named_parameters(recurse=False)
                if p.dtype == torch.float8_e4m3fn or n == "input_scale"
                or (n.endswith("_scale") and m.weight_format.bits == 8)}
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.is_floating_point() and id(tensor) not in kept and tensor.dtype != dtype:
                tensor.data = tensor.data.to(dtype)
    model.to(device=device)
