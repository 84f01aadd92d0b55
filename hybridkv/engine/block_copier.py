"""Runs the host tier's page copies (``hybridkv.kv.host_tier.BlockCopy``) on one rank, before the step's forward.

Each rank holds its own host pages (its own KV heads: the same slots as every other rank, pages of its size) next
to its device KV buffer, and runs the step's ``block_ops`` in order:

- on CUDA, on a copy stream, through pinned host memory: the copy stream first waits for the work already queued on
  the compute stream (a write-back reads a page an earlier forward wrote), then the compute stream waits for the
  copies (the forward reads loaded pages and overwrites pages just written back). The copies of a step run as
  one batch ahead of the whole forward, not layer by layer: a page holds every layer of its group, so a layer's
  pages arrive with its group's, and the forward of a loading step is short next to the recompute it replaces.
- on the CPU, as plain tensor copies in order (what the tests run).

Pages are moved in runs of consecutive host slots: a run is one contiguous host copy, gathered from or scattered to
its device blocks by index on the device. On CUDA the run goes through a device staging buffer of at most
``STAGING_BYTES`` (a copy engine transfer per chunk, then a device-side scatter), so bandwidth does not depend on
where the fresh device blocks happen to lie.
"""

from __future__ import annotations

import numpy as np
import torch

from hybridkv.kv.host_tier import BlockCopy

STAGING_BYTES = 64 << 20


class BlockCopier:
    def __init__(self, device_buffer: torch.Tensor, num_host_blocks: int) -> None:
        """``device_buffer``: the rank's KV pages ``[num_blocks, page_elems]`` (``PagedKVCache.buffer``)."""
        # Pages are copied as bytes: every KV dtype (fp8 included) moves the same way.
        self.device_buffer = device_buffer.view(torch.uint8)
        self.page_bytes = self.device_buffer.shape[1]
        self.cuda = device_buffer.is_cuda
        shape = (num_host_blocks, self.page_bytes)
        if self.cuda:  # pinned: the copy engine reads and writes it directly, asynchronously
            self.host = torch.empty(shape, dtype=torch.uint8, pin_memory=True)
            stage_pages = max(1, min(num_host_blocks, STAGING_BYTES // self.page_bytes))
            self.stage = torch.empty((stage_pages, self.page_bytes), dtype=torch.uint8, device=device_buffer.device)
            self.stream = torch.cuda.Stream(device_buffer.device)
        else:  # zeros: pages never written stay unresident
            self.host = torch.zeros(shape, dtype=torch.uint8)
            self.stage = self.stream = None
        self.last_run: tuple[torch.cuda.Event, torch.cuda.Event, int] | None = None  # CUDA: for benchmarks

    def run(self, ops: list[BlockCopy]) -> None:
        """Issue ``ops`` in order; the next work on the current stream sees their results."""
        if not ops:
            return
        if not self.cuda:
            for op in ops:
                self._copy(op)
            return
        compute = torch.cuda.current_stream(self.device_buffer.device)
        self.stream.wait_stream(compute)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            start.record()
            for op in ops:
                self._copy(op)
            end.record()
        compute.wait_stream(self.stream)
        self.last_run = (start, end, sum(len(op) for op in ops) * self.page_bytes)

    def last_run_seconds(self) -> float:
        """Wall time of the copies of the last ``run`` on the copy stream (waits for them)."""
        start, end, _ = self.last_run
        end.synchronize()
        return start.elapsed_time(end) / 1000

    def _copy(self, op: BlockCopy) -> None:
        slots, blocks = _sorted_by_slot(op)
        blocks = torch.from_numpy(blocks).to(self.device_buffer.device)  # one transfer of the op's block ids
        for lo, hi in _runs(slots):
            first = int(slots[lo]) - lo  # run entry i is host slot first + i
            step = hi - lo if self.stage is None else len(self.stage)
            for i in range(lo, hi, step):
                idx = blocks[i : min(i + step, hi)]
                host = self.host[first + i : first + i + len(idx)]
                if op.to_host:
                    self._store(idx, host)
                else:
                    self._load(idx, host)

    def _store(self, idx: torch.Tensor, host: torch.Tensor) -> None:
        if self.stage is None:
            torch.index_select(self.device_buffer, 0, idx, out=host)
            return
        stage = self.stage[: len(idx)]
        torch.index_select(self.device_buffer, 0, idx, out=stage)
        host.copy_(stage, non_blocking=True)

    def _load(self, idx: torch.Tensor, host: torch.Tensor) -> None:
        if self.stage is None:
            self.device_buffer.index_copy_(0, idx, host)
            return
        stage = self.stage[: len(idx)]
        stage.copy_(host, non_blocking=True)
        self.device_buffer.index_copy_(0, idx, stage)


def _sorted_by_slot(op: BlockCopy) -> tuple[np.ndarray, np.ndarray]:
    """Host slots and their device blocks in slot order. A slot written twice in one batch (the host tier reused
    it) keeps the order the copies were recorded in, so the last write wins."""
    order = np.argsort(op.host_slots, kind="stable")
    return op.host_slots[order], np.ascontiguousarray(op.device_blocks[order])


def _runs(slots: np.ndarray):
    """``[lo, hi)`` index ranges of consecutive host slots (a repeated slot starts a new run)."""
    breaks = np.flatnonzero(np.diff(slots) != 1) + 1
    yield from zip(np.concatenate(([0], breaks)).tolist(), np.concatenate((breaks, [len(slots)])).tolist())
