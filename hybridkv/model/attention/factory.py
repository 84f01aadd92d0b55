"""Which paged attention backend a rank uses: the torch reference (CPU, or as an oracle on GPU) or Triton."""

from __future__ import annotations

import torch

from hybridkv.kv.layout import KVLayout
from hybridkv.model.attention.base import BackendCapabilities, PagedAttentionBackend
from hybridkv.model.attention.kernel_configs import KernelOptions
from hybridkv.model.attention.torch_paged import TorchPagedAttention
from hybridkv.model.attention.triton_paged import TritonPagedAttention  # triton itself loads only when one is made


def paged_attention_class(name: str, device: str) -> type[TorchPagedAttention] | type[TritonPagedAttention]:
    """``name``: auto (Triton on CUDA, torch elsewhere) | torch | triton."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "torch":
        return TorchPagedAttention
    if name == "triton":
        return TritonPagedAttention
    raise ValueError(f"unknown attention_backend {name!r}; choose auto, torch or triton")


def paged_attention_capabilities(name: str, device: str, kv_dtype: str) -> BackendCapabilities:
    """What the backend ``name`` would declare on ``device``, before one (and its cache) is made."""
    return paged_attention_class(name, device).declare(kv_dtype)


def make_paged_attention(
    name: str, layout: KVLayout, num_blocks: int, kv_dtype: str, num_q_heads: int, device: str,
    fp8_compute: bool = False, dtype: torch.dtype | None = None,
) -> PagedAttentionBackend:
    """``num_q_heads``: on this rank. ``fp8_compute``: FP8 prefill dots over an FP8 cache (Triton only; the torch
    reference stays exact). ``dtype``: the queries' (the model's; None: the cache's, bf16 over an FP8 cache)."""
    backend = paged_attention_class(name, device)
    if backend is TorchPagedAttention:
        return TorchPagedAttention(layout, num_blocks, kv_dtype, device)
    return TritonPagedAttention(layout, num_blocks, kv_dtype, num_q_heads, device, dtype=dtype,
                                options=KernelOptions(fp8_compute=fp8_compute))
