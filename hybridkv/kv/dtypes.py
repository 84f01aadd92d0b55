"""Dtype names and their sizes: the one table every part of hybridkv reads (the torch dtypes: ``model/dtypes.py``).

Names are the KV-cache spelling (``--kv-cache-dtype``); what Hugging Face configs and torch call them maps onto it::

    canonical_dtype("torch.bfloat16") -> "bfloat16"      dtype_bytes("bfloat16") -> 2
    canonical_dtype("half")           -> "float16"       dtype_bytes("fp8_e4m3") -> 1
    canonical_dtype("float8_e4m3fn")  -> "fp8_e4m3"      canonical_dtype("int4") -> None

Pure Python: nothing here imports torch.
"""

from __future__ import annotations

from types import MappingProxyType

DTYPE_BYTES = MappingProxyType({"float32": 4, "bfloat16": 2, "float16": 2, "fp8_e4m3": 1})
MODEL_DTYPES = ("float32", "bfloat16", "float16")  # what weights and activations compute in
KV_CACHE_DTYPES = (*MODEL_DTYPES, "fp8_e4m3")  # what the KV cache stores
_ALIASES = MappingProxyType({"half": "float16", "float": "float32", "fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3"})


def canonical_dtype(name: object) -> str | None:
    """Our name for a dtype spelled as a config, torch or the CLI spells it; None when we have no such dtype."""
    name = str(name).removeprefix("torch.")
    name = _ALIASES.get(name, name)
    return name if name in DTYPE_BYTES else None


def dtype_bytes(name: str) -> int:
    """Bytes of one element: ``dtype_bytes("bfloat16") == 2``."""
    canonical = canonical_dtype(name)
    if canonical is None:
        raise ValueError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[canonical]
