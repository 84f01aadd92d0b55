"""What the KV cache knows about a request, and what a prefix lookup hands back.

A prefix hit of 6 tokens at block size 2, one full and one sliding group (window 2)::

    CacheHit(num_tokens=6, blocks=[[b1, b2, b3], [null, null, b9]])

The full group resumes with every block of the prefix; the sliding one only needs the block holding what the next
token's window sees (token 5), so the blocks before it are the null block (id 0) and its table starts as
``[0, 0, 9]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from hybridkv.kv.block_pool import KVBlock


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
        """Hit points (in blocks) worth keeping resumable: where this hit ended and where the prefix branched.

        >>> CacheHit(8, [[], []], shared_blocks=6).branch_points(2)
        (4, 6)
        """
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
