"""The KV cache tensor both paged backends use, laid out as ``hybridkv.kv.layout`` says.

One buffer ``[num_blocks, page_elems]``; layer group j's layer at slot s views it as
``[num_blocks, g, 2 (K, V), block_size, num_kv_heads, head_dim][:, s]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    keys: torch.Tensor | None = None  # view[:, 0], [num_blocks, block_size, num_kv_heads, head_dim]
    values: torch.Tensor | None = None  # view[:, 1]

    def __post_init__(self) -> None:
        self.keys, self.values = self.view[:, 0], self.view[:, 1]


class PagedKVCache:
    def __init__(self, layout: KVLayout, num_blocks: int, kv_dtype: str, device: torch.device | str) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.dtype = torch_dtype(kv_dtype)
        elem = torch.empty((), dtype=self.dtype).element_size()
        self.page_elems = layout.page_bytes // elem
        self.buffer = _zeroed(num_blocks, self.page_elems, self.dtype, torch.device(device))
        self.layers: dict[int, LayerCache] = {}
        for group in layout.groups:
            spec = group.spec
            slot_elems = 2 * self.block_size * spec.num_kv_heads * spec.head_dim
            view = self.buffer[:, : slot_elems * len(group.layer_ids)].view(
                num_blocks, len(group.layer_ids), 2, self.block_size, spec.num_kv_heads, spec.head_dim
            )
            for slot, layer_id in enumerate(group.layer_ids):
                self.layers[layer_id] = LayerCache(group.group_id, spec, view[:, slot], slot * slot_elems)


def _zeroed(num_blocks: int, page_elems: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros (no read can see garbage). On CPU through numpy's calloc: the OS hands out zero pages as they are
    first written, so an untouched page of the cache is never resident (``torch.zeros`` writes every byte: 2 GiB
    of RSS and a second of start-up for the default CPU budget before any request)."""
    if device.type != "cpu":
        return torch.zeros(num_blocks, page_elems, dtype=dtype, device=device)
    nbytes = num_blocks * page_elems * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(num_blocks, page_elems)
