"""Our dtype names (``hybridkv.kv.dtypes``) as torch dtypes, and back: the one torch-side table.

    torch_dtype("bfloat16") -> torch.bfloat16        dtype_name(torch.float8_e4m3fn) -> "fp8_e4m3"
"""

from __future__ import annotations

from types import MappingProxyType

import torch

from hybridkv.kv.dtypes import MODEL_DTYPES

TORCH_DTYPES = MappingProxyType({
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8_e4m3": torch.float8_e4m3fn,
})
MODEL_TORCH_DTYPES = tuple(TORCH_DTYPES[name] for name in MODEL_DTYPES)  # what models compute in


def torch_dtype(name: str) -> torch.dtype:
    if name not in TORCH_DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in TORCH_DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"no dtype name for {dtype}; known: {', '.join(TORCH_DTYPES)}")
