"""KV cache events: what became findable by a prefix lookup and what stopped being, per layer group and tier.

A block is *stored* when its hash is registered where a lookup finds it (the device pool's ``cache_block``, or a
host-tier page written back) and *removed* when that registration goes (the pool reuses the page, the host tier
drops its least recently used page). A prefix-cache reset clears everything at once. Events are recorded here in
the order they happen, only when the cache manager was given a log (``KVCacheManager(..., events=KVEventLog())``);
without one every hook is a single ``is None`` test. The engine drains the log once per step and publishes it
(``hybridkv/engine/kv_events.py``: vLLM's wire format over ZMQ); this file knows nothing of the wire.

Block 4, one full group: a 9-token prompt computed in one step records
``BlockStored(group 0, "GPU", [h0, h1], parent None, tokens 0..7)``; when the pool later reuses h1's page,
``BlockRemoved(group 0, "GPU", [h1])``; with a host tier that page is first written back:
``BlockStored(group 0, "CPU", [h1], parent None, tokens [])`` (as vLLM's CPU offloading reports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

# vLLM's medium names (``MEDIUM_GPU``, ``MEDIUM_CPU``): the engine's own pool, whatever the device, and host RAM
DEVICE_MEDIUM = "GPU"
HOST_MEDIUM = "CPU"


@dataclass(slots=True)
class BlockStored:
    """Consecutive blocks of one request's chain, findable from now on in ``group_id`` on ``medium``.

    ``parent_block_hash``: the hash of the block before the first (None at the start of a sequence, or where the
    tier does not know it); ``token_ids``: the blocks' tokens in order (empty where the tier does not know them);
    ``cache_salt``: the salt hashed into the first block when the run starts at block 0."""

    group_id: int
    medium: str
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    cache_salt: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Blocks no lookup in ``group_id`` on ``medium`` finds any more."""

    group_id: int
    medium: str
    block_hashes: list[bytes]


@dataclass(slots=True)
class AllBlocksCleared:
    """Every block of every group and tier is gone (a prefix-cache reset)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventLog:
    """Events not yet taken, oldest first. Removals of one group and tier in a row share one event (the pool
    evicts block by block; a 1,000-block allocation under pressure gives one ``BlockRemoved``, not 1,000)."""

    block_size: int
    pending: list[KVEvent] = field(default_factory=list)

    def stored(self, event: BlockStored) -> None:
        self.pending.append(event)

    def stored_blocks(self, group_id: int, indices: list[int], block_hashes: Sequence[bytes],
                      token_ids: Sequence[int], cache_salt: str | None) -> None:
        """Blocks ``indices`` (ascending) of one request's chain became findable on the device: one event per run
        of consecutive blocks, as a chain with its parent. Block 2, indices [0, 1, 3] -> runs [0, 1] (parent None,
        tokens 0..3, the salt) and [3] (parent h2, tokens 6, 7)."""
        bs, start = self.block_size, 0
        for k in range(1, len(indices) + 1):
            if k < len(indices) and indices[k] == indices[k - 1] + 1:
                continue
            lo, hi = indices[start], indices[k - 1] + 1
            self.pending.append(BlockStored(
                group_id, DEVICE_MEDIUM, list(block_hashes[lo:hi]), block_hashes[lo - 1] if lo else None,
                list(token_ids[lo * bs:hi * bs]), cache_salt if lo == 0 else None))
            start = k

    def removed(self, group_id: int, medium: str, block_hash: bytes) -> None:
        last = self.pending[-1] if self.pending else None
        if type(last) is BlockRemoved and last.group_id == group_id and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            self.pending.append(BlockRemoved(group_id, medium, [block_hash]))

    def cleared(self) -> None:
        self.pending.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        out, self.pending = self.pending, []
        return out
