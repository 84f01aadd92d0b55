"""The coordinator: every layer group's manager behind one interface the scheduler calls.

A request's life, as the scheduler sees it::

    hit = kv.find_cache_hit(req)                   # longest prefix every group can resume from
    ok = kv.allocate_slots(req, n_new, hit)        # False: not enough free blocks now -> wait or preempt
    ... the model computes n_new tokens; req.num_computed_tokens += n_new ...
    kv.on_tokens_computed(req)                     # publish full blocks, drop blocks out of reach
    kv.free(req)                                   # finished, aborted or preempted

Works for any number of attention types and groups (Scout: 1 full + 3 chunked groups; Gemma-3: 1 full + 5
sliding). Admission counts what each group will really hold: ``peak_blocks(n)`` is the most blocks a request of
``n`` tokens holds at once, so a request that can never fit is refused up front instead of waiting forever
(vLLM #39734), and one that fits alone always makes progress once others are preempted.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from hybridkv.kv.block_hash import BlockHasher
from hybridkv.kv.block_pool import EVICT_FIRST, BlockHashKey, BlockPool, KVBlock
from hybridkv.kv.host_tier import BlockCopy, HostBlock, HostTier
from hybridkv.kv.layout import KVLayout
from hybridkv.kv.capacity import longest_fitting, peak_blocks
from hybridkv.kv.managers import NULL_BLOCK_ID, SingleTypeManager, default_retention_interval, manager_for


class KVRequest(Protocol):
    """What the KV cache needs to know about a request (the engine's Sequence satisfies it)."""

    request_id: str
    all_token_ids: list[int]  # prompt + generated so far
    num_computed_tokens: int  # tokens whose KV is written
    block_hashes: list[bytes]  # filled by the cache manager
    cache_salt: str | None
    adapter_id: str | int | None


@dataclass(slots=True)
class CacheRequest:
    """A minimal KVRequest, for tests, benchmarks and tools."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    cache_salt: str | None = None
    adapter_id: str | int | None = None


# Known branch points remembered (about 2 MiB of hashes): far more distinct shared prefixes than any pool holds.
MAX_BRANCH_POINTS = 1 << 16

_NO_BLOCKS = np.empty(0, np.int32)
_NO_BLOCKS.flags.writeable = False


@dataclass(slots=True)
class CacheHit:
    num_tokens: int
    blocks: list[list[KVBlock]]  # per group, nulls where the group needs nothing
    # Blocks of the prompt an earlier request already computed (the full-attention match): the branch point,
    # which may lie beyond ``num_tokens`` when a sliding or chunked group could not resume there.
    shared_blocks: int = 0
    host_tokens: int = 0  # of ``num_tokens``, those only the host tier made a hit (its pages are loaded)

    @staticmethod
    def none(num_groups: int) -> CacheHit:
        return CacheHit(0, [[] for _ in range(num_groups)])

    def branch_points(self, block_size: int) -> tuple[int, ...]:
        """Hit points (in blocks) worth keeping resumable: where this hit ended and where the prefix branched."""
        hit = self.num_tokens // block_size
        return tuple(sorted({p for p in (hit, self.shared_blocks) if p > 0}))


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # requests looked up
    query_tokens: int = 0
    hits: int = 0  # requests with a non-empty hit
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class KVCacheManager:
    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        hash_algorithm: str = "xxh3_128",
        max_step_tokens: int = 8192,
        retention_interval: int | None = None,
        host_blocks: int = 0,
    ) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.hasher = BlockHasher(self.block_size, hash_algorithm)
        self.max_step_tokens = max_step_tokens
        if retention_interval is None:
            retention_interval = default_retention_interval(layout)
        # Full groups first: their left-to-right lookup bounds the hit cheaply for the others.
        self.managers: list[SingleTypeManager] = sorted(
            (manager_for(g, self.pool, self.block_size, retention_interval) for g in layout.groups),
            key=lambda m: (not m.spec.keeps_every_token, m.group.group_id),
        )
        self._num_full = sum(m.spec.keeps_every_token for m in self.managers)
        # Every group's table has one entry per block of the request's allocated tokens (nulls included), so the
        # first group's tells how many tokens all of them hold.
        self._first_tables = self.managers[0].tables
        # Chained hashes of the last block before each known branch point (a bounded LRU set).
        self._branch_registry: OrderedDict[bytes, None] = OrderedDict()
        # per request with blocks: the computed count before which no group drops another block
        self._drop_due: dict[str, int] = {}
        self._published_at: dict[str, int] = {}  # per request with blocks: its full computed blocks last published
        self.stats = PrefixCacheStats()
        # Host tier (kv/host_tier.py): pages the pool evicts are written back to RAM and found again by lookups.
        self.host: HostTier | None = None
        if host_blocks and enable_prefix_caching:
            self.host = HostTier(host_blocks, layout.page_bytes)
            self.pool.evict_listener = self.host.write_back

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    # ---- admission ---------------------------------------------------------------------------------
    def peak_blocks(self, num_tokens: int) -> int:
        """Most blocks one request of ``num_tokens`` tokens holds at once, all groups together."""
        return peak_blocks(self.layout, num_tokens, self.max_step_tokens)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.peak_blocks(num_tokens) <= self.pool.num_usable_blocks

    def max_tokens_that_fit(self, upper: int) -> int:
        """Longest request (<= upper) whose peak fits the whole pool."""
        return longest_fitting(self.layout, self.pool.num_usable_blocks, self.max_step_tokens, upper)

    # ---- prefix cache ------------------------------------------------------------------------------
    def _update_hashes(self, req: KVRequest) -> None:
        self.hasher.extend(req.block_hashes, req.all_token_ids, req.cache_salt, req.adapter_id)

    def find_cache_hit(self, req: KVRequest) -> CacheHit:
        """Longest prefix that every group can resume from (a fixed point: each group may lower the length).

        At least one token is always left to compute, so the model produces logits for the next token.
        """
        if not self.enable_prefix_caching or req.num_computed_tokens:
            return CacheHit.none(self.num_groups)
        self._update_hashes(req)
        if self.host is None:
            return self._longest_hit(req)
        return self._two_tier_hit(req)

    def _longest_hit(self, req: KVRequest, lookup=None) -> CacheHit:
        max_blocks = max(0, min((len(req.all_token_ids) - 1) // self.block_size, len(req.block_hashes)))
        hits: list[list[KVBlock]] = [[] for _ in self.managers]
        length = max_blocks
        shared = 0
        changed = True
        while changed and length > 0:
            changed = False
            for i, m in enumerate(self.managers):
                if 0 < i == self._num_full and not shared:  # the full groups' first answer: the branch point
                    shared = length
                hits[i] = m.find_longest_cache_hit(req.block_hashes, length, lookup)
                if len(hits[i]) < length:
                    length = len(hits[i])
                    changed = True
        if length == 0:
            hits = [[] for _ in self.managers]
        blocks = [[] for _ in range(self.num_groups)]
        for m, h in zip(self.managers, hits):
            blocks[m.group.group_id] = h
        return CacheHit(length * self.block_size, blocks, shared_blocks=max(shared, length))

    # ---- host tier ---------------------------------------------------------------------------------
    def _lookup_both_tiers(self, key: BlockHashKey) -> KVBlock | HostBlock | None:
        return self.pool.lookup(key) or self.host.lookup(key)

    def _two_tier_hit(self, req: KVRequest) -> CacheHit:
        """The longest hit over device and host blocks (each host entry costs one fresh device block at admission,
        as recomputing that block would: a hit whose loads cannot get blocks waits exactly where a recompute would,
        and nothing is taken until ``allocate_slots`` succeeds)."""
        hit = self._longest_hit(req, self._lookup_both_tiers)
        if any(type(b) is HostBlock for blocks in hit.blocks for b in blocks):
            hit.host_tokens = hit.num_tokens - self._longest_hit(req).num_tokens
        return hit

    def _fetch_host_blocks(self, hit: CacheHit) -> list[KVBlock]:
        """Turn the hit's host entries into fresh device blocks, published under their hashes, whose pages the
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
        for gid in range(self.num_groups):  # ``wanted`` is in group order
            fresh += self.pool.get_new_blocks(per_group[gid], gid)
        for (gid, i, host_block), block in zip(wanted, fresh):
            self.pool.cache_block(block, host_block.key)
            self.host.load(host_block, block.block_id)
            hit.blocks[gid][i] = block
        return held + fresh

    def take_block_ops(self) -> list[BlockCopy]:
        """Page copies between the tiers that must run before the next step's forward (empty without a host tier)."""
        return self.host.take_ops() if self.host is not None else []

    def _branch_points(self, req: KVRequest, hit: CacheHit) -> tuple[int, ...]:
        """Hit points (in blocks) whose windows this request keeps: its own hit, the branch point, and every
        registered branch point its prompt passes.

        A branch point is registered (so that every later request through the same prefix keeps its window hot
        too) when nothing retained it yet: the prompt left a cached prefix where the sliding or chunked groups
        could not resume, or they resumed only thanks to blocks waiting in the evict-first queue. A hit on a
        retained point (a conversation's next turn at the previous turn's end) registers nothing.
        """
        if self._num_full == self.num_groups or not self.enable_prefix_caching:
            return ()  # full attention retains every block anyway
        registry = self._branch_registry
        if hit.shared_blocks * self.block_size > hit.num_tokens or self._hit_needs_evict_first(hit):
            registry[req.block_hashes[hit.shared_blocks - 1]] = None
            if len(registry) > MAX_BRANCH_POINTS:
                registry.popitem(last=False)
        points = set(hit.branch_points(self.block_size))
        if registry:  # one dict probe per prompt block, once per admission (a 10M-token prompt: 625K at block 16)
            for i, h in enumerate(req.block_hashes):
                if h in registry:
                    registry.move_to_end(h)
                    points.add(i + 1)
        return tuple(sorted(points))

    def _hit_needs_evict_first(self, hit: CacheHit) -> bool:
        """Whether a sliding or chunked group's hit uses a block from the evict-first queue (O(window))."""
        for m in self.managers[self._num_full :]:
            for block in reversed(hit.blocks[m.group.group_id]):
                if block is self.pool.null_block:
                    break
                if block.free_list == EVICT_FIRST:
                    return True
        return False

    def record_hit(self, req: KVRequest, hit: CacheHit) -> None:
        """Count a lookup in the metrics once the request is admitted (a request that waits is looked up again)."""
        if not self.enable_prefix_caching:
            return
        self.stats.queries += 1
        self.stats.query_tokens += len(req.all_token_ids)
        self.stats.hits += hit.num_tokens > 0
        self.stats.hit_tokens += hit.num_tokens
        if self.host is not None:
            self.host.stats.hit_tokens += hit.host_tokens

    # ---- allocation --------------------------------------------------------------------------------
    def blocks_needed(self, req: KVRequest, num_new_tokens: int, hit: CacheHit | None = None) -> int:
        if hit is None:  # every running sequence, every step: no CacheHit built
            total = req.num_computed_tokens + num_new_tokens
            return sum(m.num_blocks_to_allocate(req.request_id, total) for m in self.managers)
        total = req.num_computed_tokens + hit.num_tokens + num_new_tokens
        return sum(
            m.num_blocks_to_allocate(req.request_id, total, hit.blocks[m.group.group_id]) for m in self.managers
        )

    def blocks_for_all_tokens(self, req: KVRequest, hit: CacheHit) -> int:
        """Blocks a waiting request needs to compute all its tokens after ``hit``, each group at its peak.

        A full group needs every block past the hit; a sliding or chunked group at most its window plus a step.
        """
        total = len(req.all_token_ids)
        return sum(
            min(
                m.num_blocks_to_allocate(req.request_id, total, hit.blocks[m.group.group_id]),
                m.spec.max_live_blocks(total, self.block_size, self.max_step_tokens),
            )
            for m in self.managers
        )

    def allocate_slots(
        self, req: KVRequest, num_new_tokens: int, hit: CacheHit | None = None, full_sequence_must_fit: bool = False
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens (after a prefix hit, if given). False if the pool is short.

        ``full_sequence_must_fit`` (admission, as vLLM's scheduler asks): refuse unless the free pool holds what
        all the request's tokens will need, so a long prompt waits instead of being admitted, growing chunk by
        chunk and preempting others (or itself) half-way. On success with a hit the caller adds
        ``hit.num_tokens`` to ``req.num_computed_tokens``.
        """
        self._drop_out_of_reach(req)
        if hit is None:  # a running request: a decode step inside its last block needs nothing (the common step)
            table = self._first_tables.get(req.request_id)
            if table is not None and req.num_computed_tokens + num_new_tokens <= len(table) * self.block_size:
                return True
        needed = self.blocks_needed(req, num_new_tokens, hit)
        if needed > self.pool.num_free_blocks:
            return False
        if hit is None and not needed and self.has_blocks(req.request_id):
            return True  # every table holds the new tokens already (a decode step inside its last block)
        if full_sequence_must_fit and hit is not None:
            if self.blocks_for_all_tokens(req, hit) > self.pool.num_free_blocks:
                return False
        if hit is not None:
            points = self._branch_points(req, hit)
            held = self._fetch_host_blocks(hit) if self.host is not None else []
            for m in self.managers:
                m.set_branch_points(req.request_id, points)
                if hit.num_tokens:
                    m.add_hit_blocks(req.request_id, hit.blocks[m.group.group_id])
            self.pool.free_blocks(held)  # the fetch's temporary references: the managers hold theirs now
        total = req.num_computed_tokens + (hit.num_tokens if hit else 0) + num_new_tokens
        for m in self.managers:
            m.allocate(req.request_id, total)
        return True

    def on_tokens_computed(self, req: KVRequest) -> None:
        """After a step: publish newly full computed blocks, then free what fell out of reach."""
        if self.enable_prefix_caching:
            self._update_hashes(req)
            full = req.num_computed_tokens // self.block_size
            # what a group publishes depends on this count alone (hashes and tables cover the computed tokens)
            if self._published_at.get(req.request_id) != full:
                for m in self.managers:
                    m.cache_full_blocks(req.request_id, req.block_hashes, req.num_computed_tokens)
                self._published_at[req.request_id] = full
        self._drop_out_of_reach(req)

    def _drop_out_of_reach(self, req: KVRequest) -> None:
        """Every group frees what fell out of its reach. The drop depends on the computed count alone (a table
        always covers the computed tokens), and each group knows the count its next drop waits for: until the
        earliest of those, a step's calls (``on_tokens_computed``, the next ``allocate_slots``) return at once
        (Scout's 8,192-token chunks: one drop a chunk, not three group calls every step)."""
        rid, computed = req.request_id, req.num_computed_tokens
        if computed < self._drop_due.get(rid, 0) or self._num_full == len(self.managers):
            return  # (nothing ever falls out of a full group's reach)
        local = self.managers[self._num_full :]
        for m in local:
            m.drop_out_of_reach(rid, computed)
        if self.has_blocks(rid):
            self._drop_due[rid] = min(m.next_drop(rid) for m in local)

    def free(self, req: KVRequest) -> None:
        """Give back every block of a finished, aborted or preempted request.

        Blocks go back tail first and interleaved across groups, so under memory pressure the cache shrinks
        from the end of the sequence in every group at once and what remains is still a usable prefix.
        """
        if self.enable_prefix_caching and self.has_blocks(req.request_id):
            self._update_hashes(req)
            for m in self.managers:
                m.cache_full_blocks(req.request_id, req.block_hashes, req.num_computed_tokens)
        hashes = req.block_hashes if self.enable_prefix_caching else ()
        self._drop_due.pop(req.request_id, None)
        self._published_at.pop(req.request_id, None)
        released = [m.release(req.request_id, req.num_computed_tokens, hashes) for m in self.managers]
        # row j: every group's j-th block from its tail (nulls pad the shorter tables and are not freed)
        longest = max((len(ids) for ids, _ in released), default=0)
        ids = np.full((longest, len(released)), NULL_BLOCK_ID, dtype=np.int64)
        keep = np.zeros((longest, len(released)), dtype=bool)
        for g, (group_ids, retained) in enumerate(released):
            ids[: len(group_ids), g] = group_ids
            keep[: len(group_ids), g] = retained
        ids, keep = ids.ravel(), keep.ravel()
        live, blocks = ids != NULL_BLOCK_ID, self.pool.blocks
        self.pool.free_blocks([blocks[i] for i in ids[live & ~keep].tolist()], evict_first=True)
        self.pool.free_blocks([blocks[i] for i in ids[live & keep].tolist()])

    # ---- views -------------------------------------------------------------------------------------
    def block_tables(self, req_id: str) -> list[np.ndarray]:
        """Per group (indexed by group id), the request's block ids; views, not copies."""
        return self.step_tables(req_id)[0]

    def tables_version(self, req_id: str) -> int:
        """Changes whenever any of the request's block tables does, and no other request's tables share it: the
        version of the latest edit (versions are drawn from one counter and only grow)."""
        return self.step_tables(req_id)[1]

    def step_tables(self, req_id: str) -> tuple[list[np.ndarray], int]:
        """``block_tables`` and ``tables_version`` in one pass (a step asks for both, for every sequence)."""
        if len(self.managers) == 1:  # one group (id 0)
            table = self._first_tables[req_id]
            return [table.ids], table.version
        out: list[np.ndarray] = [_NO_BLOCKS] * len(self.managers)
        version = 0
        for m in self.managers:
            table = m.tables[req_id]
            out[m.group.group_id] = table.ids
            version = max(version, table.version)
        return out, version

    def has_blocks(self, req_id: str) -> bool:
        return req_id in self.managers[0].tables

    def usage_by_kind(self) -> dict[str, float]:
        """Share of the pool held by each attention type (what ``kv_cache_usage_perc`` reports)."""
        out: dict[str, float] = {}
        for m in self.managers:
            used = self.pool.in_use_by_group.get(m.group.group_id, 0)
            out[m.spec.kind] = out.get(m.spec.kind, 0.0) + used / self.pool.num_usable_blocks
        return out

    def blocks_in_use_by_kind(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for m in self.managers:
            out[m.spec.kind] = out.get(m.spec.kind, 0) + self.pool.in_use_by_group.get(m.group.group_id, 0)
        return out

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        if self.host is not None:
            self.host.reset()
        return True

