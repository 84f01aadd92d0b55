"""Position encoding of q and k in one launch per layer: RoPE, Llama-4's QK-norm and its NoPE layers' attention
temperature, each (token, head) row read once and written once.

Eager torch spends about ten launches per tensor on it (upcast, two products per half, a difference, a sum, a
stack, a downcast, then the norm): at decode, ~20 tiny kernels per layer, a large share of a step's launches.

Same arithmetic as ``llama.rope_interleaved`` / ``rope_halves``, ``unit_rms`` and ``temperature_scales`` (float32
inside, each stage rounded to the input dtype where eager torch rounds); ``cos``/``sin`` are the step's
``rope_cos_sin`` tables, shared by every layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.kernels.launch import pdl, pdl_start


@triton.jit
def rope_qk_kernel(
    q_ptr, k_ptr, q_out, k_out, cos_ptr, sin_ptr, scale_ptr,
    stride_qt, stride_kt, stride_cos, num_q_heads, eps,
    D: tl.constexpr, ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr, QK_NORM: tl.constexpr,
    TEMPERATURE: tl.constexpr, PDL: tl.constexpr = False,
):
    """Program (token t, head h): h < num_q_heads is q's head h, the rest are k's heads."""
    if PDL:
        pdl_start()
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    is_q = h < num_q_heads
    if is_q:
        src = q_ptr + t * stride_qt + h * D
        dst = q_out + (t * num_q_heads + h) * D
    else:
        kh = h - num_q_heads
        src = k_ptr + t * stride_kt + kh * D
        dst = k_out + (t * (tl.num_programs(1) - num_q_heads) + kh) * D
    dtype = q_out.dtype.element_ty
    HALF: tl.constexpr = D // 2
    # the two members of each rotated pair: (2i, 2i+1), or (i, i + D/2)
    i = tl.arange(0, HALF)
    if INTERLEAVED:
        first = 2 * i
        second = 2 * i + 1
    else:
        first = i
        second = i + HALF
    a = tl.load(src + first).to(tl.float32)
    b = tl.load(src + second).to(tl.float32)
    if ROTATE:
        c = tl.load(cos_ptr + t * stride_cos + i)
        s = tl.load(sin_ptr + t * stride_cos + i)
        a, b = a * c - b * s, a * s + b * c
        a = a.to(dtype).to(tl.float32)
        b = b.to(dtype).to(tl.float32)
        if QK_NORM:
            inv = tl.rsqrt((tl.sum(a * a, 0) + tl.sum(b * b, 0)) / D + eps)
            a = (a * inv).to(dtype).to(tl.float32)
            b = (b * inv).to(dtype).to(tl.float32)
    elif TEMPERATURE and is_q:
        scale = tl.load(scale_ptr + t)
        a = a * scale
        b = b * scale
    tl.store(dst + first, a.to(dtype))
    tl.store(dst + second, b.to(dtype))


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, rotate: bool,
            interleaved: bool, qk_norm: bool = False, eps: float = 1e-6,
            temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) [T, heads, D] from ``q``/``k`` [T, heads, D] (rows may be strided views of a fused QKV output).
    ``rotate``: RoPE by ``cos``/``sin`` [T, 1, D/2] (then QK-norm when ``qk_norm``), both new tensors; else q
    times ``temperature`` [T, 1, 1] (a new q) and k as it is."""
    tokens, q_heads, d = q.shape
    k_heads = k.shape[1]
    if q.stride(-1) != 1 or q.stride(1) != d or k.stride(-1) != 1 or k.stride(1) != d:
        raise ValueError("rope_qk needs each token's heads contiguous")
    if not rotate and temperature is None:
        return q, k
    q_out = torch.empty((tokens, q_heads, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((tokens, k_heads, d), dtype=k.dtype, device=k.device) if rotate else k
    if tokens == 0:
        return q_out, k_out
    scale = temperature.reshape(-1) if temperature is not None else cos
    on = pdl(q)
    rope_qk_kernel[(tokens, q_heads + (k_heads if rotate else 0))](
        q, k, q_out, k_out, cos, sin, scale, q.stride(0), k.stride(0), cos.stride(0), q_heads, eps,
        D=d, ROTATE=rotate, INTERLEAVED=interleaved, QK_NORM=qk_norm, TEMPERATURE=temperature is not None,
        PDL=on, num_warps=1, launch_pdl=on,
    )
    return q_out, k_out
