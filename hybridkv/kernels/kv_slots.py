"""Where a kernel that stores the step's K and V itself writes them in the paged cache (``KVSlots``).

The Triton attention backend hands them out (``StoresKVFromKernels.kv_slots``) and the position-encoding kernel
(``kernels/rope.py``) stores k and v into them as it writes q. Plain torch: importing it needs no Triton.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVSlots:
    """Where the step's K and V of one layer go in the paged cache, for a kernel that stores them itself. Token
    t's K row (its KV heads' values, contiguous) starts at ``cache[block[t] * stride_block + offset[t] * row]``
    (``row``: KV heads x head dim), its V row ``v_offset`` further. E.g. 16-token pages of 1 x 128 values,
    block [7], offset [3]: K at 7 * stride_block + 384, V at 7 * stride_block + 384 + 2,048."""

    cache: torch.Tensor  # the layer's cache, flat from its first element
    block: torch.Tensor  # [T] int32
    offset: torch.Tensor  # [T] int32
    stride_block: int
    v_offset: int
    k_scale: float  # an FP8 cache's scales (1.0 otherwise)
    v_scale: float
    quantized: bool  # e4m3: values over their scale, saturated at 448
