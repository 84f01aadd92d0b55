"""How an FP8 cache's long prefill reach is cut into segments (``SegmentPlanner``): each is widened to bf16 into a
scratch and attended by the bf16 kernel (exact, and one pass over the keys instead of one per query tile), or with
FP8 compute, copied as V^T in e4m3 for the FP8 dots. Planning only: numpy on the host, the result sent to the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from hybridkv.kv.specs import AttentionSpec

# FP8 cache, long prefill: the reach is widened to bf16 in segments of at most this many bytes per step (Scout's
# rank, one sequence: 1M tokens), then attended by the bf16 kernel (16K queries over 1M keys on an H200: 99.5 ms
# vs 122 ms widening inside the kernel). The engine reserves 1.5x this (the gather's FP8 copy
# lives beside the scratch for a moment).
SEGMENT_BYTES = 512 << 20


@dataclass(slots=True)
class Segment:
    lo: int  # key positions [lo, hi)
    hi: int
    blocks: torch.Tensor  # [n] int64: the cache blocks of this segment, in scratch order


def segment_tokens(reaches: list[int], budget: int, unit: int) -> int:
    """The longest segment (a multiple of ``unit``, at least one) whose scratch holds at most ``budget`` tokens:
    a segment of S keys holds ``sum(min(S, reach))`` of them over the step's sequences.

    E.g. reaches [1M, 4K, 4K] and a budget of 1M: S = 1M - 8K (the two short sequences take 8K of any segment)."""
    reaches = sorted(reaches)
    for i, r in enumerate(reaches):
        # S >= r for the i shortest: they take sum(reaches[:i]) + r; the rest take S each
        longest = (budget - sum(reaches[:i])) // (len(reaches) - i)
        if longest < r:
            return max(unit, longest // unit * unit)
    return max(unit, -(-reaches[-1] // unit) * unit)


def plan_segments(first: list[int], ends: list[int], table: np.ndarray, block_size: int, seg_tokens: int):
    """Cut a step's key range into segments of ``seg_tokens`` keys (a multiple of ``block_size``).

    Sequence i's queries see keys ``[first[i], ends[i])``; ``table[i]`` holds its blocks. Returns the segments as
    ``(lo, hi, cache blocks in scratch order)`` and a table of each block's row in its segment's scratch. E.g.
    4-token blocks, 8-token segments, one sequence seeing keys 2..13 with table [7, 3, 9, 4]: segment [0, 8)
    widens blocks [7, 3] into scratch rows 0 and 1, segment [8, 16) widens [9, 4] into rows 0 and 1, and the
    scratch table is [0, 1, 0, 1]. Blocks wholly below ``first`` (dropped by a chunk or window) are never read."""
    seg_blocks = seg_tokens // block_size
    first_b = [f // block_size for f in first]
    end_b = [-(-e // block_size) for e in ends]
    scratch_table = np.zeros_like(table)
    segments = []
    for lo_b in range(0, max(end_b), seg_blocks):
        gather, rows = [], 0
        for i in range(len(ends)):
            a, b = max(first_b[i], lo_b), min(end_b[i], lo_b + seg_blocks)
            if a < b:
                scratch_table[i, a:b] = np.arange(rows, rows + b - a)
                gather.append(table[i, a:b])
                rows += b - a
        if rows:
            segments.append((lo_b * block_size, (lo_b + seg_blocks) * block_size, np.concatenate(gather)))
    return segments, scratch_table


@dataclass(frozen=True, slots=True)
class SegmentPlanner:
    """The segments of a prefill step's layer group over an FP8 cache, each holding at most ``segment_bytes``:
    bf16 K and V (4 bytes a value), or with FP8 compute V's transposed e4m3 copy alone (1 byte)."""

    block_size: int
    segment_bytes: int
    fp8_compute: bool

    def plan(self, spec: AttentionSpec, seqs, table: np.ndarray, key_tile: int, to_device):
        """(segments, scratch table on the device) of the step's sequences ``seqs`` (``StepSequence``) whose block
        tables in this group are ``table``; segments start on ``key_tile`` boundaries. ``to_device`` sends a numpy
        array to the device."""
        unit = max(self.block_size, key_tile)  # segments start on key-tile boundaries
        # bf16 K and V; FP8 compute: V's transposed e4m3 copy (gathered from the pages by the same pass)
        per_token = spec.num_kv_heads * spec.head_dim * (1 if self.fp8_compute else 4)
        first = [spec.first_needed_token(s.context_len) for s in seqs]
        ends = [s.context_len + s.query_len for s in seqs]
        # whole blocks round each reach out: its last block, and its first where a window starts inside one
        budget = self.segment_bytes // per_token - 2 * len(seqs) * self.block_size
        reaches = [e - f for f, e in zip(first, ends)]
        if self.fp8_compute and sum(reaches) <= budget:
            # the whole step in one segment: no merging pass, and the windows of local layers are not cut in two
            seg_tokens = -(-max(ends) // unit) * unit
        else:
            seg_tokens = segment_tokens(reaches, budget, unit)
        segments, scratch_table = plan_segments(first, ends, table, self.block_size, seg_tokens)
        return ([Segment(lo, hi, to_device(blocks.astype(np.int64))) for lo, hi, blocks in segments],
                to_device(scratch_table))
