"""Linear layers over quantized weights: INT4 weights with bf16 activations (W4A16), and FP8 weights with FP8
activations (W8A8). The layouts here are the loader's contract; the Triton kernels are in ``quant_triton.py``.

INT4 (compressed-tensors' ``pack-quantized`` layout, symmetric or with zero points):

- ``packed`` int32 [N, K // 8]: column ``8 j + i`` of row n is nibble i (bits 4i..4i+3) of ``packed[n, j]``,
  stored as the unsigned ``q + 8`` of q in [-8, 7];
- ``scale`` [N, K // G] in the activation dtype, G the group size (``group_size`` 0: one group a row, G = K);
- ``zero`` int8 [N, K // G] in [-8, 7], or None (symmetric). The weight is ``(q - zero) * scale``.

E.g. a row q = [-8, -1, 0, 1, 7, 2, 3, 4] is stored as nibbles [0, 7, 8, 9, 15, 10, 11, 12], nibble 0 lowest:
0xCBAF9870, the int32 -877684624.

FP8: ``weight`` float8_e4m3fn [N, K], ``weight_scale`` float32 [N] (one a row), the weight ``weight * weight_scale``.
Activations are quantized per token at run time (each row's absolute max maps to 448, e4m3's largest value) or by
one static ``input_scale``; the product runs in ``torch._scaled_mm`` with its row-wise scales.

The functions without a kernel (``pack_int4``, ``unpack_int4``, ``dequantize_int4``,
``quantize_fp8_per_token_reference``) are plain torch, for the loader and the CPU; they import no Triton.
"""

from __future__ import annotations

import torch

# e4m3's largest finite value; a row's absolute max is scaled to it
FP8_MAX = 448.0
# a row's scale is its absmax times float32(1 / 448): a product rounds the same on every device (torch divides by a
# scalar through its reciprocal on CUDA but not on CPU)
FP8_INV_MAX = 1.0 / FP8_MAX
# the smallest per-token scale: an all-zero row quantizes to zeros, not NaN (vLLM's floor, 1 / (448 * 512))
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] of values in [-8, 7] (K a multiple of 8) -> the int32 [N, K // 8] layout above.

    >>> pack_int4(torch.tensor([[-8, -1, 0, 1, 7, 2, 3, 4]], dtype=torch.int8))
    tensor([[-877684624]], dtype=torch.int32)
    """
    n, k = q.shape
    if k % 8:
        raise ValueError(f"int4 packing needs a multiple of 8 columns, got {k}")
    if q.numel() and (q.min() < -8 or q.max() > 7):
        raise ValueError(f"int4 values must lie in [-8, 7], got [{int(q.min())}, {int(q.max())}]")
    nibbles = (q.to(torch.int64) + 8).view(n, k // 8, 8)
    word = (nibbles << (4 * torch.arange(8, device=q.device))).sum(-1)
    # the top nibble's bit 31 is the int32 sign bit
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [N, K // 8] -> int8 [N, K] in [-8, 7] (the inverse of ``pack_int4``).

    Read as bytes (little-endian), byte c of a row holds columns 2c (low nibble) and 2c + 1 (high nibble)."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed int4 weights are a 2-D int32 tensor, got {packed.dtype} of shape "
                         f"{tuple(packed.shape)}")
    n = packed.shape[0]
    b = packed.contiguous().view(torch.uint8)  # [N, K // 2]
    pairs = torch.stack((b & 0xF, b >> 4), dim=-1)  # [N, K // 2, 2]: columns 2c, 2c + 1
    return (pairs.view(n, -1).to(torch.int8) - 8)


def int4_groups(k: int, group_size: int) -> int:
    """Groups a row of ``k`` inputs has; ``group_size`` 0 is one group a row (the "channel" strategy)."""
    g = k if group_size == 0 else group_size
    if g <= 0 or k % g:
        raise ValueError(f"int4 group size {group_size} does not divide the {k} inputs (0: one group a row)")
    return k // g


def check_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int) -> int:
    """The K of a well-formed INT4 weight (see the module docstring); a ValueError naming what is wrong else."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"packed int4 weights are a 2-D int32 tensor, got {packed.dtype} of shape "
                         f"{tuple(packed.shape)}")
    n, k = packed.shape[0], packed.shape[1] * 8
    want = (n, int4_groups(k, group_size))
    if tuple(scale.shape) != want:
        raise ValueError(f"int4 scales must be {list(want)} for {n} x {k} weights in groups of "
                         f"{group_size or k}, got {list(scale.shape)}")
    if zero is not None and (tuple(zero.shape) != want or zero.dtype != torch.int8):
        raise ValueError(f"int4 zero points must be int8 {list(want)}, got {zero.dtype} {list(zero.shape)}")
    return k


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group_size: int,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
    """The [N, K] weight ``(q - zero) * scale`` in ``dtype`` (default: the scales'). Each value is the exact
    product rounded once to ``dtype`` (|q - zero| <= 15 and a 16-bit scale multiply exactly in float32).

    E.g. q = [-8, 7] with scale 0.5 and zero -1 -> [-3.5, 4.0]."""
    check_int4(packed, scale, zero, group_size)
    n, groups = scale.shape
    q = unpack_int4(packed).view(n, groups, -1)
    if zero is not None:
        q = q - zero.view(n, groups, 1)  # int8: within [-15, 15]
    w = q.to(torch.float32) * scale.to(torch.float32).view(n, groups, 1)
    return w.to(dtype or scale.dtype).view(n, -1)


def quantize_fp8_per_token_reference(x: torch.Tensor, input_scale: torch.Tensor | None = None
                                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (e4m3 [M, K], float32 scales [M, 1]) with ``x ~ q * scale``: per row ``absmax / 448``
    (times ``FP8_INV_MAX``, at least ``FP8_MIN_SCALE``) or the static float32 scalar ``input_scale``; q is
    ``x / scale`` rounded to the nearest e4m3 value (ties to even), saturated at +-448.
    ``quantize_fp8_per_token`` gives the same bits on the GPU."""
    xf = x.to(torch.float32)
    if input_scale is None:
        scale = (xf.abs().amax(dim=-1, keepdim=True) * FP8_INV_MAX).clamp(min=FP8_MIN_SCALE)
    else:
        scale = input_scale.to(torch.float32).reshape(1, 1).expand(x.shape[0], 1)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale.contiguous()


def quantize_fp8_per_token(x: torch.Tensor, input_scale: torch.Tensor | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_fp8_per_token_reference`` in one Triton launch (x [M, K], bf16/fp16/fp32, rows contiguous)."""
    from hybridkv.kernels.quant_triton import launch_fp8_quantize  # GPU only

    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"fp8 activation quantization takes a 2-D input with contiguous rows, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"a static fp8 input_scale is one value, got {input_scale.numel()}")
    return launch_fp8_quantize(x, input_scale, (FP8_MAX, FP8_INV_MAX, FP8_MIN_SCALE))


def int4_gemm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
              group_size: int, bias: torch.Tensor | None = None, arrived: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, dequantize_int4(packed, scale, zero, group_size), bias)`` without materializing the weight:
    x [..., K] bf16 or fp16 (float32 too, for checks), the weight as in the module docstring, bias [N] in x's
    dtype. Float32 accumulation; the result in x's dtype. Up to 64 rows the weight is read once across the GPU
    (split along N and K, one launch; up to 4 rows without tensor cores); more rows run tensor-core tiles.
    ``arrived``: the split sums' counters, ``quant_triton.int4_gemm_counters(N)`` kept by the caller (None: made
    for the call). CUDA-graph capturable: no host sync."""
    from hybridkv.kernels.quant_triton import launch_int4_gemm  # GPU only

    k = check_int4(packed, scale, zero, group_size)
    if x.shape[-1] != k:
        raise ValueError(f"int4_gemm: x has {x.shape[-1]} features, the weight {k}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or scale.dtype != x.dtype:
        raise ValueError(f"int4_gemm takes bf16/fp16 activations and scales of the same dtype, got x {x.dtype}, "
                         f"scales {scale.dtype}")
    n = packed.shape[0]
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype):
        raise ValueError(f"int4_gemm: bias must be {x.dtype} [{n}], got {bias.dtype} {list(bias.shape)}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = launch_int4_gemm(x2, packed, scale, zero, k // scale.shape[1], bias, arrived)
    return y.view(*x.shape[:-1], n)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               input_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``(q(x) @ weight.T) * x_scale[:, None] * weight_scale[None, :] (+ bias)`` in x's dtype (bf16): x [..., K]
    quantized per token (or by the static ``input_scale``) by one Triton launch, the product in
    ``torch._scaled_mm`` (row-wise scales, float32 accumulation). K and N must be multiples of 16
    (``_scaled_mm``'s requirement); any number of rows (no padding needed). CUDA-graph capturable."""
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn or weight_scale.dtype != torch.float32 or weight_scale.shape != (n,):
        raise ValueError(f"fp8_linear takes an e4m3 weight [N, K] and float32 scales [N], got {weight.dtype} "
                         f"{list(weight.shape)} and {weight_scale.dtype} {list(weight_scale.shape)}")
    if k % 16 or n % 16:
        raise ValueError(f"fp8_linear needs K and N multiples of 16 (torch._scaled_mm), got {n} x {k}")
    if x.shape[-1] != k or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"fp8_linear takes bf16/fp16 x [..., {k}], got {x.dtype} {list(x.shape)}")
    if weight.stride(-1) != 1:
        raise ValueError("fp8_linear needs a row-major weight [N, K] (its transpose is _scaled_mm's column-major "
                         "operand)")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    xq, xs = quantize_fp8_per_token(x2, input_scale)
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, n),
                         bias=None if bias is None else bias.to(x.dtype), out_dtype=x.dtype)
    return y.view(*x.shape[:-1], n)
