"""What the Triton backend works out once a step for every layer (``TritonStepState``; per layer group
``GroupMeta``, whose ``launch`` is the kernel its launches go to), and what one attention launch is given:
``launch(q, out, call, kv, keys)`` with the layer's ``LayerCall``, the ``KVSource`` it reads and the ``KeyRange``
it attends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from hybridkv.kv.specs import AttentionSpec
from hybridkv.model.attention.fp8_segments import Segment
from hybridkv.model.attention.kernel_configs import KernelConfig


@dataclass(slots=True)
class LayerCall:
    """One layer's attention in a step: its shape and scales, the step's and its group's metadata, and the
    float32 partial outputs and LSE of a KV range split or cut into segments (None: written to ``out`` at once)."""

    spec: AttentionSpec
    scale: float
    k_scale: float
    v_scale: float
    step: TritonStepState
    meta: GroupMeta
    part: torch.Tensor | None  # [splits, T, Hq, D]
    lse: torch.Tensor | None  # [splits, T, Hq]


@dataclass(slots=True)
class KVSource:
    """The keys and values one launch reads: a layer's pages, or a segment's scratch widened to the queries' dtype;
    with FP8 compute also the segment's transposed V (e4m3) and its table."""

    cache: torch.Tensor  # flat from the layer's (or the scratch's) first element
    table: torch.Tensor  # [S, max blocks] int32: each sequence's blocks in ``cache``
    stride_block: int
    quant: bool  # e4m3 values, widened in the kernel
    vt: torch.Tensor | None = None  # [heads * head_dim, columns]
    vt_table: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class KeyRange:
    """The key positions ``[lo, hi)`` one launch attends; a segment's partial outputs are merged with the other
    segments' (``segmented``), into what the segments before left (``accumulate``)."""

    lo: int = 0
    hi: int = 2**31 - 1
    segmented: bool = False
    accumulate: bool = False


ALL_KEYS = KeyRange()


class AttentionLaunch(Protocol):
    """One attention launch over ``kv`` for the rows of ``q`` into ``out`` (or ``call``'s partial outputs)."""

    # FP8 compute: the order of each page's keys in a segment's V^T copy (None: this kernel takes no FP8 compute)
    v_columns: torch.Tensor | None

    def __call__(self, q: torch.Tensor, out: torch.Tensor, call: LayerCall, kv: KVSource, keys: KeyRange) -> None:
        ...


@dataclass(slots=True)
class Launches:
    """The kernels a backend launches: Triton's, and the Hopper CUDA kernel's where it is built."""

    triton: AttentionLaunch
    cuda: AttentionLaunch | None


@dataclass(slots=True)
class GroupMeta:
    table: torch.Tensor  # [S, max_blocks] int32
    slot_block: torch.Tensor  # [T] int32
    slot_offset: torch.Tensor  # [T] int32
    num_splits: int
    config: KernelConfig  # the tiles its launches run; a decode step's may differ by group (``decode_tiles``)
    launch: AttentionLaunch  # the kernel they go to (the CUDA kernel or Triton): decided with the step
    # FP8 long prefill: segments widened to bf16 one at a time, and each block's row in its segment's scratch
    segments: list[Segment] = field(default_factory=list)
    scratch_table: torch.Tensor | None = None


@dataclass(slots=True)
class TritonStepState:
    """What ``begin_step`` (or ``begin_static_decode``) works out once for every layer of the step."""

    config: KernelConfig  # the prefill or the decode tiles
    tokens: int  # query tokens per tile
    num_tiles: int
    seq: list[torch.Tensor]  # tile_seq, tile_q0, q_loc, q_len, ctx_len
    # the CUDA kernel's own tiles (``hopper_attention.work_items``: 128 rows each, a tile may end inside a token's
    # heads), [CTAs, 4] int32, one load a CTA
    tiles: torch.Tensor | None = None
    groups: list[GroupMeta] = field(default_factory=list)  # per layer group
