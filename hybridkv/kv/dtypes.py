"""Dtype names and their sizes: the one table every part of hybridkv reads (the torch dtypes: ``model/dtypes.py``).

Names are the KV-cache spelling (``--kv-cache-dtype``); what Hugging Face configs and torch call them maps onto it::

    canonical_dtype("torch.bfloat16") -> "bfloat16"      dtype_bytes("bfloat16") -> 2
    canonical_dtype("half")           -> "float16"       dtype_bytes("fp8_e4m3") -> 1
    canonical_dtype("float8_e4m3fn")  -> "fp8_e4m3"      canonical_dtype("int4") -> None

``auto`` resolves here, once, for the engine and ``hybridkv plan`` alike::

    resolve_model_dtype("auto", "cpu") -> "float32"      resolve_model_dtype("auto", "cuda") -> "bfloat16"
    resolve_kv_dtype("auto", "bfloat16") -> "bfloat16"  resolve_kv_dtype("fp8", "bfloat16") -> "fp8_e4m3"

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


def resolve_model_dtype(dtype: str, device: str) -> str:
    """What the model computes in: ``dtype``, or for ``auto`` float32 on the CPU (fastest there, and exact) and
    bfloat16 on a GPU."""
    if dtype == "auto":
        return "float32" if device == "cpu" else "bfloat16"
    if dtype not in MODEL_DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose auto, {', '.join(MODEL_DTYPES)}")
    return dtype


def resolve_kv_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """What the KV cache stores: ``kv_cache_dtype``, or for ``auto`` ``model_dtype`` (keys and values are kept as
    the model computes them). Rejects what we do not support with the list of what we do."""
    if kv_cache_dtype == "fp8_e5m2":
        raise ValueError("kv_cache_dtype fp8_e5m2 is not supported; use fp8_e4m3 (per-layer scales) or auto")
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", *KV_CACHE_DTYPES):
        return canonical_dtype(kv_cache_dtype)
    raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; choose auto, {', '.join(KV_CACHE_DTYPES)}")
