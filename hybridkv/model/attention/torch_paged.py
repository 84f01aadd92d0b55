"""Attention over the paged hybrid KV cache, in plain torch: the CPU path and the oracle for GPU kernels.

The cache is one tensor of ``[num_blocks, page_elems]`` laid out as ``hybridkv.kv.layout`` says; layer group j's
layer at slot s sees ``[num_blocks, g, 2, block_size, num_kv_heads, head_dim][:, s]``. Each step:

1. ``begin_step`` receives, per scheduled sequence, how many tokens are already cached (``context_len``), how
   many are computed now (``query_len``) and its block table per group. Metadata (write slots, which key
   positions each group reads) is built here once per group and shared by every layer of that group.
2. ``attend`` writes the step's K/V into their slots, gathers the keys each sequence can see for this layer's
   type (full: all; sliding: the window; chunked: the chunk), and runs masked softmax attention through
   ``scaled_dot_product_attention``, whose CPU kernel is flash-style: it never holds a score matrix. Queries go
   in tiles of ``query_tile``, each with only the keys its rows can reach, so the mask is at most
   ``query_tile`` x keys and a long prefill's working set stays bounded (an 8K-token prompt's dense scores
   would be 9 heads x 8K x 8K x 4 B = 2.3 GB per layer).

Example: chunked layer, chunk 8, block 4, a sequence with 10 cached tokens and 3 new ones (positions 10..12)
reads keys 8..12 only: block table ``[0, 0, 7, 9]`` -> blocks 7 (positions 8..11) and 9 (12).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hybridkv.kv.layout import KVLayout
from hybridkv.kv.specs import AttentionSpec
from hybridkv.model.attention.base import BackendCapabilities, StepSequence
from hybridkv.model.attention.kv_cache import PagedKVCache


# Queries per tile of a prefill: its mask is QUERY_TILE x keys bools, and SDPA's own blocks do the rest.
QUERY_TILE = 1024


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
        self, layout: KVLayout, num_blocks: int, kv_dtype: str, device: torch.device | str = "cpu",
        query_tile: int = QUERY_TILE,
    ) -> None:
        if query_tile < 1:
            raise ValueError(f"query_tile must be >= 1, got {query_tile}")
        self.layout = layout
        self.query_tile = query_tile
        self.block_size = layout.block_size
        self.cache = PagedKVCache(layout, num_blocks, kv_dtype, device)
        self.kv_dtype = self.cache.dtype
        self.capabilities = self.declare(kv_dtype)
        self._step: list[_GroupStep] = []
        self._seq_query_lens: list[int] = []
        self._seq_context_lens: list[int] = []

    # ---- per step ----------------------------------------------------------------------------------
    def begin_step(self, seqs: list[StepSequence]) -> None:
        bs = self.block_size
        self._seq_query_lens = [s.query_len for s in seqs]
        self._seq_context_lens = [s.context_len for s in seqs]
        dev = self.cache.buffer.device
        on_dev = lambda a: torch.from_numpy(a).to(dev)  # noqa: E731
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

    @property
    def step_state(self) -> tuple:
        """What ``begin_step`` built (see ``PagedAttentionBackend.step_state``)."""
        return self._step, self._seq_query_lens, self._seq_context_lens

    @step_state.setter
    def step_state(self, state: tuple) -> None:
        self._step, self._seq_query_lens, self._seq_context_lens = state

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        layer = self.cache.layers[layer_id]
        cache, spec, step = layer.view, layer.spec, self._step[layer.group_id]
        cache[step.write_blocks, 0, step.write_offsets] = self._to_cache(k)
        cache[step.write_blocks, 1, step.write_offsets] = self._to_cache(v)
        out = torch.empty_like(q)
        start = 0
        for i, n in enumerate(self._seq_query_lens):
            keys = cache[step.read_blocks[i], 0, step.read_offsets[i]]
            values = cache[step.read_blocks[i], 1, step.read_offsets[i]]
            out[start : start + n] = self._attend_tiles(
                spec, q[start : start + n], keys, values, self._seq_context_lens[i], step.key_positions[i], scale
            )
            start += n
        return out

    def _attend_tiles(
        self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
        key_positions: torch.Tensor, scale: float,
    ) -> torch.Tensor:
        """One sequence's queries (at ``context_len``...) over its gathered keys (at ``key_positions``), a tile of
        queries at a time. A single query sees every gathered key (they were gathered from its reach): no mask."""
        if q.shape[0] == 1:
            return _sdpa(q, k, v, None, scale)
        out = torch.empty_like(q)
        first_key = _key_range(spec, context_len)  # the gathered keys start here
        for lo in range(0, q.shape[0], self.query_tile):
            hi = min(lo + self.query_tile, q.shape[0])
            # reach is monotone in the position: the tile's first query sees furthest back, its last one furthest on
            k_lo = spec.first_needed_token(context_len + lo) - first_key
            k_hi = context_len + hi - first_key
            if spec.keeps_every_token and q.device.type == "cpu":
                out[lo:hi] = _prefix_then_causal(q[lo:hi], k[:k_hi], v[:k_hi], context_len + lo, scale)
                continue
            q_pos = torch.arange(context_len + lo, context_len + hi, device=q.device)
            mask = spec.visible(q_pos, key_positions[k_lo:k_hi])  # causal and the type's reach
            out[lo:hi] = _sdpa(q[lo:hi], k[k_lo:k_hi], v[k_lo:k_hi], mask, scale)
        return out

    def _to_cache(self, x: torch.Tensor) -> torch.Tensor:
        if self.kv_dtype == torch.float8_e4m3fn:
            # e4m3 has no infinity: out-of-range values would become NaN. Scale 1.0 per layer, as vLLM's default.
            x = x.clamp(-448.0, 448.0)
        return x.to(self.kv_dtype)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q [Q, Hq, D], k/v [K, Hkv, D], mask [Q, K] (True: attend) or None -> [Q, Hq, D] in q's dtype.

    Query head h reads KV head h // (Hq / Hkv) (GQA, as transformers' repeat_kv lays them out). float32 inside:
    this backend is also the reference the GPU kernels are checked against. 4-D [1, H, len, D]: torch's CPU flash
    kernel takes only 4-D inputs (3-D ones fall back to the math path, which builds the scores)."""
    as_4d = lambda x: x.float().transpose(0, 1)[None]  # noqa: E731
    out = F.scaled_dot_product_attention(
        as_4d(q), as_4d(k), as_4d(v), attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
    return out[0].transpose(0, 1).to(q.dtype)


def _prefix_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int, scale: float) -> torch.Tensor:
    """Full attention of a tile of queries (CPU): the first ``prefix`` keys are earlier tokens every query sees, the
    last ``len(q)`` keys are the tile's own, seen causally. Two unmasked flash calls (the second with ``is_causal``,
    square, so its top-left alignment is right) merged by their log-sum-exps: with a [Q, K] mask instead, torch's
    CPU flash kernel ran at half speed (256 queries over 8,000 keys: 160 ms masked, 81 ms without)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    as_4d = lambda x: x.float().transpose(0, 1)[None]  # noqa: E731
    q4, k4, v4 = as_4d(q), as_4d(k), as_4d(v)
    own, own_lse = flash(q4, k4[:, :, prefix:], v4[:, :, prefix:], 0.0, True, scale=scale)
    if prefix:
        seen, seen_lse = flash(q4, k4[:, :, :prefix], v4[:, :, :prefix], 0.0, False, scale=scale)
        lse = torch.logaddexp(seen_lse, own_lse)
        own = seen * torch.exp(seen_lse - lse)[..., None] + own * torch.exp(own_lse - lse)[..., None]
    return own[0].transpose(0, 1).to(q.dtype)
