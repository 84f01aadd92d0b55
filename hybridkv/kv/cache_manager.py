"""The KV cache manager: the one interface the scheduler calls, a thin facade over a coordinator.

A request's life, as the scheduler sees it::

    hit = kv.find_cache_hit(req)                   # longest prefix every group can resume from
    ok = kv.allocate_slots(req, n_new, hit)        # False: not enough free blocks now -> wait or preempt
    ... the model computes n_new tokens; req.num_computed_tokens += n_new ...
    kv.on_tokens_computed(req)                     # publish full blocks, drop blocks out of reach
    kv.free(req)                                   # finished, aborted or preempted

Works for any number of attention types and groups (Scout: 1 full + 3 chunked groups; Gemma-3: 1 full + 5
sliding). Which coordinator does the work (no prefix caching / one group / hybrid) is decided once, here, at
construction (``coordinator.py``); branch-point retention (``branch_points.py``) and the host tier
(``tiers.py``, ``host_tier.py``) are its components.

Admission counts what each group will really hold: ``peak_blocks(n)`` is the most blocks a request of ``n`` tokens
holds at once, so a request that can never fit is refused up front instead of waiting forever (vLLM #39734), and
one that fits alone always makes progress once others are preempted.

Block 2, one full and one sliding group (window 4), 16 blocks. A 9-token prompt, then one decode step::

    kv.allocate_slots(a, 9, kv.find_cache_hit(a))  # tables: full [1, 2, 3, 4, 5], sliding [6, 7, 8, 9, 10]
    kv.on_tokens_computed(a)                       # sliding drops what token 9 cannot see: [0, 0, 0, 9, 10]
    kv.allocate_slots(a, 1)                        # token 9 fits the last blocks (5, 10): True, nothing taken
"""

from __future__ import annotations

import numpy as np

from hybridkv.kv.block_pool import BlockPool
from hybridkv.kv.capacity import longest_fitting, peak_blocks
from hybridkv.kv.coordinator import KVCacheCoordinator, make_coordinator
from hybridkv.kv.events import KVEventLog
from hybridkv.kv.host_tier import BlockCopy, HostTier
from hybridkv.kv.layout import KVLayout
from hybridkv.kv.managers import Lookup, default_retention_interval
from hybridkv.kv.request import CacheHit, CacheRequest, KVRequest, PrefixCacheStats

__all__ = ["CacheHit", "CacheRequest", "KVCacheManager", "KVRequest", "PrefixCacheStats"]


class KVCacheManager:
    """The pool, the host tier (``host``, None without one) and the coordinator chosen for this layout.

    ``managers`` (full groups first), ``pool``, ``host`` and ``stats`` are read by metrics, tests and tools."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        enable_prefix_caching: bool = True,
        hash_algorithm: str = "xxh3_128",
        max_step_tokens: int = 8192,
        retention_interval: int | None = None,
        host_blocks: int = 0,
        kv_events: bool = False,
    ) -> None:
        self.layout = layout
        self.block_size = layout.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.max_step_tokens = max_step_tokens
        self.pool = BlockPool(num_blocks)
        # Host tier (kv/host_tier.py): pages the pool evicts are written back to RAM and found again by lookups.
        with_host = host_blocks and enable_prefix_caching
        self.host: HostTier | None = HostTier(host_blocks, layout.page_bytes) if with_host else None
        self.coordinator: KVCacheCoordinator = make_coordinator(
            layout,
            self.pool,
            enable_prefix_caching=enable_prefix_caching,
            hash_algorithm=hash_algorithm,
            max_step_tokens=max_step_tokens,
            retention_interval=default_retention_interval(layout) if retention_interval is None else retention_interval,
            host=self.host,
        )
        # KV events (kv/events.py): what became findable and what stopped being, drained by the engine each step
        self.events: KVEventLog | None = KVEventLog(layout.block_size) if kv_events else None
        self.pool.events = self.events
        if self.host is not None:
            self.host.events = self.events
        self.managers = self.coordinator.managers
        self.num_groups = len(self.managers)
        self.stats: PrefixCacheStats = self.coordinator.stats

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
    def find_cache_hit(self, req: KVRequest) -> CacheHit:
        """Longest prefix that every group can resume from (a fixed point: each group may lower the length);
        no hit without prefix caching, or for a request that computed tokens already.

        At least one token is always left to compute, so the model produces logits for the next token.
        """
        return self.coordinator.find_cache_hit(req)

    def resumable_tokens(self, req: KVRequest, lookup: Lookup) -> int:
        """Tokens of ``req``'s prefix that this cache's lookup (``find_cache_hit``: every group, windows included)
        would resume from if the blocks cached were those ``lookup`` finds, by ``(block hash, group id)``: how a
        data-parallel router scores a replica from its KV events (``server/router.py``). A sliding group whose
        window before the full group's hit was evicted lowers the answer exactly as it lowers a real hit."""
        return self.coordinator.resumable_tokens(req, lookup)

    def record_hit(self, req: KVRequest, hit: CacheHit) -> None:
        """Count a lookup in the metrics once the request is admitted (a request that waits is looked up again)."""
        self.coordinator.record_hit(req, hit)

    def take_block_ops(self) -> list[BlockCopy]:
        """Page copies between the tiers that must run before the next step's forward (empty without a host tier)."""
        return self.coordinator.take_block_ops()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, device and host; False (nothing done) while any block is in use."""
        return self.coordinator.reset_prefix_cache()

    # ---- allocation --------------------------------------------------------------------------------
    def blocks_needed(self, req: KVRequest, num_new_tokens: int, hit: CacheHit | None = None) -> int:
        return self.coordinator.blocks_needed(req, num_new_tokens, hit)

    def blocks_for_all_tokens(self, req: KVRequest, hit: CacheHit) -> int:
        """Blocks a waiting request needs to compute all its tokens after ``hit``, each group at its peak."""
        return self.coordinator.blocks_for_all_tokens(req, hit)

    def allocate_slots(
        self, req: KVRequest, num_new_tokens: int, hit: CacheHit | None = None, full_sequence_must_fit: bool = False
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens (after a prefix hit, if given). False if the pool is short.

        ``full_sequence_must_fit`` (admission, as vLLM's scheduler asks): refuse unless the free pool holds what
        all the request's tokens will need, so a long prompt waits instead of being admitted, growing chunk by
        chunk and preempting others (or itself) half-way. On success with a hit the caller adds
        ``hit.num_tokens`` to ``req.num_computed_tokens``.
        """
        if hit is None:  # a running request (every step)
            return self.coordinator.grow(req, num_new_tokens)
        return self.coordinator.admit(req, num_new_tokens, hit, full_sequence_must_fit)

    def on_tokens_computed(self, req: KVRequest) -> None:
        """After a step: publish newly full computed blocks, then free what fell out of reach."""
        self.coordinator.on_tokens_computed(req)

    def free(self, req: KVRequest) -> None:
        """Give back every block of a finished, aborted or preempted request, publishing its full computed blocks
        first; tail first and interleaved across groups, so what pressure leaves cached is a usable prefix."""
        self.coordinator.free(req)

    # ---- views -------------------------------------------------------------------------------------
    def block_tables(self, req_id: str) -> list[np.ndarray]:
        """Per group (indexed by group id), the request's block ids; views, not copies."""
        return self.coordinator.step_tables(req_id)[0]

    def tables_version(self, req_id: str) -> int:
        """Changes whenever any of the request's block tables does, and no other request's tables share it: the
        version of the latest edit (versions are drawn from one counter and only grow)."""
        return self.coordinator.step_tables(req_id)[1]

    def step_tables(self, req_id: str) -> tuple[list[np.ndarray], int]:
        """``block_tables`` and ``tables_version`` in one pass (a step asks for both, for every sequence)."""
        return self.coordinator.step_tables(req_id)

    def has_blocks(self, req_id: str) -> bool:
        return self.coordinator.has_blocks(req_id)

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
