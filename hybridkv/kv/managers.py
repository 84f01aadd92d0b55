"""One manager per attention type: the block table of each request for one layer group.

A block table maps logical block i (tokens ``i*B .. i*B+B-1``) to a physical block id. Sliding and chunked
managers put the null block (id 0) where tokens fell out of reach and hand the real block back to the pool.

Sliding window 4, block 2, after 7 processed tokens (first needed token 4)::

    before: [7, 8, 9, 10]      after: [0, 0, 9, 10]   (blocks 7 and 8 return to the pool)

Chunked, chunk 4, block 2, after 4 processed tokens: ``[7, 8, 9] -> [0, 0, 9]``.

All the per-step work (allocating the tail, caching newly full blocks, dropping blocks that fell out of reach)
starts where the previous step stopped, so it does not grow with the context length.

Retention. A later request can reuse a sliding prefix ending at token L only if the blocks covering the
window before L are still cached (full attention needs every block before L). Blocks that fall out of the window
are therefore freed as *evict-first*, except those that cover the window before a retained hit point:

- the request's end (the next turn of a conversation extends exactly there),
- its branch points: where its prefix hit ended, and where its hash chain left an earlier request's (the
  full-attention match ran further than this type could resume: a shared system prompt ends there), and
- every ``retention_interval`` tokens (sliding only; chunked layers need nothing at a chunk boundary),

so that when memory is short the hit falls back to the last retained point instead of to zero
(vLLM #48435, SGLang's "cliff" in PR 35515), and a prefix many requests share stays resumable: every request
that reaches its end keeps the window there in LRU order, where the next sibling finds it.

Sliding window 4, block 2, a system prompt of 12 tokens shared with an earlier request (branch point at block 6):
blocks 4 and 5 cover the window before it; when this request moves past them they are freed to LRU, not
evict-first, so the next request with the same system prompt resumes at token 12 with the table
``[null, null, null, null, 4', 5']``.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, ClassVar, Iterator, Sequence

import numpy as np

from hybridkv.kv.block_pool import BlockHashKey, BlockPool, KVBlock
from hybridkv.kv.layout import KVLayout, LayerGroup
from hybridkv.kv.specs import AttentionSpec, ChunkedLocalSpec, FullAttentionSpec, SlidingWindowSpec, cdiv

NULL_BLOCK_ID = 0
Blocks = int | np.ndarray  # a block index or count, or an array of them (computed elementwise)
Lookup = Callable[[BlockHashKey], KVBlock | None]  # cached block by (hash, group id), or None


class BlockTable:
    """Growable int32 array of block ids; ``ids`` is a view the attention backend can read without copying.

    ``version`` is drawn from ``versions`` (a counter every table of one pool shares) when the table is made and at
    each edit, so one version names one table's content: a decode step's metadata re-sends a table only when it
    changed (``KVCacheManager.tables_version``)."""

    __slots__ = ("_buf", "_len", "_versions", "version", "ids")

    def __init__(self, versions: Iterator[int], capacity: int = 16) -> None:
        self._buf = np.zeros(max(16, capacity), dtype=np.int32)
        self._len = 0
        self._versions = versions
        self.version = next(versions)
        self.ids = self._buf[:0]  # the table: a view, made again only when the table grows (read every step)

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> int:
        return int(self._buf[i])

    def extend(self, block_ids: Sequence[int]) -> None:
        n = self._len + len(block_ids)
        if n > len(self._buf):
            grown = np.zeros(max(n, 2 * len(self._buf)), dtype=np.int32)
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        self._buf[self._len : n] = block_ids
        self._len = n
        self.ids = self._buf[:n]
        self.version = next(self._versions)

    def set_null(self, start: int, end: int) -> None:
        self._buf[start:end] = NULL_BLOCK_ID
        self.version = next(self._versions)


class SingleTypeManager:
    """Block tables of one layer group; how far back the type reaches comes from its spec alone, so any type
    that frees what falls below ``spec.first_needed_token`` needs no manager of its own."""

    # Whether a hit point every ``retention_interval`` tokens is worth keeping resumable (see the module docstring).
    periodic_retention: ClassVar[bool] = True

    def __init__(self, group: LayerGroup, pool: BlockPool, block_size: int, retention_interval: int = 0) -> None:
        self.group = group
        self.spec = group.spec
        self.pool = pool
        self.block_size = block_size
        # In blocks; 0 = no periodic retention (only the request's end is retained).
        retain = retention_interval if self.periodic_retention else 0
        self.retention_blocks = retain // block_size if retain else 0
        self.tables: dict[str, BlockTable] = {}
        self._num_dropped: dict[str, int] = {}  # leading entries already nulled
        self._num_cached: dict[str, int] = {}  # leading entries already published to the prefix cache
        # Per request, the block ranges [lo, hi) covering the reach before each branch point (``set_branch_points``).
        self._branch_ranges: dict[str, tuple[tuple[int, int], ...]] = {}

    # ---- what a type needs -------------------------------------------------------------------------
    def first_needed_block(self, num_tokens: Blocks) -> Blocks:
        return self.spec.first_needed_token(num_tokens) // self.block_size

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_blocks: int, lookup: Lookup | None = None
    ) -> list[KVBlock]:
        """Longest cached prefix of at most ``max_blocks`` blocks this type can resume from.

        Scans right to left: a hit ending at block e needs blocks ``first_needed_block(e*B) .. e-1`` cached; the
        ones before may be null. Window 4, block 2 (needs 2 blocks), cached ``[T,T,F,T,F,F,T,T,F,F,F]`` -> 8 blocks,
        ``[null]*6 + [b6, b7]``. Each block is looked up at most once. ``lookup``: the device pool's by default
        (the host tier passes one that also finds its own pages).
        """
        gid = self.group.group_id
        lookup = lookup or self.pool.lookup
        found: dict[int, KVBlock | None] = {}

        def cached(i: int) -> KVBlock | None:
            if i not in found:
                found[i] = lookup((block_hashes[i], gid))
            return found[i]

        pos = max_blocks - 1  # every index above pos (and below the current end) is known to be cached
        for end in range(max_blocks, -1, -1):
            start = self.first_needed_block(end * self.block_size)
            pos = min(pos, end - 1)
            while pos >= start and cached(pos) is not None:
                pos -= 1
            if pos < start:
                return [self.pool.null_block] * start + [found[i] for i in range(start, end)]
        return []

    def _retained(self, index: Blocks, end_block: int | None, ranges: tuple[tuple[int, int], ...] = ()) -> Blocks:
        """Whether block ``index`` covers the window before a retained hit point (see module docstring): a bool,
        or elementwise over a numpy array of indices (a 2M-token request's 31,250 blocks in one pass)."""
        keep = index < 0  # False, elementwise
        if end_block is not None:
            keep = keep | ((self.first_needed_block(end_block * self.block_size) <= index) & (index < end_block))
        for lo, hi in ranges:
            keep = keep | ((lo <= index) & (index < hi))
        r = self.retention_blocks
        if r:
            keep = keep | (self.first_needed_block((index // r + 1) * r * self.block_size) <= index)
        return keep

    # ---- per request -------------------------------------------------------------------------------
    def set_branch_points(self, req_id: str, points: tuple[int, ...]) -> None:
        """Hit points (in blocks) this request shares with earlier ones: their windows are retained.

        A chunked group needs nothing before a point on a chunk boundary: such a point costs nothing per step.
        """
        ranges = []
        for p in points:
            lo = self.first_needed_block(p * self.block_size)
            if lo < p:
                ranges.append((lo, p))
        if ranges:
            self._branch_ranges[req_id] = tuple(ranges)

    def num_blocks_to_allocate(self, req_id: str, num_tokens: int, hit_blocks: Sequence[KVBlock] = ()) -> int:
        table = self.tables.get(req_id)
        have = len(table) if table is not None else len(hit_blocks)
        revived = sum(1 for b in hit_blocks if b.ref_cnt == 0) if table is None else 0
        return max(0, cdiv(num_tokens, self.block_size) - have) + revived

    def add_hit_blocks(self, req_id: str, hit_blocks: Sequence[KVBlock]) -> None:
        assert req_id not in self.tables, f"request {req_id} already has blocks"
        self.pool.touch(hit_blocks, self.group.group_id)
        table = BlockTable(self.pool.table_versions, len(hit_blocks))
        table.extend([b.block_id for b in hit_blocks])
        self.tables[req_id] = table
        dropped = 0
        while dropped < len(hit_blocks) and hit_blocks[dropped] is self.pool.null_block:
            dropped += 1
        self._num_dropped[req_id] = dropped
        self._num_cached[req_id] = len(hit_blocks)

    def allocate(self, req_id: str, num_tokens: int) -> None:
        """Grow the table to hold ``num_tokens`` tokens."""
        table = self.tables.get(req_id)
        if table is None:
            table = self.tables[req_id] = BlockTable(self.pool.table_versions)
            self._num_dropped[req_id] = self._num_cached[req_id] = 0
        n = cdiv(num_tokens, self.block_size) - len(table)
        if n > 0:
            table.extend([b.block_id for b in self.pool.get_new_blocks(n, self.group.group_id)])

    def cache_full_blocks(
        self, req_id: str, block_hashes: Sequence[bytes], num_computed: int,
        token_ids: Sequence[int] = (), cache_salt: str | None = None,
    ) -> None:
        """Publish blocks that became full and computed since the last call (``token_ids`` and ``cache_salt``: the
        request's, for the KV events of the blocks published, when events are on)."""
        table = self.tables[req_id]
        start = self._num_cached[req_id]
        end = min(num_computed // self.block_size, len(block_hashes), len(table))
        gid = self.group.group_id
        blocks, events = self.pool.blocks, self.pool.events
        published = []
        for i in range(start, end):
            block_id = table[i]
            if block_id != NULL_BLOCK_ID and self.pool.cache_block(blocks[block_id], (block_hashes[i], gid)):
                published.append(i)
        if events is not None and published:
            events.stored_blocks(gid, published, block_hashes, token_ids, cache_salt)
        self._num_cached[req_id] = max(start, end)

    def drop_out_of_reach(self, req_id: str, num_computed: int) -> None:
        """Null and free the blocks no future token of this request can attend to."""
        table = self.tables.get(req_id)
        if table is None:
            return
        start = self._num_dropped[req_id]
        end = min(self.first_needed_block(num_computed), len(table))
        if end <= start:
            return
        keep, low = [], []
        blocks = self.pool.blocks
        ranges = self._branch_ranges.get(req_id, ())
        for i in range(end - 1, start - 1, -1):  # tail first: evicted before the blocks in front of it
            block_id = table[i]
            if block_id != NULL_BLOCK_ID:
                block = blocks[block_id]
                if self._retained(i, None, ranges):
                    keep.append(block)
                else:
                    low.append(block)
        table.set_null(start, end)
        self._num_dropped[req_id] = end
        self.pool.free_blocks(low, evict_first=True)
        self.pool.free_blocks(keep)

    def next_drop(self, req_id: str) -> int:
        """Fewest computed tokens at which ``drop_out_of_reach`` frees another of the request's blocks (at least)."""
        return self.spec.needed_until((self._num_dropped[req_id] + 1) * self.block_size - 1)

    def release(
        self, req_id: str, num_computed: int, block_hashes: Sequence[bytes] = ()
    ) -> tuple[np.ndarray, np.ndarray]:
        """Forget a request's table; return its block ids tail first (nulls where blocks were dropped) with, for
        each, whether it should be kept.

        The windows of retained hit points that are no longer in the table (dropped while the request ran, or
        before its prefix hit) sit in the LRU queue ahead of everything freed now: memory pressure would evict
        them before the blocks that depend on them, and the hit would fall from the request's end straight to 0
        while the full-attention prefix survives. Those still cached and free are taken back here (looked up by
        their hash) and returned at their place in the sequence: the caller frees them with the rest, tail first.
        """
        table = self.tables.pop(req_id, None)
        dropped = self._num_dropped.pop(req_id, 0)  # the table's nulls are exactly its first ``dropped`` entries
        self._num_cached.pop(req_id, None)
        ranges = self._branch_ranges.pop(req_id, ())
        if table is None:
            return np.zeros(0, dtype=np.int32), np.zeros(0, dtype=bool)
        ids = table.ids.copy()
        retained = self._retained(np.arange(len(ids)), num_computed // self.block_size, ranges)
        gid = self.group.group_id
        revived = []
        for i in np.flatnonzero(retained[: min(dropped, len(block_hashes))]).tolist():
            block = self.pool.lookup((block_hashes[i], gid))
            if block is not None and block.ref_cnt == 0:
                ids[i] = block.block_id
                revived.append(block)
        self.pool.touch(revived, gid)
        return ids[::-1], retained[::-1]

    def block_ids(self, req_id: str) -> np.ndarray:
        return self.tables[req_id].ids

    def num_live_blocks(self, req_id: str) -> int:
        table = self.tables.get(req_id)
        return 0 if table is None else len(table) - self._num_dropped[req_id]


class FullAttentionManager(SingleTypeManager):
    periodic_retention: ClassVar[bool] = False  # every block is retained anyway

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_blocks: int, lookup: Lookup | None = None
    ) -> list[KVBlock]:
        """Left to right up to the first miss: a chained hash hit implies its whole prefix is cached."""
        gid = self.group.group_id
        lookup = lookup or self.pool.lookup
        hits = []
        for i in range(max_blocks):
            block = lookup((block_hashes[i], gid))
            if block is None:
                break
            hits.append(block)
        return hits

    def _retained(self, index: Blocks, end_block: int | None, ranges: tuple[tuple[int, int], ...] = ()) -> Blocks:
        return index >= 0  # True, elementwise

    def set_branch_points(self, req_id: str, points: tuple[int, ...]) -> None:
        """Every full-attention block is retained anyway."""

    def drop_out_of_reach(self, req_id: str, num_computed: int) -> None:
        """Nothing ever falls out of a full layer's reach (called twice per sequence per step: kept free)."""


class SlidingWindowManager(SingleTypeManager):
    pass


class ChunkedLocalManager(SingleTypeManager):
    # A chunk boundary is a free hit point (nothing before it is needed): periodic retention buys nothing.
    periodic_retention: ClassVar[bool] = False


# Which manager keeps each spec type's block tables; a type missing here gets the generic ``SingleTypeManager``.
MANAGERS: MappingProxyType[type[AttentionSpec], type[SingleTypeManager]] = MappingProxyType({
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalSpec: ChunkedLocalManager,
})


def manager_class(spec: AttentionSpec) -> type[SingleTypeManager]:
    return MANAGERS.get(type(spec), SingleTypeManager)


def manager_for(group: LayerGroup, pool: BlockPool, block_size: int, retention_interval: int) -> SingleTypeManager:
    return manager_class(group.spec)(group, pool, block_size, retention_interval)


def default_retention_interval(layout: KVLayout) -> int:
    """Retain a hit point every 4 reaches of the widest periodically retained type (sliding windows): at most
    ~25% extra cached blocks of that type per full block. Gemma-3 (window 512, block 16) -> 2,048 tokens."""
    reaches = [g.spec.reach for g in layout.groups if manager_class(g.spec).periodic_retention]
    if not reaches:
        return 0
    b = layout.block_size
    return max(4 * max(reaches) // b * b, b)
