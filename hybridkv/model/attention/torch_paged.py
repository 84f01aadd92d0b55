"""Attention over the paged hybrid KV cache, in plain torch: the CPU path and the oracle for GPU kernels.

The cache is one tensor of ``[num_blocks, page_elems]`` laid out as ``hybridkv.kv.layout`` says; layer group j's
layer at slot s sees ``[num_blocks, g, 2, block_size, num_kv_heads, head_dim][:, s]``. Each step:

1. ``begin_step`` receives, per scheduled sequence, how many tokens are already cached (``context_len``), how
   many are computed now (``query_len``) and its block table per group. Metadata (write slots, which key
   positions each group reads) is built here once per group and shared by every layer of that group.
2. ``attend`` writes the step's K/V into their slots (one indexed write for both), gathers the keys each
   sequence can see for this layer's type (full: all; sliding: the window; chunked: the chunk) as whole blocks
   (one ``index_select`` each for K and V; the keys a sequence sees are consecutive positions, so they are a run
   of its blocks less a few leading slots), and runs softmax attention through ``scaled_dot_product_attention``,
   whose CPU kernel is flash-style: it never holds a score matrix. A decode query sees every key gathered for it:
   no mask. Longer queries go in tiles of ``query_tile``, each with only the keys its rows can reach, so the mask
   is at most ``query_tile`` x keys and a long prefill's working set stays bounded (an 8K-token prompt's dense
   scores would be 9 heads x 8K x 8K x 4 B = 2.3 GB per layer).

Example: chunked layer, chunk 8, block 4, a sequence with 10 cached tokens and 3 new ones (positions 10..12)
reads keys 8..12 only: block table ``[0, 0, 7, 9]`` -> blocks 7 (positions 8..11) and 9 (12..15), of which the
first 5 slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from hybridkv.kv.layout import KVLayout
from hybridkv.kv.specs import AttentionSpec
from hybridkv.model.attention.base import BackendCapabilities, StepSequence
from hybridkv.model.attention.kv_cache import LayerCache, PagedKVCache
from hybridkv.model.attention.prompt_attention_cpu import PromptAttentionKernel


# Queries per tile of a prefill: its mask is QUERY_TILE x keys bools, and SDPA's own blocks do the rest.
QUERY_TILE = 1024
# Full attention on CPU cuts a query's keys at multiples of this (``_by_segments``): the CPU's prompt chunk
# (``config.CPU_STEP_TOKENS`` // 2), so a cold prompt's chunks start on a segment.
SEGMENT = 256


@dataclass(slots=True)
class _SeqRead:
    """The keys one sequence reads in a layer group: positions ``first .. first + count - 1``, which are slots
    ``lo .. lo + count - 1`` of its ``blocks`` laid end to end."""

    blocks: torch.Tensor  # [n] block ids, in position order
    lo: int
    count: int
    first: int
    hi: int = 0  # lo + count

    def __post_init__(self) -> None:
        self.hi = self.lo + self.count


@dataclass(slots=True)
class _GroupStep:
    write_blocks: torch.Tensor  # [T] block id of each new token's slot
    write_offsets: torch.Tensor  # [T] offset inside the block
    reads: list[_SeqRead]  # per sequence
    # a step of one new token (one sequence decoding): its slot as (block, offset), written by plain indexing
    # (an indexed write of one row costs more than the row: ~10 us, 30 times a step for SmolLM2)
    one_slot: tuple[int, int] | None = None


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
        query_tile: int = QUERY_TILE, prompt_kernel: bool = True,
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
        self._seq_generated: list[bool] = []
        # full layers on CPU: a prompt's rows by key segments (``_by_segments``), the same whatever is cached
        self._segments = self.cache.buffer.device.type == "cpu"
        # a prompt's rows on CPU through our kernel where it runs (``prompt_attention_cpu``; prompt_kernel=False:
        # torch's flash kernel by segments, as on CPUs without AVX-512)
        self._prompt_kernel = PromptAttentionKernel.load() if prompt_kernel and self._segments else None
        self._decode_caches: torch.Tensor | None = None  # ``decode_caches``, made on first use

    # ---- per step ----------------------------------------------------------------------------------
    def begin_step(self, seqs: list[StepSequence]) -> None:
        """O(new tokens + blocks read) per group: a decode step costs the same at any context length."""
        bs = self.block_size
        self._seq_query_lens = [s.query_len for s in seqs]
        self._seq_context_lens = [s.context_len for s in seqs]
        self._seq_generated = [s.generated for s in seqs]
        dev = self.cache.buffer.device
        on_dev = lambda a: torch.from_numpy(np.asarray(a, dtype=np.int64)).to(dev)  # noqa: E731
        self._step = []
        for group in self.layout.groups:
            write_b, write_o, reads = [], [], []
            for s in seqs:
                table = s.block_tables[group.group_id]
                end = s.context_len + s.query_len
                new = np.arange(s.context_len, end)
                write_b.append(table[new // bs])
                write_o.append(new % bs)
                first = _key_range(group.spec, s.context_len)
                reads.append(_SeqRead(on_dev(table[first // bs : (end - 1) // bs + 1]), first % bs, end - first, first))
            write_b, write_o = np.concatenate(write_b), np.concatenate(write_o)
            one = (int(write_b[0]), int(write_o[0])) if len(write_b) == 1 else None
            self._step.append(_GroupStep(on_dev(write_b), on_dev(write_o), reads, one))

    @property
    def step_state(self) -> tuple:
        """What ``begin_step`` built (see ``PagedAttentionBackend.step_state``)."""
        return self._step, self._seq_query_lens, self._seq_context_lens, self._seq_generated

    @step_state.setter
    def step_state(self, state: tuple) -> None:
        self._step, self._seq_query_lens, self._seq_context_lens, self._seq_generated = state

    def decode_caches(self) -> torch.Tensor | None:
        """For a C decode step (``hybridkv/model/cpu_decode.c``, its ``CACHE_*`` fields): int64 [layers, 6], layer
        by layer id, its keys' and values' data pointers, the element strides of their [block, slot, head] dims
        (``kv_cache.LayerCache``'s views: the layout stays theirs) and its layer group. None unless the cache is
        float32 on the CPU. Made once (the cache is allocated once); the backend keeps the tensors it points into."""
        if self._decode_caches is None and self.kv_dtype == torch.float32 and self.cache.buffer.device.type == "cpu":
            layers = [self.cache.layers[i] for i in sorted(self.cache.layers)]
            self._decode_caches = torch.tensor([[layer.keys.data_ptr(), layer.values.data_ptr(),
                                                 *layer.keys.stride()[:3], layer.group_id] for layer in layers])
        return self._decode_caches

    def decode_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For a C decode step (``cpu_decode.c``'s ``ROW_*`` fields), of the step ``begin_step`` set: int64 [groups,
        rows, 5], per layer group and row, the block and offset its token's K/V go to, where its blocks start in
        the second tensor, and the slots it reads of them (``_SeqRead``'s lo, count); and every row's blocks (ids,
        in position order) end to end. None unless each sequence computes one generated token (a decode step).

        E.g. one group, rows at context 17 and 3, block size 16, tables [5, 9] and [2]: [[[9, 1, 0, 0, 18], [2, 3, 2,
        0, 4]]] and [5, 9, 2]."""
        if not all(self._seq_generated) or any(n != 1 for n in self._seq_query_lens):
            return None
        rows, blocks, start = [], [], 0
        for step in self._step:
            for read, block, offset in zip(step.reads, step.write_blocks.tolist(), step.write_offsets.tolist()):
                rows.append((block, offset, start, read.lo, read.count))
                blocks.append(read.blocks)
                start += len(read.blocks)
        return torch.tensor(rows).view(len(self._step), -1, 5), torch.cat(blocks)

    def attend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        self.write(layer_id, k, v)
        return self.attend_stored(layer_id, q, scale)

    def write(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's K/V of one layer into their slots."""
        layer = self.cache.layers[layer_id]
        step = self._step[layer.group_id]
        if step.one_slot is not None and k.dtype == self.kv_dtype:
            block, offset = step.one_slot
            layer.keys[block, offset], layer.values[block, offset] = k[0], v[0]
        else:
            # [T, 2, Hkv, D] into [block, K/V, offset]: the advanced indices go first
            kv = torch.stack((k, v), 1)
            kv = kv if kv.dtype == self.kv_dtype else self._to_cache(kv)
            layer.view[step.write_blocks, :, step.write_offsets] = kv

    def attend_stored(self, layer_id: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """``attend`` once the step's K/V of ``layer_id`` are in their slots."""
        layer = self.cache.layers[layer_id]
        step = self._step[layer.group_id]
        seqs = zip(step.reads, self._seq_context_lens, self._seq_generated)
        if len(step.reads) == 1:
            return self._attend_seq(layer, q, *next(seqs), scale)
        if q.shape[0] == len(step.reads):  # one query a sequence (decoding): their outputs side by side
            return torch.cat([self._attend_seq(layer, q[i : i + 1], *seq, scale) for i, seq in enumerate(seqs)])
        out = torch.empty_like(q)
        start = 0
        for n, seq in zip(self._seq_query_lens, seqs):
            out[start : start + n] = self._attend_seq(layer, q[start : start + n], *seq, scale)
            start += n
        return out

    def _attend_seq(self, layer: LayerCache, q: torch.Tensor, read: _SeqRead, context_len: int, generated: bool,
                    scale: float) -> torch.Tensor:
        """One sequence's queries over the keys it reads, gathered block by block. A generated token's row (one a
        step) always takes ``_decode_sdpa``, a prompt's rows of a full layer on CPU ``_by_segments``: each row is
        computed the same way cold, after a cache hit and beside any other sequences. Where our CPU kernel runs, a
        prompt's rows of any layer type take it instead (``PromptAttentionKernel``: each row's arithmetic its own)."""
        if not generated and self._prompt_kernel is not None and self._prompt_kernel.takes(layer):
            return self._prompt_kernel(layer, q, read.blocks, read.first - read.lo, read.first, context_len, scale)
        keys = layer.keys.index_select(0, read.blocks).flatten(0, 1)[read.lo : read.hi]
        values = layer.values.index_select(0, read.blocks).flatten(0, 1)[read.lo : read.hi]
        if layer.spec.keeps_every_token and self._segments and not generated:
            return _by_segments(q, keys, values, context_len, scale)
        if q.shape[0] == 1:
            return _decode_sdpa(q, keys, values, scale)
        return self._attend_tiles(layer.spec, q, keys, values, context_len, read.first, scale)

    def _attend_tiles(
        self, spec: AttentionSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int,
        first_key: int, scale: float,
    ) -> torch.Tensor:
        """One sequence's queries (at ``context_len``...) over its gathered keys (at ``first_key``...), a tile of
        queries at a time."""
        out = torch.empty_like(q)
        for lo in range(0, q.shape[0], self.query_tile):
            hi = min(lo + self.query_tile, q.shape[0])
            # reach is monotone in the position: the tile's first query sees furthest back, its last one furthest on
            k_lo = spec.first_needed_token(context_len + lo) - first_key
            k_hi = context_len + hi - first_key
            q_pos = torch.arange(context_len + lo, context_len + hi, device=q.device)
            k_pos = torch.arange(first_key + k_lo, first_key + k_hi, device=q.device)
            mask = spec.visible(q_pos, k_pos)  # causal and the type's reach
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


def _decode_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``_sdpa`` of one query over every key (no mask) with fewer calls: no casts when all is float32 already.
    (Its query heads as rows of their KV head, [1, Hkv, Hq / Hkv, D], ran 6% faster but moved outputs by ~1e-7,
    enough to flip a near-tie of the default model's chat replies.)"""
    dtype = q.dtype
    if dtype != torch.float32 or k.dtype != torch.float32:
        q, k, v = q.float(), k.float(), v.float()
    q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if q.device.type == "cpu":  # the kernel SDPA picks there, called directly (its choice costs ~3 us a layer)
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q4, k4, v4, 0.0, False, scale=scale)[0]
    else:
        out = F.scaled_dot_product_attention(q4, k4, v4, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    out = out[0].transpose(0, 1)
    return out if dtype == torch.float32 else out.to(dtype)


def _by_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, context_len: int, scale: float) -> torch.Tensor:
    """Full attention on CPU of one sequence's queries (at ``context_len``...) over its keys (at 0...), each query
    computed the same way whatever the other queries of its step: cold or after a cache hit, in a prefill chunk
    of any length or decoding, a query's keys are cut at the same place and each part goes through the same call.

    The keys are cut in segments of ``SEGMENT`` positions. A query in segment j reads keys [0, jS) in one unmasked
    flash call (``SEGMENT`` is the CPU's prompt chunk, so a long prompt's chunks still read their past that way)
    and its own segment's keys, zero-padded to ``SEGMENT``, in a masked one; the two merge by their log-sum-exps,
    as ``_merge`` does it. torch's CPU flash kernel gives a query row the same numbers in calls of any number of
    rows when each of its blocks of query rows holds 4 or more (``_padded_rows``), and the same for key blocks
    that are masked out; the masked own segment's fixed width keeps the rest of its arithmetic fixed.

    E.g. SEGMENT 256, a cached prefix of 300 and 5 new tokens (positions 300..304): keys [0, 256) unmasked, keys
    [256, 512) with 256..304 visible as each query's causal mask says; a cold 305-token prompt's queries 300..304
    took the same two calls in its second segment."""
    out = torch.empty_like(q)
    end = context_len + q.shape[0]
    start = context_len
    while start < end:
        seg = start // SEGMENT * SEGMENT
        stop = min(end, seg + SEGMENT)
        rows = slice(start - context_len, stop - context_len)
        own_k = k.new_zeros((SEGMENT, *k.shape[1:]))
        own_v = v.new_zeros((SEGMENT, *v.shape[1:]))
        own_k[: stop - seg], own_v[: stop - seg] = k[seg:stop], v[seg:stop]
        visible = torch.arange(seg, seg + SEGMENT)[None, :] <= torch.arange(start, stop)[:, None]
        merged = _flash_rows(q[rows], own_k, own_v, visible, scale)
        if seg:
            merged = _merge(*merged, *_flash_rows(q[rows], k[:seg], v[:seg], None, scale))
        out[rows] = merged[0][0].transpose(0, 1)[: stop - start].to(q.dtype)
        start = stop
    return out


def _flash_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output [1, Hq, R', D], log-sum-exp [1, Hq, R']) of torch's CPU flash kernel, float32, for queries q [R, Hq,
    D] padded with zero rows to R' = ``_padded_rows(R)`` (``mask`` [R, K], True: attend; padded rows see key 0)."""
    pad = _padded_rows(q.shape[0]) - q.shape[0]
    as_4d = lambda x: x.float().transpose(0, 1)[None]  # noqa: E731
    q4 = as_4d(F.pad(q, (0, 0, 0, 0, 0, pad)) if pad else q)
    if mask is not None:
        mask = F.pad(mask, (0, 0, 0, pad), value=True) if pad else mask
        mask = torch.zeros(mask.shape).masked_fill_(~mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q4, as_4d(k), as_4d(v), 0.0, False, attn_mask=mask, scale=scale)


def _padded_rows(n: int) -> int:
    """Query rows to give torch's CPU flash kernel for ``n``, so that each of its blocks of query rows (32, 64 or
    256 by the count) holds 4 or more: a row of a block of 1 to 3 comes out otherwise (another GEMM path).
    E.g. 1 -> 4, 33 -> 36, 32 -> 32."""
    n = max(n, 4)
    while True:
        block = 32 if n < 192 else 64 if n < 768 else 256
        if 0 < n % block < 4:
            n += 4 - n % block
            continue
        return n


def _merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two flash outputs [1, H, R, D] over disjoint keys, by their log-sum-exps [1, H, R], as one. The exp and log
    run on [R, 32k] (each row's heads, zero-padded to a multiple of 32): torch computes a tensor's last partial
    vector another way, so a row must not land there in one call and not in another."""
    heads, rows = lse_a.shape[1], lse_a.shape[2]
    per_row = lambda lse: F.pad(lse[0].t(), (0, -heads % 32))  # noqa: E731
    a, b = per_row(lse_a), per_row(lse_b)
    lse = torch.logaddexp(a, b)
    weight = lambda x: torch.exp(x - lse)[:, :heads].t()[None, :, :, None]  # noqa: E731
    return out_a * weight(a) + out_b * weight(b), lse[:, :heads].t()[None]
