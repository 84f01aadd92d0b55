"""One pool of KV blocks shared by every attention type.

Memory goes where requests need it: a full layer group and a sliding one draw pages from the same pool, with
no fixed ratio between them. Each block has a reference count (requests sharing a cached prefix share blocks)
and, once full and computed, may carry a hash under which later requests find it.

Free blocks wait in three places, taken in this order when new blocks are needed:

1. ``uncached``: free blocks with no hash; reusing them loses nothing.
2. ``evict_first``: cached blocks unlikely to be hit again (sliding/chunked blocks that fell out of the window
   away from any retained hit point, see ``managers.py``), least recently freed first.
3. ``lru``: every other cached block, least recently freed first.

So a cached block is evicted only when no free uncached block exists. A prefix hit "touches" a cached free block,
taking it out of whichever list holds it in O(1) (doubly linked lists).

Block 0 is the null block: never allocated, never freed, referenced by tables where tokens were dropped.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Iterable

from hybridkv.kv.events import DEVICE_MEDIUM, KVEventLog

BlockHashKey = tuple[bytes, int]  # (chained content hash, layer group id)

NOT_FREE, UNCACHED, EVICT_FIRST, LRU = 0, 1, 2, 3


@dataclass(slots=True, eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    group_id: int = -1  # the layer group that last took it
    hash_key: BlockHashKey | None = None
    free_list: int = NOT_FREE
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)


class _LinkedQueue:
    """Doubly linked list of blocks with O(1) append, pop from the head and removal from the middle."""

    __slots__ = ("head", "tail", "size")

    def __init__(self) -> None:
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev
        last.next, block.prev, block.next, self.tail.prev = block, last, self.tail, block
        self.size += 1

    def extend(self, blocks: list[KVBlock]) -> None:
        """``append`` each of ``blocks`` in order, linked in one pass."""
        last = self.tail.prev
        for block in blocks:
            last.next, block.prev = block, last
            last = block
        last.next, self.tail.prev = self.tail, last
        self.size += len(blocks)

    def remove(self, block: KVBlock) -> None:
        block.prev.next, block.next.prev = block.next, block.prev
        block.prev = block.next = None
        self.size -= 1

    def popleft(self) -> KVBlock:
        block = self.head.next
        if block is self.tail:
            raise IndexError("pop from an empty queue")
        self.remove(block)
        return block

    def __iter__(self):
        node = self.head.next
        while node is not self.tail:
            yield node
            node = node.next


class BlockPool:
    """``num_blocks`` pages, block 0 reserved as the null block.

    >>> pool = BlockPool(4)
    >>> [b.block_id for b in pool.get_new_blocks(2)], pool.num_free_blocks
    ([1, 2], 1)
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never reaches zero, so it is never freed
        self._uncached: list[KVBlock] = self.blocks[:0:-1]  # popped from the end: ids come out 1, 2, 3 ...
        for block in self._uncached:
            block.free_list = UNCACHED
        self._evict_first = _LinkedQueue()
        self._lru = _LinkedQueue()
        self._cached: dict[BlockHashKey, KVBlock] = {}
        self.num_evictions = 0
        # numbers every edit of every block table drawing from this pool (``managers.BlockTable.version``)
        self.table_versions = itertools.count(1)
        self.in_use_by_group: dict[int, int] = {}
        # Host tier hook (kv/host_tier.py): sees each cached block about to be reused, while its queue and page
        # still say what it holds, so it can copy the page out first.
        self.evict_listener: Callable[[KVBlock], None] | None = None
        # KV events (kv/events.py): None unless enabled, so the hooks below cost one test each
        self.events: KVEventLog | None = None

    # ---- sizes -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._uncached) + self._evict_first.size + self._lru.size

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    # ---- allocation --------------------------------------------------------------------------------
    def get_new_blocks(self, n: int, group_id: int = 0) -> list[KVBlock]:
        """Take ``n`` free blocks (ref count 1), evicting cached ones only when no uncached block is left."""
        if n > self.num_free_blocks:
            raise MemoryError(f"asked for {n} KV blocks but only {self.num_free_blocks} are free")
        out = []
        for _ in range(n):
            if self._uncached:
                block = self._uncached.pop()
            else:
                queue = self._evict_first if self._evict_first.size else self._lru
                block = queue.popleft()
                self._evict(block)
            block.free_list = NOT_FREE
            block.ref_cnt = 1
            block.group_id = group_id
            out.append(block)
        self.in_use_by_group[group_id] = self.in_use_by_group.get(group_id, 0) + n
        return out

    def _evict(self, block: KVBlock) -> None:
        if self.evict_listener is not None:
            self.evict_listener(block)
        key = block.hash_key
        del self._cached[key]
        block.hash_key = None
        if self.events is not None:
            self.events.removed(key[1], DEVICE_MEDIUM, key[0])
        self.num_evictions += 1

    def touch(self, blocks: Iterable[KVBlock], group_id: int = 0) -> None:
        """Take a reference on cached blocks found by a prefix hit, pulling free ones out of their queue."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self._queue_of(block).remove(block)
                block.free_list = NOT_FREE
                block.group_id = group_id
                self.in_use_by_group[group_id] = self.in_use_by_group.get(group_id, 0) + 1
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock], evict_first: bool = False) -> None:
        """Drop one reference from each block; blocks reaching zero become free in the order given.

        Blocks freed earlier are evicted earlier, so callers pass the least valuable blocks first.
        """
        null, in_use, uncached = self.null_block, self.in_use_by_group, self._uncached
        cached_list = EVICT_FIRST if evict_first else LRU
        cached: list[KVBlock] = []
        for block in blocks:  # a 10M-token request frees ~160K blocks: this loop is its cost
            if block is null:
                continue
            ref = block.ref_cnt - 1
            if ref < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than it was taken")
            block.ref_cnt = ref
            if ref:
                continue
            in_use[block.group_id] -= 1
            if block.hash_key is None:
                block.free_list = UNCACHED
                uncached.append(block)
            else:
                block.free_list = cached_list
                cached.append(block)
        (self._evict_first if evict_first else self._lru).extend(cached)

    def _queue_of(self, block: KVBlock) -> _LinkedQueue:
        if block.free_list == EVICT_FIRST:
            return self._evict_first
        if block.free_list == LRU:
            return self._lru
        raise RuntimeError(f"block {block.block_id} is not in a cached free queue")

    # ---- prefix cache ------------------------------------------------------------------------------
    def cache_block(self, block: KVBlock, key: BlockHashKey) -> bool:
        """Publish a full, computed block under its hash; False if it was not (a second block with the same content
        stays private), so callers report only what lookups can now find."""
        if block.hash_key is not None or key in self._cached:
            return False
        block.hash_key = key
        self._cached[key] = block
        return True

    def lookup(self, key: BlockHashKey) -> KVBlock | None:
        return self._cached.get(key)

    def reset_prefix_cache(self) -> bool:
        """Forget every hash; only possible when no block is in use (as vLLM's reset)."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for queue in (self._evict_first, self._lru):
            while queue.size:
                block = queue.popleft()
                block.hash_key = None
                block.free_list = UNCACHED
                self._uncached.append(block)
        self._cached.clear()
        if self.events is not None:
            self.events.cleared()  # every tier: the coordinator resets the host tier with the pool
        return True
