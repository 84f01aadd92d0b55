"""The one interface between model code and attention.

A model's attention layer computes q, k, v for the tokens of this step (every sequence of the batch flattened
into one dimension of T tokens), applies its position encoding, then calls::

    out = backend.attend(layer_id, q, k, v, scale)     # q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D]

The backend knows each layer's attention type (full, sliding, chunked) from the KV layout and which tokens of
the batch belong to which sequence from the step's metadata, so model code never sees masks, caches or block
tables. Backends: ``DenseAttention`` (no cache, whole sequences; the test oracle), ``TorchPagedAttention``
(the paged hybrid cache in plain torch; CPU and reference for GPU kernels), Triton kernels on GPU.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        ...
