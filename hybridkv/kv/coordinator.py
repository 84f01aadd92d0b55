"""The coordinator: every layer group's manager behind one interface, chosen once by case (as vLLM's
``kv_cache_coordinator.py``):

- ``NoPrefixCacheCoordinator``: prefix caching off: no hashes, no lookups, nothing published.
- ``UnitaryCoordinator``: one layer group: the longest hit is that group's, and a request has one table.
- ``HybridCoordinator``: several groups (Scout: 1 full + 3 chunked; Gemma-3: 1 full + 5 sliding): the longest hit
  is a fixed point over them, full groups first.

Every group's table has one entry per block of the request's allocated tokens, nulls (block 0) where a sliding or
chunked group dropped what fell out of reach. Block 2, one full and one sliding group (window 4), a 9-token
request computed in one step::

    full:    [1, 2, 3, 4, 5]
    sliding: [null, null, null, 9, 10]     (token 9's window starts at token 6: blocks 3 and 4)

A decode step whose token still fits in the last block (token 9 here) needs no block in any group: ``grow``
answers it from the first group's table alone, the common step.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod

import numpy as np

from hybridkv.kv.block_hash import BlockHasher
from hybridkv.kv.block_pool import BlockPool, KVBlock
from hybridkv.kv.branch_points import BranchPoints, NoBranchPoints
from hybridkv.kv.host_tier import BlockCopy, HostTier
from hybridkv.kv.layout import KVLayout
from hybridkv.kv.managers import NULL_BLOCK_ID, Lookup, SingleTypeManager, manager_for
from hybridkv.kv.request import CacheHit, KVRequest, PrefixCacheStats
from hybridkv.kv.tiers import DeviceAndHost, DeviceOnly

NEVER = sys.maxsize  # the computed count at which a group with nothing to drop drops its next block

_NO_BLOCKS = np.empty(0, np.int32)
_NO_BLOCKS.flags.writeable = False


class KVCacheCoordinator(ABC):
    """What every case shares: allocation, dropping what fell out of reach, freeing, the tables' views.

    ``managers`` come full groups first; ``retention`` and ``tiers`` are the components a prefix-caching case
    plugs in (``NoBranchPoints`` and ``DeviceOnly`` without prefix caching)."""

    def __init__(
        self,
        managers: list[SingleTypeManager],
        pool: BlockPool,
        max_step_tokens: int,
        retention: BranchPoints | NoBranchPoints,
        tiers: DeviceOnly | DeviceAndHost,
    ) -> None:
        self.managers = managers
        self.pool = pool
        self.block_size = managers[0].block_size
        self.max_step_tokens = max_step_tokens
        self.retention = retention
        self.tiers = tiers
        self.stats = PrefixCacheStats()
        self._local = [m for m in managers if not m.spec.keeps_every_token]  # the groups that drop blocks
        self._num_full = len(managers) - len(self._local)
        # Every group's table has one entry per block of the request's allocated tokens (nulls included), so the
        # first group's tells how many tokens all of them hold.
        self._first_tables = managers[0].tables
        self._group_tables = [(m.group.group_id, m.tables) for m in managers]  # read every step, for every request
        # Per request with blocks: the computed count before which no group drops another block. Callers test it
        # before ``_drop_out_of_reach`` (twice per running request per step: most steps stop at the test).
        self._drop_due: dict[str, int] = {}

    # ---- the case's own answers --------------------------------------------------------------------
    @abstractmethod
    def find_cache_hit(self, req: KVRequest) -> CacheHit:
        """Longest prefix every group can resume from, at least one token short of the request."""

    @abstractmethod
    def record_hit(self, req: KVRequest, hit: CacheHit) -> None:
        """Count an admitted request's lookup in the metrics."""

    @abstractmethod
    def resumable_tokens(self, req: KVRequest, lookup: Lookup) -> int:
        """Tokens of ``req``'s prefix this lookup would resume from, over the blocks ``lookup`` says are cached (not
        this pool's: another engine's, as its KV events describe them). Nothing is taken or counted."""

    @abstractmethod
    def on_tokens_computed(self, req: KVRequest) -> None:
        """After a step: publish what became cacheable, then drop what fell out of reach."""

    @abstractmethod
    def free(self, req: KVRequest) -> None:
        """Give back every block of a finished, aborted or preempted request."""

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

    def grow(self, req: KVRequest, num_new_tokens: int) -> bool:
        """Room for a running request's next tokens (or a first chunk admitted without a lookup); False if the
        pool is short. Block 2, a table ``[4, 5]`` of 3 computed tokens: one more token fits block 5 (True at
        once), two more need a third block in every group."""
        rid, computed = req.request_id, req.num_computed_tokens
        if computed >= self._drop_due.get(rid, 0):
            self._drop_out_of_reach(rid, computed)
        total = computed + num_new_tokens
        table = self._first_tables.get(rid)
        if table is not None and total <= len(table) * self.block_size:
            return True  # a decode step inside its last block: every table holds it already (the common step)
        if self.blocks_needed(req, num_new_tokens) > self.pool.num_free_blocks:
            return False
        for m in self.managers:
            m.allocate(rid, total)
        return True

    def admit(self, req: KVRequest, num_new_tokens: int, hit: CacheHit, full_sequence_must_fit: bool) -> bool:
        """Take the hit's blocks and room for ``num_new_tokens`` after it; False (nothing taken) if the pool is
        short, or, with ``full_sequence_must_fit``, if it cannot hold what all the request's tokens will need."""
        rid, computed = req.request_id, req.num_computed_tokens
        if computed >= self._drop_due.get(rid, 0):
            self._drop_out_of_reach(rid, computed)
        free = self.pool.num_free_blocks
        if self.blocks_needed(req, num_new_tokens, hit) > free:
            return False
        if full_sequence_must_fit and self.blocks_for_all_tokens(req, hit) > free:
            return False
        points = self.retention.points(req, hit)
        held = self.tiers.fetch(req, hit)
        for m in self.managers:
            m.set_branch_points(rid, points)
            if hit.num_tokens:
                m.add_hit_blocks(rid, hit.blocks[m.group.group_id])
        self.pool.free_blocks(held)  # the fetch's temporary references: the managers hold theirs now
        total = computed + hit.num_tokens + num_new_tokens
        for m in self.managers:
            m.allocate(rid, total)
        return True

    def _drop_out_of_reach(self, rid: str, computed: int) -> None:
        """Every sliding or chunked group frees what fell out of its reach. The drop depends on the computed
        count alone (a table always covers the computed tokens), and each group knows the count its next drop
        waits for: callers skip the call until the earliest of those (Scout's 8,192-token chunks: one drop a
        chunk, not three group calls every step; full attention alone: never after the first)."""
        for m in self._local:
            m.drop_out_of_reach(rid, computed)
        if rid in self._first_tables:
            self._drop_due[rid] = min((m.next_drop(rid) for m in self._local), default=NEVER)

    def _release(self, req: KVRequest, block_hashes: list[bytes] | tuple[()]) -> None:
        """Free the request's blocks tail first and interleaved across groups, so under memory pressure the
        cache shrinks from the end of the sequence in every group at once and what remains is a usable prefix.

        Tables full ``[1, 2, 3]`` and sliding ``[null, 5, 6]`` go back as 3, 6, 2, 5, 1 (blocks no hit point
        retains first, to the evict-first queue, then the retained ones, each in that order)."""
        self._drop_due.pop(req.request_id, None)
        released = [m.release(req.request_id, req.num_computed_tokens, block_hashes) for m in self.managers]
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
    def step_tables(self, req_id: str) -> tuple[list[np.ndarray], int]:
        """Per group (indexed by group id) the request's block ids, views not copies, and the latest version of
        any of them."""
        out: list[np.ndarray] = [_NO_BLOCKS] * len(self._group_tables)
        version = 0
        for gid, tables in self._group_tables:
            table = tables[req_id]
            out[gid] = table.ids
            if table.version > version:
                version = table.version
        return out, version

    def has_blocks(self, req_id: str) -> bool:
        return req_id in self._first_tables

    def take_block_ops(self) -> list[BlockCopy]:
        return self.tiers.take_ops()

    def reset_prefix_cache(self) -> bool:
        if not self.pool.reset_prefix_cache():
            return False
        self.tiers.reset()
        return True


class NoPrefixCacheCoordinator(KVCacheCoordinator):
    """Prefix caching off: every request starts from nothing and nothing is published."""

    def find_cache_hit(self, req: KVRequest) -> CacheHit:
        return CacheHit.none(len(self.managers))

    def record_hit(self, req: KVRequest, hit: CacheHit) -> None:
        """No lookups, nothing to count."""

    def resumable_tokens(self, req: KVRequest, lookup: Lookup) -> int:
        return 0

    def on_tokens_computed(self, req: KVRequest) -> None:
        rid, computed = req.request_id, req.num_computed_tokens
        if computed >= self._drop_due.get(rid, 0):
            self._drop_out_of_reach(rid, computed)

    def free(self, req: KVRequest) -> None:
        self._release(req, ())


class PrefixCacheCoordinator(KVCacheCoordinator):
    """Prefix caching on: full computed blocks are published under chained hashes and found by later requests."""

    def __init__(
        self,
        managers: list[SingleTypeManager],
        pool: BlockPool,
        max_step_tokens: int,
        retention: BranchPoints | NoBranchPoints,
        tiers: DeviceOnly | DeviceAndHost,
        hasher: BlockHasher,
    ) -> None:
        super().__init__(managers, pool, max_step_tokens, retention, tiers)
        self.hasher = hasher
        self._published_at: dict[str, int] = {}  # per request with blocks: its full computed blocks last published

    @abstractmethod
    def _longest_hit(self, req: KVRequest, lookup: Lookup) -> CacheHit:
        """Longest prefix of ``req``'s hashed blocks, as ``lookup`` finds them, every group can resume from."""

    def _max_hit_blocks(self, req: KVRequest) -> int:
        # at least one token is left to compute, so the model produces logits for the next token
        return max(0, min((len(req.all_token_ids) - 1) // self.block_size, len(req.block_hashes)))

    def find_cache_hit(self, req: KVRequest) -> CacheHit:
        if req.num_computed_tokens:
            return CacheHit.none(len(self.managers))
        self._update_hashes(req)
        return self.tiers.find(req, self._longest_hit)

    def resumable_tokens(self, req: KVRequest, lookup: Lookup) -> int:
        self._update_hashes(req)
        return self._longest_hit(req, lookup).num_tokens

    def record_hit(self, req: KVRequest, hit: CacheHit) -> None:
        self.stats.queries += 1
        self.stats.query_tokens += len(req.all_token_ids)
        self.stats.hits += hit.num_tokens > 0
        self.stats.hit_tokens += hit.num_tokens
        self.tiers.count_hit(hit)

    def on_tokens_computed(self, req: KVRequest) -> None:
        rid, computed = req.request_id, req.num_computed_tokens
        self.hasher.extend(req.block_hashes, req.all_token_ids, req.cache_salt, req.adapter_id)
        full = computed // self.block_size
        # what a group publishes depends on this count alone (hashes and tables cover the computed tokens)
        if self._published_at.get(rid) != full:
            for m in self.managers:
                m.cache_full_blocks(rid, req.block_hashes, computed, req.all_token_ids, req.cache_salt)
            self._published_at[rid] = full
        if computed >= self._drop_due.get(rid, 0):
            self._drop_out_of_reach(rid, computed)

    def free(self, req: KVRequest) -> None:
        rid = req.request_id
        if rid in self._first_tables:
            self._update_hashes(req)
            for m in self.managers:
                m.cache_full_blocks(rid, req.block_hashes, req.num_computed_tokens, req.all_token_ids, req.cache_salt)
        self._published_at.pop(rid, None)
        self._release(req, req.block_hashes)

    def _update_hashes(self, req: KVRequest) -> None:
        self.hasher.extend(req.block_hashes, req.all_token_ids, req.cache_salt, req.adapter_id)


class UnitaryCoordinator(PrefixCacheCoordinator):
    """One layer group: its own longest hit is the fixed point, and a request has one table."""

    def _longest_hit(self, req: KVRequest, lookup: Lookup) -> CacheHit:
        blocks = self.managers[0].find_longest_cache_hit(req.block_hashes, self._max_hit_blocks(req), lookup)
        return CacheHit(len(blocks) * self.block_size, [blocks], shared_blocks=len(blocks))

    def step_tables(self, req_id: str) -> tuple[list[np.ndarray], int]:
        table = self._first_tables[req_id]
        return [table.ids], table.version


class HybridCoordinator(PrefixCacheCoordinator):
    """Several layer groups: each may lower the hit length the others found, until none does."""

    def _longest_hit(self, req: KVRequest, lookup: Lookup) -> CacheHit:
        """Full groups go first: their left-to-right lookup bounds the hit cheaply for the others, and their
        first answer is the branch point (where the prompt left an earlier request's).

        Block 2, full + sliding(4), a 13-token prompt whose 6 blocks are all cached in the full group but whose
        sliding blocks 4 and 5 were evicted: the full group says 6, the sliding group 4 (blocks 2, 3 cached), the
        full group agrees: a hit of 8 tokens, sliding blocks ``[null, null, b2, b3]``, shared_blocks 6."""
        length = self._max_hit_blocks(req)
        hits: list[list[KVBlock]] = [[] for _ in self.managers]
        shared = 0
        changed = True
        while changed and length > 0:
            changed = False
            for i, m in enumerate(self.managers):
                if 0 < i == self._num_full and not shared:
                    shared = length
                hits[i] = m.find_longest_cache_hit(req.block_hashes, length, lookup)
                if len(hits[i]) < length:
                    length = len(hits[i])
                    changed = True
        if length == 0:
            hits = [[] for _ in self.managers]
        blocks: list[list[KVBlock]] = [[] for _ in self.managers]
        for m, h in zip(self.managers, hits):
            blocks[m.group.group_id] = h
        return CacheHit(length * self.block_size, blocks, shared_blocks=max(shared, length))


def make_coordinator(
    layout: KVLayout,
    pool: BlockPool,
    *,
    enable_prefix_caching: bool,
    hash_algorithm: str,
    max_step_tokens: int,
    retention_interval: int,
    host: HostTier | None,
) -> KVCacheCoordinator:
    """The coordinator for this case, with its components: branch points only where a sliding or chunked group
    can lose a window a hit needs, the host tier only with prefix caching."""
    # Full groups first: their left-to-right lookup bounds the hit cheaply for the others.
    managers = sorted(
        (manager_for(g, pool, layout.block_size, retention_interval) for g in layout.groups),
        key=lambda m: (not m.spec.keeps_every_token, m.group.group_id),
    )
    if not enable_prefix_caching:
        return NoPrefixCacheCoordinator(managers, pool, max_step_tokens, NoBranchPoints(), DeviceOnly(pool))
    local = [m for m in managers if not m.spec.keeps_every_token]
    retention = BranchPoints(layout.block_size, local, pool.null_block) if local else NoBranchPoints()
    tiers = DeviceOnly(pool) if host is None else DeviceAndHost(pool, host)
    hasher = BlockHasher(layout.block_size, hash_algorithm)
    case = UnitaryCoordinator if len(managers) == 1 else HybridCoordinator
    return case(managers, pool, max_step_tokens, retention, tiers, hasher)
