"""Quantizing float weights at load (``--quantization fp8 | int4`` on a bf16 checkpoint), as vLLM's ``fp8`` and a
symmetric W4A16 checkpoint do it.

FP8: one float32 scale per output row, ``absmax / 448`` (448: e4m3's largest finite value); a row of zeros gets
scale 1. E.g. the row [0.5, -2.24] -> scale 0.005, stored [96, -448]
(100 is not an e4m3 value: 96 is the nearest). INT4: one scale per group of
``group_size`` inputs, ``absmax / 7``, rounded to the nearest of [-8, 7] (-8 is never used: symmetric, as
compressed-tensors' W4A16 preset). E.g. a group [0.7, -0.35, 0.1] -> scale 0.1, q [7, -4 (-3.5 rounds to even), 1].
"""

from __future__ import annotations

import torch

from hybridkv.kernels.quant_gemm import FP8_MAX, pack_int4, quantize_fp8_per_token_reference
from hybridkv.kv.weight_formats import WeightFormat


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (float8_e4m3fn [N, K], float32 scales [N])."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def quantize_int4(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (packed int32 [N, K // 8], scales [N, K // group_size] in ``scale_dtype``); the scales are rounded
    to ``scale_dtype`` before the weights are divided by them, so dequantizing gives the nearest 4-bit values."""
    rows, cols = weight.shape
    if group_size <= 0:
        group_size = cols
    if cols % group_size:
        raise ValueError(f"{cols} input features are not a multiple of the quantization group {group_size}")
    groups = weight.float().view(rows, cols // group_size, group_size)
    scale = (groups.abs().amax(dim=-1) / 7).to(scale_dtype)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(groups / scale.float()[:, :, None]).clamp(-8, 7).to(torch.int8)
    return pack_int4(q.view(rows, cols)), scale


def quantize_weight(weight: torch.Tensor, fmt: WeightFormat, int4_scale: torch.dtype = torch.bfloat16
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (weight, scales) in ``fmt``: FP8's ``quantize_fp8``, else INT4's ``quantize_int4`` in groups of
    ``fmt.group_size`` with ``int4_scale`` scales (symmetric: no zero point)."""
    if fmt.bits == 8:
        return quantize_fp8(weight)
    return quantize_int4(weight, fmt.group_size, int4_scale)


def int4_scale_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of INT4 scales quantized here: float16 for a float16 model, else bfloat16 (as W4A16 checkpoints
    store them; a float32 model on the CPU then computes with the values a GPU would)."""
    return torch.float16 if model_dtype == torch.float16 else torch.bfloat16


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight ``weight * scale`` (scale [N], [N, 1] or one) in ``dtype``."""
    scale = scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float().reshape(1, 1)
    return (weight.float() * scale).to(dtype)


def fake_quantize_fp8(x: torch.Tensor, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Activations [M, K] as FP8 W8A8 sees them (``quantize_fp8_per_token_reference``: per token, or one static
    ``input_scale``), scaled back to ``x``'s dtype. The reference of the FP8 GEMM."""
    q, scale = quantize_fp8_per_token_reference(x.reshape(-1, x.shape[-1]), input_scale)
    return (q.float() * scale).to(x.dtype).view(x.shape)
