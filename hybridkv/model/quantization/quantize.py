"""Quantizing float weights at load (``--quantization fp8 | int4`` on a bf16 checkpoint), as vLLM's ``fp8`` and a
symmetric W4A16 checkpoint do it.

FP8: one float32 scale per output row, ``absmax / 448`` (448: e4m3's largest finite value); a row of zeros gets
scale 1. E.g. the row [0.5, -2.24] -> scale 0.005, stored [96, -448]
(100 is not an e4m3 value: 96 is the nearest). INT4: one scale per group of ``group_size`` inputs, q the nearest
of [-8, 7] (symmetric: no zero point), the scale searched per group (``int4_scale_search``) rather than
compressed-tensors' ``absmax / 7``, which never uses -8. A scale is negative where the search maps a group's
positive extreme to -8: ``q * scale`` reads it as it reads any other.
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


# The searched INT4 scales map the group's value of largest magnitude, m, to q = m / scale = t for each t here:
# 7 is absmax / 7 (the sign of t does not matter while |t| <= 7); -8 is llama.cpp's Q4_0 (m / -8, so the range is
# used fully: the scale is negative when m is); beyond, m is clipped (to 7 or -8) for a finer step for the rest.
INT4_TARGETS = (7.0, 7.5, -7.5, 8.0, -8.0, 8.5, -8.5, 9.0, -9.0)
# Weights searched at a time: on a CPU few enough that the search's float32 temporaries (4 MiB each) stay in its
# caches; on a GPU enough that each of the hundreds of kernels a step launches has work (64 MiB each, less than one
# [5120, 16384] expert in float32 would take whole).
INT4_CPU_CHUNK, INT4_GPU_CHUNK = 1 << 20, 1 << 24


def quantize_int4(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (packed int32 [N, K // 8], scales [N, K // group_size] in ``scale_dtype``): each group's scale
    from ``int4_scale_search``, rounded to ``scale_dtype`` before the weights are divided by it, so dequantizing
    (``q * scale``) gives the nearest of the group's 16 values. A few rows at a time (``INT4_CPU_CHUNK`` weights).

    E.g. the group [-0.8, 0.1, 0.3, 0.7], bf16 scales: absmax / 7 would be 0.1143 (bf16 0.11426), q [-7, 1, 3, 6],
    errors up to 0.043; the search picks m / -8 = 0.1 (bf16 0.10010), q [-8, 1, 3, 7], errors at most 0.0008.
    [0.8, -0.7, 0.3, -0.1] -> scale -0.10010, q [-8, 7, -3, 1] (-8 is the positive extreme's)."""
    rows, cols = weight.shape
    if group_size <= 0:
        group_size = cols
    if cols % group_size:
        raise ValueError(f"{cols} input features are not a multiple of the quantization group {group_size}")
    q = torch.empty(rows, cols, dtype=torch.int8, device=weight.device)
    scale = torch.empty(rows, cols // group_size, dtype=scale_dtype, device=weight.device)
    step = max(1, (INT4_CPU_CHUNK if weight.device.type == "cpu" else INT4_GPU_CHUNK) // cols)
    for start in range(0, rows, step):
        groups = weight[start : start + step].float().view(-1, cols // group_size, group_size)
        part = int4_scale_search(groups, scale_dtype)
        q[start : start + step] = nearest_int4(groups, part).view(-1, cols)
        scale[start : start + step] = part
    return pack_int4(q), scale


def int4_scale_search(groups: torch.Tensor, scale_dtype: torch.dtype) -> torch.Tensor:
    """float32 [..., G] -> the scale of each group (``scale_dtype``) with the least error ``sum |w| (w - q s)^2``,
    q the nearest for s: weighted by |w| as llama.cpp's k-quant searches weight theirs (plain squared error clips
    a group's outliers, and measured worse). Candidates, per ``t`` of ``INT4_TARGETS``: s = m / t (m the group's
    value of largest magnitude), then s refitted by least squares to the q it gave, ``sum |w| w q / sum |w| q^2``;
    each candidate's error is that of its own nearest q. ``absmax / 7`` is one candidate (t = 7; for a negative m
    negated, q mirrored: the same error), so no group ends with more error than it gave. A group of zeros gets
    scale 1."""
    importance = groups.abs()
    weighted = importance * groups
    extreme = groups.gather(-1, importance.argmax(-1, keepdim=True))[..., 0]
    best_scale = torch.ones_like(extreme, dtype=scale_dtype)
    best_error = torch.full_like(extreme, torch.inf)
    for t in INT4_TARGETS:
        scale = _nonzero((extreme / t).to(scale_dtype))
        error, wq, qq = _weighted_error(groups, importance, weighted, scale)
        refit = _nonzero(torch.where(qq > 0, wq / qq, scale.float()).to(scale_dtype))  # qq = 0: a group of zeros
        refit_error, _, _ = _weighted_error(groups, importance, weighted, refit)
        for s, e in ((scale, error), (refit, refit_error)):
            better = e < best_error
            best_scale, best_error = torch.where(better, s, best_scale), torch.where(better, e, best_error)
    return best_scale


def _weighted_error(groups: torch.Tensor, importance: torch.Tensor, weighted: torch.Tensor, scale: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group, with q = ``nearest_int4(groups, scale)``: ``sum |w| (w - q s)^2`` less ``sum |w| w^2`` (the same
    for every scale), from ``sum |w| w q`` and ``sum |w| q^2``, which it returns too (the least-squares refit's)."""
    q = nearest_int4(groups, scale)
    wq, qq = (weighted * q).sum(-1), (importance * q * q).sum(-1)
    s = scale.float()
    return s * (s * qq - 2 * wq), wq, qq


def nearest_int4(groups: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 [..., G] and a scale per group -> the nearest q in [-8, 7] of each weight (float32; ties to even)."""
    return torch.round(groups / scale.float()[..., None]).clamp_(-8, 7)


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    """A zero scale (a group of zeros, or one too small for the dtype) replaced by 1: its q are all 0 either way."""
    return torch.where(scale != 0, scale, torch.ones_like(scale))


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
