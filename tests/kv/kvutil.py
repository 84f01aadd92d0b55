"""Small helpers shared by the KV cache tests."""

from pathlib import Path

from hybridkv.kv import CacheRequest, FullAttentionSpec, KVCacheManager, SlidingWindowSpec, ChunkedLocalSpec, plan_layout


SCOUT = Path(__file__).parent.parent / "data" / "scout-text-config.json"


def full(heads=1, dim=8):
    return FullAttentionSpec(heads, dim)


def sliding(window, heads=1, dim=8):
    return SlidingWindowSpec(heads, dim, window=window)


def chunked(chunk, heads=1, dim=8):
    return ChunkedLocalSpec(heads, dim, chunk=chunk)


def manager(specs, block_size, num_blocks, **kw):
    return KVCacheManager(plan_layout(list(specs), block_size), num_blocks, **kw)


def group_of(kv, kind, nth=0):
    """Group id of the ``nth`` group of an attention kind."""
    return [m.group.group_id for m in kv.managers if m.spec.kind == kind][nth]


def run(kv, req, step=None, use_hit=True):
    """Admit ``req`` (with a prefix hit), compute all its tokens in steps of ``step``; returns the hit."""
    hit = kv.find_cache_hit(req) if use_hit else None
    n = len(req.all_token_ids)
    first = min(n - (hit.num_tokens if hit else 0), step or n)
    assert kv.allocate_slots(req, first, hit)
    if hit is not None:
        kv.record_hit(req, hit)
    req.num_computed_tokens += (hit.num_tokens if hit else 0) + first
    kv.on_tokens_computed(req)
    while req.num_computed_tokens < n:
        k = min(step or n, n - req.num_computed_tokens)
        assert kv.allocate_slots(req, k)
        req.num_computed_tokens += k
        kv.on_tokens_computed(req)
    return hit


def table(kv, req, gid=0):
    return kv.block_tables(req.request_id)[gid].tolist()


def evict(pool, block):
    """Evict one specific free cached block, as memory pressure would."""
    assert block.ref_cnt == 0 and block.hash_key is not None
    pool.touch([block], block.group_id)
    pool._evict(block)
    pool.free_blocks([block])


def cached_block(kv, req, gid, index):
    return kv.pool.lookup((req.block_hashes[index], gid))


def req(rid, tokens, **kw):
    return CacheRequest(rid, list(tokens), **kw)
