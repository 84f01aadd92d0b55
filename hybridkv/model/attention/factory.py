"""Which paged attention backend a rank uses: the torch reference (CPU, or as an oracle on GPU) or Triton."""

from __future__ import annotations

import torch

from hybridkv.kv.layout import KVLayout
from hybridkv.model.attention.torch_paged import TorchPagedAttention


def make_paged_attention(
    name: str, layout: KVLayout, num_blocks: int, kv_dtype: str, num_q_heads: int, device: str,
    fp8_compute: bool = False,
):
    """``name``: auto (Triton on CUDA, torch elsewhere) | torch | triton. ``num_q_heads``: on this rank.
    ``fp8_compute``: FP8 prefill dots over an FP8 cache (Triton only; the torch reference stays exact)."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "torch":
        return TorchPagedAttention(layout, num_blocks, kv_dtype, device)
    if name == "triton":
        from hybridkv.model.attention.triton_paged import TritonPagedAttention

        return TritonPagedAttention(layout, num_blocks, kv_dtype, num_q_heads, device, fp8_compute=fp8_compute)
    raise ValueError(f"unknown attention_backend {name!r}; choose auto, torch or triton")
