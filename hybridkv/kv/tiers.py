"""Where a prefix lookup looks and how its hit reaches the device: the pool alone, or the pool and the host tier.

The coordinator is given one of the two at construction and never asks which:

- ``DeviceOnly``: lookups see the device pool; a hit's blocks are already there.
- ``DeviceAndHost``: lookups see the pool, then the host tier (``host_tier.py``); the pool's evictions are written
  back to host pages, and a hit's host entries become fresh device blocks whose pages the next step loads.

Block 2, one full group, 8 usable blocks, a host tier of 4 pages. Request x (9 tokens, table ``[1, 2, 3, 4, 5]``)
finishes; request y then takes blocks 4 and 3 from the LRU queue (x's tail first), so their pages are written back
to host slots 0 and 1. A prompt z = x + one token hits 8 tokens, 4 of them only thanks to the host
(``host_tokens``): blocks 1 and 2 on the device, slots 1 and 0 on the host. Admission takes two fresh device blocks
(3 and 4 again, once y is gone), z's table is ``[1, 2, 3, 4, 8]``, and the next ``take_ops`` loads slots ``[1, 0]``
into blocks ``[3, 4]``, after the write-backs recorded before.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable

from hybridkv.kv.block_pool import BlockHashKey, BlockPool, KVBlock
from hybridkv.kv.host_tier import BlockCopy, HostBlock, HostTier
from hybridkv.kv.managers import Lookup
from hybridkv.kv.request import CacheHit, KVRequest

# The coordinator's longest hit of one request over the blocks ``lookup`` finds.
LongestHit = Callable[[KVRequest, Lookup], CacheHit]


class DeviceOnly:
    """No host tier: the device pool is the whole prefix cache."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def find(self, req: KVRequest, longest_hit: LongestHit) -> CacheHit:
        return longest_hit(req, self.pool.lookup)

    def fetch(self, req: KVRequest, hit: CacheHit) -> list[KVBlock]:
        """Every block of a device-only hit is on the device already: nothing to take."""
        return []

    def count_hit(self, hit: CacheHit) -> None:
        """No host tier, no host-tier metrics."""

    def take_ops(self) -> list[BlockCopy]:
        return []

    def reset(self) -> None:
        """Nothing beyond the pool to forget."""


class DeviceAndHost:
    """The device pool backed by ``host``: what the pool evicts is kept in RAM and found again by lookups."""

    def __init__(self, pool: BlockPool, host: HostTier) -> None:
        self.pool = pool
        self.host = host
        pool.evict_listener = host.write_back

    def lookup(self, key: BlockHashKey) -> KVBlock | HostBlock | None:
        return self.pool.lookup(key) or self.host.lookup(key)

    def find(self, req: KVRequest, longest_hit: LongestHit) -> CacheHit:
        """The longest hit over device and host blocks. Each host entry costs one fresh device block at
        admission, as recomputing that block would: a hit whose loads cannot get blocks waits exactly where a
        recompute would, and nothing is taken until the coordinator admits the request."""
        hit = longest_hit(req, self.lookup)
        if any(type(b) is HostBlock for blocks in hit.blocks for b in blocks):
            hit.host_tokens = hit.num_tokens - longest_hit(req, self.pool.lookup).num_tokens
        return hit

    def fetch(self, req: KVRequest, hit: CacheHit) -> list[KVBlock]:
        """Turn ``req``'s hit's host entries into fresh device blocks, published under their hashes, whose pages the
        next step loads. Returns every block of the hit with one temporary reference, which the caller drops
        once the managers hold theirs: the hit's device blocks are taken first, so that allocating the fresh
        ones (which may evict) cannot evict them."""
        wanted = [(gid, i, b) for gid, blocks in enumerate(hit.blocks) for i, b in enumerate(blocks)
                  if type(b) is HostBlock]
        if not wanted:
            return []
        held: list[KVBlock] = []
        for gid, blocks in enumerate(hit.blocks):
            device = [b for b in blocks if type(b) is not HostBlock]
            self.pool.touch(device, gid)
            held += device
        # Every fresh block is taken before any load is recorded: the write-backs of the blocks they evict then
        # cannot reuse the pages being loaded, and the loaded pages stay the host tier's most recent.
        self.host.hold([b for _, _, b in wanted])
        per_group = Counter(gid for gid, _, _ in wanted)
        fresh: list[KVBlock] = []
        for gid in range(len(hit.blocks)):  # ``wanted`` is in group order
            fresh += self.pool.get_new_blocks(per_group[gid], gid)
        published: dict[int, list[int]] = {}
        for (gid, i, host_block), block in zip(wanted, fresh):
            if self.pool.cache_block(block, host_block.key):
                published.setdefault(gid, []).append(i)
            self.host.load(host_block, block.block_id)
            hit.blocks[gid][i] = block
        if self.pool.events is not None:
            for gid, indices in published.items():
                self.pool.events.stored_blocks(gid, indices, req.block_hashes, req.all_token_ids, req.cache_salt)
        return held + fresh

    def count_hit(self, hit: CacheHit) -> None:
        self.host.stats.hit_tokens += hit.host_tokens

    def take_ops(self) -> list[BlockCopy]:
        return self.host.take_ops()

    def reset(self) -> None:
        self.host.reset()
