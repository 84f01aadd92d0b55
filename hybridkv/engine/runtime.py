"""One rank's runtime: KV layout, cache tensors + attention backend, and the runner over them.

Built the same way by the engine (rank 0, which also owns the block tables) and by each tensor-parallel worker,
so every rank's cache has the same layout and block count and the driver's block tables address them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.engine.block_copier import BlockCopier
from hybridkv.engine.model_runner import ModelRunner
from hybridkv.kv.cache_manager import KVCacheManager
from hybridkv.kv.layer_specs import layer_specs_from_hf_config
from hybridkv.kv.layout import KVLayout, plan_layout
from hybridkv.model.attention.base import PagedAttentionBackend
from hybridkv.model.attention.factory import make_paged_attention
from hybridkv.model.causal_lm import CausalLM


@dataclass(slots=True)
class RankRuntime:
    layout: KVLayout
    backend: PagedAttentionBackend  # holds this rank's KV cache tensor
    runner: ModelRunner


def rank_layout(hf_config: dict[str, Any], tensor_parallel_size: int, kv_dtype: str, block_size: int) -> KVLayout:
    """The KV layout of one rank (its share of the KV heads)."""
    return plan_layout(layer_specs_from_hf_config(hf_config, tensor_parallel_size, kv_dtype), block_size)


def build_runtime(
    model: CausalLM, layout: KVLayout, num_blocks: int, kv_dtype: str, attention_backend: str, device: str,
    kv: KVCacheManager | None = None, host_blocks: int = 0, fp8_compute: bool = False, halves_from_tokens: int = 0,
    dtype: torch.dtype | None = None,
) -> RankRuntime:
    """``kv``: the block tables' owner (rank 0); None on worker ranks, which only execute. ``host_blocks``: pages
    of this rank's host-memory tier (0: none), copied to and from the cache by the runner. ``fp8_compute``: FP8
    prefill dots over an FP8 cache (the Triton backend). ``halves_from_tokens``: see ``ModelRunner``. ``dtype``: the
    model's (the attention queries')."""
    heads = model.cfg.num_heads // model.tp.size
    backend = make_paged_attention(attention_backend, layout, num_blocks, kv_dtype, heads, device, fp8_compute, dtype)
    copier = BlockCopier(backend.cache.buffer, host_blocks) if host_blocks else None
    return RankRuntime(layout, backend, ModelRunner(model, kv, backend, copier, halves_from_tokens))
