"""Cache-free attention over whole sequences: the test oracle for every other backend.

The batch's tokens are whole sequences laid end to end in T, each at positions 0..n-1. Each layer's mask is
causal intersected with its type's reach (``hybridkv.kv.specs``); scores and softmax run in float32.
"""

from __future__ import annotations

import torch

from hybridkv.kv.specs import AttentionSpec


def allowed_mask(spec: AttentionSpec, n: int, device: torch.device | None = None) -> torch.Tensor:
    """[n, n] bool, True where query position q may attend to key position k (the spec's own rule)."""
    positions = torch.arange(n, device=device)
    return spec.visible(positions, positions)


class DenseAttention:
    def __init__(self, layer_specs: list[AttentionSpec], seq_lens: list[int]) -> None:
        if any(n < 1 for n in seq_lens):
            raise ValueError(f"every sequence needs at least one token, got seq_lens {seq_lens}")
        self.layer_specs = list(layer_specs)
        self.seq_lens = list(seq_lens)

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        if q.shape[0] != sum(self.seq_lens):
            raise ValueError(f"got {q.shape[0]} tokens but seq_lens {self.seq_lens} sum to {sum(self.seq_lens)}")
        if q.shape[1] % k.shape[1]:
            raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} KV heads")
        spec = self.layer_specs[layer_id]
        outs = []
        start = 0
        for n in self.seq_lens:
            part = slice(start, start + n)
            outs.append(_attend_one(q[part], k[part], v[part], scale, allowed_mask(spec, n, q.device)))
            start += n
        return torch.cat(outs).to(q.dtype)


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor) -> torch.Tensor:
    # GQA: query head h reads KV head h // (Hq / Hkv), as transformers' repeat_kv lays them out.
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
