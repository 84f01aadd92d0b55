"""Attention over the paged hybrid KV cache, in plain torch: the CPU path and the oracle for GPU kernels.

The cache is one tensor of ``[num_blocks, page_elems]`` laid out as ``hybridkv.kv.layout`` says; layer group j's
layer at slot s sees ``[num_blocks, g, 2, block_size, num_kv_heads, head_dim][:, s]``. Each step:

1. ``begin_step`` receives, per scheduled sequence, how many tokens are already cached (``context_len``), how
   many are computed now (``query_len``) and its block table per group. Metadata (write slots, which key
   positions each group reads) is built here once per group and shared by every layer of that group.
2. ``attend`` writes the step's K/V into their slots, gathers the keys each sequence can see for this layer's
   type (full: all; sliding: the window; chunked: the chunk), and runs masked softmax attention.

Example: chunked layer, chunk 8, block 4, a sequence with 10 cached tokens and 3 new ones (positions 10..12)
reads keys 8..12 only: block table ``[0, 0, 7, 9]`` -> blocks 7 (positions 8..11) and 9 (12).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.kv.layout import KVLayout
from hybridkv.kv.specs import AttentionSpec
from hybridkv.model.attention.base import BackendCapabilities, StepSequence
from hybridkv.model.attention.kv_cache import PagedKVCache


@dataclass(slots=True)
class _GroupStep:
    write_blocks: torch.Tensor  # [T] block id of each new token's slot
    write_offsets: torch.Tensor  # [T] offset inside the block
    # per sequence: block ids / offsets of the keys it reads, their positions, and the queries' positions
    read_blocks: list[torch.Tensor]
    read_offsets: list[torch.Tensor]
    key_positions: list[torch.Tensor]


def _key_range(spec: AttentionSpec, context_len: int) -> int:
    """First key position any query of this step can see (the step's first query is at ``context_len``)."""
    return spec.first_needed_token(context_len)


class TorchPagedAttention:
    @staticmethod
    def declare(kv_dtype: str) -> BackendCapabilities:
        """Eager only; each sequence's keys are widened as they are gathered: no segments, no extra reserve."""
        return BackendCapabilities()

    def __init__(
        self, layout: KVLayout, num_blocks: int, kv_dtype: str, device: torch.device | str = "cpu"
    ) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.cache = PagedKVCache(layout, num_blocks, kv_dtype, device)
        self.kv_dtype = self.cache.dtype
        self.capabilities = self.declare(kv_dtype)
        self._step: list[_GroupStep] = []
        self._seq_query_lens: list[int] = []
        self._seq_q_positions: list[torch.Tensor] = []

    # ---- per step ----------------------------------------------------------------------------------
    def begin_step(self, seqs: list[StepSequence]) -> None:
        bs = self.block_size
        self._seq_query_lens = [s.query_len for s in seqs]
        dev = self.cache.buffer.device
        on_dev = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
        self._seq_q_positions = [
            torch.arange(s.context_len, s.context_len + s.query_len, device=dev) for s in seqs
        ]
        self._step = []
        for group in self.layout.groups:
            write_b, write_o, read_b, read_o, key_pos = [], [], [], [], []
            for s in seqs:
                table = s.block_tables[group.group_id]
                new = np.arange(s.context_len, s.context_len + s.query_len)
                write_b.append(table[new // bs])
                write_o.append(new % bs)
                keys = np.arange(_key_range(group.spec, s.context_len), s.context_len + s.query_len)
                read_b.append(on_dev(table[keys // bs].astype(np.int64)))
                read_o.append(on_dev(keys % bs))
                key_pos.append(on_dev(keys))
            self._step.append(
                _GroupStep(
                    on_dev(np.concatenate(write_b).astype(np.int64)),
                    on_dev(np.concatenate(write_o)),
                    read_b,
                    read_o,
                    key_pos,
                )
            )

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        layer = self.cache.layers[layer_id]
        cache, spec, step = layer.view, layer.spec, self._step[layer.group_id]
        cache[step.write_blocks, 0, step.write_offsets] = self._to_cache(k)
        cache[step.write_blocks, 1, step.write_offsets] = self._to_cache(v)
        out = torch.empty_like(q)
        start = 0
        for i, n in enumerate(self._seq_query_lens):
            keys = cache[step.read_blocks[i], 0, step.read_offsets[i]].to(q.dtype)
            values = cache[step.read_blocks[i], 1, step.read_offsets[i]].to(q.dtype)
            mask = spec.visible(self._seq_q_positions[i], step.key_positions[i])  # causal and the type's reach
            out[start : start + n] = _masked_attention(q[start : start + n], keys, values, mask, scale)
            start += n
        return out


    def _to_cache(self, x: torch.Tensor) -> torch.Tensor:
        if self.kv_dtype == torch.float8_e4m3fn:
            # e4m3 has no infinity: out-of-range values would become NaN. Scale 1.0 per layer, as vLLM's default.
            x = x.clamp(-448.0, 448.0)
        return x.to(self.kv_dtype)


def _masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Q, Hq, D], k/v [K, Hkv, D], mask [Q, K] -> [Q, Hq, D]; query heads share KV heads in groups (GQA)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)
