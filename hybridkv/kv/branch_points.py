"""Branch-point retention across requests: which hit points an admitted request keeps resumable for later ones.

A sliding or chunked group can resume a prefix only where the blocks its window reaches before that point are
still cached (``managers.py``). Each request therefore keeps the window before its own hit point and before its
branch point (where its prompt left an earlier request's) in LRU order when it moves past them. When nothing kept
such a window, the branch point is *registered* here, so that every later request through the same prefix keeps
it too: its windows then stay hot for the next sibling.

Block 2, one full and one sliding group (window 4). Request a computed a 12-token system prompt S and its own
question, then finished; the sliding blocks it moved past in S were freed as evict-first, and memory pressure
evicted them. Request b = S + another question: the full group matches 6 blocks, the sliding group resumes
nowhere, so b's hit is 0 tokens and its branch point (block 6) is registered under the hash of block 5. b keeps
its own blocks 4 and 5 (4', 5') in LRU order, and request c = S + a third question resumes at token 12, its sliding
table ``[null, null, null, null, 4', 5']``.
"""

from __future__ import annotations

from collections import OrderedDict

from hybridkv.kv.block_pool import EVICT_FIRST, KVBlock
from hybridkv.kv.managers import SingleTypeManager
from hybridkv.kv.request import CacheHit, KVRequest

# Known branch points remembered (about 2 MiB of hashes): far more distinct shared prefixes than any pool holds.
MAX_BRANCH_POINTS = 1 << 16


class BranchPoints:
    """The registry of known branch points (a bounded LRU set of chained block hashes) over the sliding and
    chunked groups ``local``; full groups retain every block anyway."""

    def __init__(self, block_size: int, local: list[SingleTypeManager], null_block: KVBlock) -> None:
        self.block_size = block_size
        self._local = local
        self._null_block = null_block
        # Chained hashes of the last block before each known branch point.
        self._registry: OrderedDict[bytes, None] = OrderedDict()

    def points(self, req: KVRequest, hit: CacheHit) -> tuple[int, ...]:
        """Hit points (in blocks) whose windows this request keeps: its own hit, the branch point, and every
        registered branch point its prompt passes.

        A branch point is registered when nothing retained it yet: the prompt left a cached prefix where the
        sliding or chunked groups could not resume, or they resumed only thanks to blocks waiting in the
        evict-first queue. A hit on a retained point (a conversation's next turn at the previous turn's end)
        registers nothing.
        """
        registry = self._registry
        if hit.shared_blocks * self.block_size > hit.num_tokens or self._needs_evict_first(hit):
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

    def _needs_evict_first(self, hit: CacheHit) -> bool:
        """Whether a sliding or chunked group's hit uses a block from the evict-first queue (O(window))."""
        for m in self._local:
            for block in reversed(hit.blocks[m.group.group_id]):
                if block is self._null_block:
                    break
                if block.free_list == EVICT_FIRST:
                    return True
        return False


class NoBranchPoints:
    """Full attention only (every block a hit can use is retained anyway), or no prefix caching (no hit ever)."""

    def points(self, req: KVRequest, hit: CacheHit) -> tuple[int, ...]:
        return ()
