"""Which paged attention backend a rank uses: the torch reference (CPU, or as an oracle on GPU) or Triton."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True, slots=True)
class AttentionChoice:
    """The paged attention a rank builds: ``name`` auto (Triton on CUDA, torch elsewhere) | torch | triton, over a
    ``kv_dtype`` cache on ``device``, for queries of ``dtype`` (the model's; None: the cache's, bf16 over an FP8
    cache). ``fp8_compute``: FP8 prefill dots over an FP8 cache (Triton only; the torch reference stays exact).

    E.g. the engine's on an H200 for a bf16 model with an FP8 cache:
    ``AttentionChoice("auto", "cuda", "fp8_e4m3", torch.bfloat16)``."""

    name: str
    device: str
    kv_dtype: str
    dtype: torch.dtype | None = None
    fp8_compute: bool = False


def make_paged_attention(choice: AttentionChoice, layout: KVLayout, num_blocks: int,
                         num_q_heads: int) -> PagedAttentionBackend:
    """The backend ``choice`` names, its cache ``num_blocks`` pages of ``layout``; ``num_q_heads``: on this rank."""
    backend = paged_attention_class(choice.name, choice.device)
    if backend is TorchPagedAttention:
        return TorchPagedAttention(layout, num_blocks, choice.kv_dtype, choice.device)
    return TritonPagedAttention(layout, num_blocks, choice.kv_dtype, num_q_heads, choice.device, dtype=choice.dtype,
                                options=KernelOptions(fp8_compute=choice.fp8_compute))
