"""The KV cache tensor both paged backends use, laid out as ``hybridkv.kv.layout`` says.

One buffer ``[num_blocks, page_elems]``; layer group j's layer at slot s views it as
``[num_blocks, g, 2 (K, V), block_size, num_kv_heads, head_dim][:, s]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridkv.kv.layout import KVLayout
from hybridkv.kv.specs import AttentionSpec
from hybridkv.model.dtypes import torch_dtype


@dataclass(slots=True)
class LayerCache:
    group_id: int
    spec: AttentionSpec
    view: torch.Tensor  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    elem_offset: int  # where this layer's slot starts inside a page, in elements


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, kv_dtype: str, device: torch.device | str) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.dtype = torch_dtype(kv_dtype)
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.page_elems = layout.page_bytes // elem
        # zeros (not empty): untouched pages are never resident on CPU, and no read can see garbage
        self.buffer = torch.zeros(num_blocks, self.page_elems, dtype=self.dtype, device=device)
        self.layers: dict[int, LayerCache] = {}
        for group in layout.groups:
            spec = group.spec
            slot_elems = 2 * self.block_size * spec.num_kv_heads * spec.head_dim
            view = self.buffer[:, : slot_elems * len(group.layer_ids)].view(
                num_blocks, len(group.layer_ids), 2, self.block_size, spec.num_kv_heads, spec.head_dim
            )
            for slot, layer_id in enumerate(group.layer_ids):
                self.layers[layer_id] = LayerCache(group.group_id, spec, view[:, slot], slot * slot_elems)
