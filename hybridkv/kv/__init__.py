"""The hybrid paged KV cache: specs per attention type, memory layout, block pool, managers, planner.

Pure Python + numpy: nothing here imports torch.
"""

from hybridkv.kv.block_pool import BlockPool, KVBlock
from hybridkv.kv.cache_manager import KVCacheManager
from hybridkv.kv.request import CacheHit, CacheRequest, KVRequest, PrefixCacheStats
from hybridkv.kv.layer_specs import layer_specs_from_hf_config
from hybridkv.kv.layout import KVLayout, LayerGroup, plan_layout
from hybridkv.kv.specs import AttentionSpec, ChunkedLocalSpec, FullAttentionSpec, SlidingWindowSpec

__all__ = [
    "AttentionSpec",
    "BlockPool",
    "CacheHit",
    "CacheRequest",
    "ChunkedLocalSpec",
    "FullAttentionSpec",
    "KVBlock",
    "KVCacheManager",
    "KVLayout",
    "KVRequest",
    "LayerGroup",
    "PrefixCacheStats",
    "SlidingWindowSpec",
    "layer_specs_from_hf_config",
    "plan_layout",
]
