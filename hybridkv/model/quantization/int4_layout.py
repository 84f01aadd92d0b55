"""The one INT4 layout every part of hybridkv keeps 4-bit weights in: compressed-tensors' ``pack-quantized`` one.

``packed`` int32 [N, K // 8]: column ``8 j + i`` of row ``n`` is nibble ``i`` (bits 4i..4i+3) of ``packed[n, j]``,
stored as the unsigned ``q + 8`` for ``q`` in [-8, 7]. ``scale`` [N, K // G] (G the group size), ``zero`` int8
[N, K // G] or None (symmetric); the weight is ``(q - zero) * scale``. E.g. the row q = [-8, -1, 0, 1, 7, 2, 3, 4]
is stored as nibbles [0, 7, 8, 9, 15, 10, 11, 12], the int32 0xCBAF_9870 read from nibble 7 down to nibble 0.
"""

from __future__ import annotations

import torch

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] in [-8, 7] (K a multiple of 8) -> int32 [N, K // 8]."""
    rows, cols = q.shape
    if cols % 8:
        raise ValueError(f"4-bit weights pack 8 columns to an int32; {cols} columns is not a multiple of 8")
    nibbles = (q.to(torch.int32) + 8).view(rows, cols // 8, 8)
    return (nibbles << _SHIFTS.to(q.device)).sum(dim=-1, dtype=torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int32 [N, K // 8] -> int8 [N, K] in [-8, 7]."""
    rows, words = packed.shape
    nibbles = (packed[:, :, None] >> _SHIFTS.to(packed.device)) & 0xF
    return (nibbles - 8).to(torch.int8).view(rows, words * 8)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                    dtype: torch.dtype) -> torch.Tensor:
    """The [N, K] weight ``(q - zero) * scale`` in ``dtype``: exactly what compressed-tensors' own decompression
    gives in that dtype (each product is exact in float32, then rounded once)."""
    q = unpack_int4(packed).to(torch.float32)
    rows, cols = q.shape
    groups = scale.shape[-1]
    q = q.view(rows, groups, cols // groups)
    if zero is not None:
        q = q - zero.to(torch.float32)[:, :, None]
    return (q * scale.to(dtype).to(torch.float32)[:, :, None]).view(rows, cols).to(dtype)
