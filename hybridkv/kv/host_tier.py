"""The host-memory tier of the prefix cache: bookkeeping of pages kept in RAM after the device pool evicted them.

The device pool (``block_pool.py``) holds cached blocks until it needs their pages. With a host tier, a cached
block the pool evicts from its LRU queue is first copied to a host page, keyed by the same block hash; a later
prefix lookup finds it there (``tiers.DeviceAndHost``: the longest hit is the fixed point over device
*and* host blocks, per group) and it is copied back into a freshly allocated device block before the request's
first step reads it. Host pages have the device pages' size (all layers of one layer group, ``block_size`` tokens).

What is written back is exactly what the device pool retains. The managers free a block to the LRU queue only when a
future hit can use it (full attention: every block; sliding/chunked: the blocks inside the reach before a retained
hit point, see ``managers.py``), and to the evict-first queue otherwise; only LRU blocks are written back. So for a
hybrid model the host tier holds full-attention prefixes whole and, per sliding or chunked group, only the windows
hits can resume from (llm-d's "partial transfers"; vLLM's connectors copy every block of every group).

This file is bookkeeping only (no torch): which host slot holds which hash, the host tier's own LRU, and the copy
operations of the next step (``take_ops``), executed by ``hybridkv.engine.block_copier`` on every rank before the
step's forward. Operations run in the order they were recorded, so a write-back of a device page always runs before
a load or a forward reuses that page, and a load from a host slot before a later write-back into the same slot.

Example (host tier of 2 pages): the pool evicts cached blocks 7 (hash a) then 9 (hash b): host slots 0, 1 get
``store 7->0, store 9->1``. A third eviction (hash c) evicts the host tier's LRU entry (a) and reuses slot 0. A
request whose prefix is (b) gets a fresh device block, say 4, and ``load 1->4`` runs before its first step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from hybridkv.kv.block_pool import LRU, NOT_FREE, BlockHashKey, KVBlock
from hybridkv.kv.events import HOST_MEDIUM, BlockStored, KVEventLog


@dataclass(slots=True, eq=False)
class HostBlock:
    """A prefix-hit entry found in the host tier; becomes a fresh device block when the request is admitted.

    ``ref_cnt`` and ``free_list`` read like a free cached device block's, so admission counts it as one device
    block to take (``SingleTypeManager.num_blocks_to_allocate``) and it is never taken for an evict-first block.
    """

    slot: int
    key: BlockHashKey
    ref_cnt: int = 0
    free_list: int = NOT_FREE


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Pages to copy, in one direction: ``device_blocks[i]`` <-> ``host_slots[i]`` (int64 arrays, same length)."""

    to_host: bool  # True: write-back of evicted device pages; False: load of host pages into device blocks
    device_blocks: np.ndarray
    host_slots: np.ndarray

    def __len__(self) -> int:
        return len(self.device_blocks)


@dataclass(slots=True)
class HostTierStats:
    hit_tokens: int = 0  # prefix-hit tokens the device pool alone would not have served
    bytes_written: int = 0  # device -> host (one rank's pages)
    bytes_read: int = 0  # host -> device
    evictions: int = 0  # host pages dropped for newer ones (the host tier's LRU)
    device_evictions: int = 0  # cached blocks the device pool evicted
    kept: int = 0  # of those, the ones a future hit can use, now held here (written back, or already here)


class HostTier:
    """``num_blocks`` host pages of ``page_bytes`` each, found by block hash, evicted least recently used first.

    >>> tier = HostTier(2, page_bytes=4096)
    >>> tier.num_free_blocks, tier.usage()
    (2, 0.0)
    """

    def __init__(self, num_blocks: int, page_bytes: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host tier needs at least one page, got {num_blocks}")
        self.num_blocks = num_blocks
        self.page_bytes = page_bytes
        self._slots: OrderedDict[BlockHashKey, int] = OrderedDict()  # least recently used first
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: slots come out 0, 1, 2 ...
        self._ops: list[tuple[bool, int, int]] = []  # (to_host, device block, host slot), in issue order
        self.stats = HostTierStats()
        self.events: KVEventLog | None = None  # KV events (kv/events.py), when enabled

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._slots)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, key: BlockHashKey) -> HostBlock | None:
        slot = self._slots.get(key)
        return None if slot is None else HostBlock(slot, key)

    # ---- device -> host ----------------------------------------------------------------------------
    def write_back(self, block: KVBlock) -> None:
        """The device pool is about to reuse a cached block's page: keep a copy if a future hit can use it.

        Only blocks the managers freed to the LRU queue qualify (the retention rule of ``managers.py``); one
        already here is only refreshed in the LRU order. A full host tier drops its least recently used page.
        """
        self.stats.device_evictions += 1
        if block.free_list != LRU:
            return
        self.stats.kept += 1
        key = block.hash_key
        if key in self._slots:
            self._slots.move_to_end(key)
            return
        if not self._free:
            if not self._slots:  # every page is being loaded by the admission in progress
                self.stats.kept -= 1
                return
            dropped, slot = self._slots.popitem(last=False)
            self._free.append(slot)
            self.stats.evictions += 1
            if self.events is not None:
                self.events.removed(dropped[1], HOST_MEDIUM, dropped[0])
        slot = self._free.pop()
        self._slots[key] = slot
        if self.events is not None:  # the page's tokens and parent are not kept here: vLLM's CPU tier sends none
            self.events.stored(BlockStored(key[1], HOST_MEDIUM, [key[0]], None, []))
        self._ops.append((True, block.block_id, slot))
        self.stats.bytes_written += self.page_bytes

    # ---- host -> device ----------------------------------------------------------------------------
    def hold(self, blocks: list[HostBlock]) -> None:
        """Take the pages about to be loaded out of the LRU, so write-backs of the device blocks freed to make
        room for them cannot reuse their slots before the loads are recorded (``load`` puts them back)."""
        for b in blocks:
            del self._slots[b.key]

    def load(self, block: HostBlock, device_block: int) -> None:
        """Copy a held host page into ``device_block`` before the next step; the page stays here, most recent."""
        self._slots[block.key] = block.slot
        self._ops.append((False, device_block, block.slot))
        self.stats.bytes_read += self.page_bytes

    # ---- the next step's copies --------------------------------------------------------------------
    def take_ops(self) -> list[BlockCopy]:
        """The copies recorded since the last call, in order, runs of one direction batched together."""
        ops, self._ops = self._ops, []
        out: list[BlockCopy] = []
        start = 0
        for i in range(1, len(ops) + 1):
            if i == len(ops) or ops[i][0] != ops[start][0]:
                run = np.array([op[1:] for op in ops[start:i]], dtype=np.int64)
                out.append(BlockCopy(ops[start][0], run[:, 0], run[:, 1]))
                start = i
        return out

    def reset(self) -> None:
        """Forget every page (the device pool's prefix-cache reset); copies already recorded still run."""
        self._slots.clear()
        self._free = list(range(self.num_blocks - 1, -1, -1))


def host_tier_tokens(host_bytes: int, page_bytes: int, block_size: int, num_full_groups: int) -> int | None:
    """Tokens of context the host tier holds: full-attention groups keep one page per ``block_size`` tokens each
    (sliding/chunked groups keep only windows, a bounded extra per hit point). None without full-attention layers."""
    if num_full_groups == 0:
        return None
    return host_bytes // page_bytes // num_full_groups * block_size
