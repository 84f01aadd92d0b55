"""Prefix caching: hashes, hits per attention type, hybrid fixed point, eviction and retention."""

import pytest

from kvutil import cached_block, chunked, evict, full, group_of, manager, req, run, sliding, table

from hybridkv.kv.block_hash import BlockHasher


# ---- hashes ----------------------------------------------------------------------------------------
def test_block_hasher_chain_salt_adapter_and_algorithms():
    h = BlockHasher(2)
    hs = []
    h.extend(hs, [5, 6, 7, 8, 9])
    assert len(hs) == 2 and len(hs[0]) == 16
    h.extend(hs, [5, 6, 7, 8, 9])  # nothing new
    assert len(hs) == 2
    inc = []
    h.extend(inc, [5, 6, 7])
    h.extend(inc, [5, 6, 7, 8, 9, 10])
    assert inc == hs + inc[2:] and len(inc) == 3
    other = []
    h.extend(other, [5, 6, 7, 9])
    assert other[0] == hs[0] and other[1] != hs[1]
    for kw in ({"cache_salt": "s"}, {"adapter_id": 3}):
        x = []
        h.extend(x, [5, 6, 7, 8], **kw)
        assert x[0] != hs[0] and x[1] != hs[1]
    sha = []
    BlockHasher(2, "sha256").extend(sha, [5, 6, 7, 8])
    assert len(sha[0]) == 32 and sha[0] != hs[0]
    with pytest.raises(ValueError, match="unknown prefix-cache hash"):
        BlockHasher(2, "md5")


# ---- the worked examples ---------------------------------------------------------------------------
def test_prefix_cache_full_attention_example():
    kv = manager([full()], 16, 10)
    common = list(range(48))
    a = req("a", common + [100] * 7)  # 3 full blocks + 7 tokens
    assert run(kv, a).num_tokens == 0
    assert table(kv, a) == [1, 2, 3, 4]
    b = req("b", common + [200] * 7)
    hit = run(kv, b)
    assert hit.num_tokens == 48 and [blk.block_id for blk in hit.blocks[0]] == [1, 2, 3]
    assert table(kv, b) == [1, 2, 3, 5]
    assert [kv.pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5)] == [2, 2, 2, 1, 1]
    assert kv.stats.queries == 2 and kv.stats.hits == 1 and kv.stats.hit_tokens == 48
    kv.free(a)
    kv.free(b)
    assert kv.pool.num_free_blocks == 9 and kv.pool.num_cached_blocks == 3


def test_different_salts_never_share_and_same_salt_does():
    kv = manager([full()], 4, 16)
    tokens = list(range(13))
    run(kv, req("a", tokens, cache_salt="alice"))
    assert kv.find_cache_hit(req("b", tokens, cache_salt="bob")).num_tokens == 0
    assert kv.find_cache_hit(req("c", tokens)).num_tokens == 0
    assert kv.find_cache_hit(req("d", tokens, cache_salt="alice")).num_tokens == 12


def test_adapter_id_separates():
    kv = manager([full()], 4, 16)
    tokens = list(range(9))
    run(kv, req("a", tokens, adapter_id="lora-1"))
    assert kv.find_cache_hit(req("b", tokens, adapter_id="lora-2")).num_tokens == 0
    assert kv.find_cache_hit(req("c", tokens)).num_tokens == 0
    assert kv.find_cache_hit(req("d", tokens, adapter_id="lora-1")).num_tokens == 8


def test_sha256_option_hits():
    kv = manager([full(), sliding(4)], 2, 32, hash_algorithm="sha256")
    a = req("a", range(9))
    run(kv, a)
    assert len(a.block_hashes[0]) == 32
    assert kv.find_cache_hit(req("b", range(9))).num_tokens == 8


def test_at_least_one_token_is_left_to_compute():
    kv = manager([full()], 4, 16)
    run(kv, req("a", range(8)))
    assert kv.find_cache_hit(req("b", range(8))).num_tokens == 4
    assert kv.find_cache_hit(req("c", range(9))).num_tokens == 8


def test_sliding_hit_pattern_example():
    kv = manager([sliding(4)], 2, 32)
    tokens = list(range(23))
    a = req("a", tokens)
    run(kv, a, step=2)
    kv.free(a)
    pattern = [True, True, False, True, False, False, True, True, False, False, False]
    for i, keep in enumerate(pattern):
        if not keep:
            evict(kv.pool, cached_block(kv, a, 0, i))
    assert [cached_block(kv, a, 0, i) is not None for i in range(11)] == pattern
    hit = kv.find_cache_hit(req("b", tokens))
    assert hit.num_tokens == 16
    blocks = hit.blocks[0]
    assert len(blocks) == 8 and all(b is kv.pool.null_block for b in blocks[:6])
    assert blocks[6:] == [cached_block(kv, a, 0, 6), cached_block(kv, a, 0, 7)]
    b = req("b", tokens)
    assert kv.allocate_slots(b, 7, kv.find_cache_hit(b))
    assert table(kv, b)[:8] == [0] * 6 + [blocks[6].block_id, blocks[7].block_id]
    assert blocks[6].ref_cnt == 1 and len(table(kv, b)) == 12


def hybrid_after_one_request(n_tokens=17):
    kv = manager([full(), sliding(8), sliding(8)], 4, 64)  # 1 full + 2 sliding groups
    a = req("a", range(n_tokens))
    run(kv, a, step=4)
    kv.free(a)
    return kv, a


def test_hybrid_evicting_a_sliding_groups_first_block_keeps_the_full_hit():
    kv, a = hybrid_after_one_request()
    s1 = group_of(kv, "sliding", 0)
    evict(kv.pool, cached_block(kv, a, s1, 0))
    assert kv.find_cache_hit(req("b", range(17))).num_tokens == 16


def test_hybrid_evicting_the_full_groups_first_block_gives_no_hit():
    kv, a = hybrid_after_one_request()
    evict(kv.pool, cached_block(kv, a, group_of(kv, "full"), 0))
    hit = kv.find_cache_hit(req("b", range(17)))
    assert hit.num_tokens == 0 and hit.blocks == [[], [], []]


def test_hybrid_fixed_point_takes_the_shortest_acceptable_length():
    kv, a = hybrid_after_one_request()
    s2 = group_of(kv, "sliding", 1)
    evict(kv.pool, cached_block(kv, a, s2, 3))  # hits ending at 4 blocks need blocks 2-3 of every sliding group
    hit = kv.find_cache_hit(req("b", range(17)))
    assert hit.num_tokens == 12
    assert all(len(bl) == 3 for bl in hit.blocks)
    assert hit.blocks[s2][0] is kv.pool.null_block and hit.blocks[group_of(kv, "full")][0] is not kv.pool.null_block


def test_chunked_hits_only_need_the_current_chunk():
    kv = manager([full(), chunked(8)], 4, 64)
    fg, cg = group_of(kv, "full"), group_of(kv, "chunked")
    a = req("a", range(23))
    run(kv, a, step=4)
    kv.free(a)
    for i in range(4):  # blocks of earlier chunks
        evict(kv.pool, cached_block(kv, a, cg, i))
    hit = kv.find_cache_hit(req("b", range(23)))
    assert hit.num_tokens == 20  # token 20 needs chunk 16..23: block 4 only
    assert hit.blocks[cg] == [kv.pool.null_block] * 4 + [cached_block(kv, a, cg, 4)]
    evict(kv.pool, cached_block(kv, a, cg, 4))
    hit = kv.find_cache_hit(req("c", range(23)))
    assert hit.num_tokens == 16 and hit.blocks[cg] == [kv.pool.null_block] * 4  # a chunk boundary needs nothing
    assert len(hit.blocks[fg]) == 4


def test_chunk_boundary_inside_a_block_hits():
    # chunk 24, block 16: a hit at 32 tokens needs block 1 (tokens 24..31), at 48 nothing, at 64 block 3.
    kv = manager([full(), chunked(24)], 16, 64)
    cg = group_of(kv, "chunked")
    a = req("a", range(81))
    run(kv, a, step=16)
    kv.free(a)
    assert kv.find_cache_hit(req("b", range(81))).num_tokens == 80
    evict(kv.pool, cached_block(kv, a, cg, 4))
    hit = kv.find_cache_hit(req("c", range(81)))
    assert hit.num_tokens == 64 and hit.blocks[cg][3] is cached_block(kv, a, cg, 3)
    evict(kv.pool, cached_block(kv, a, cg, 3))
    hit = kv.find_cache_hit(req("d", range(81)))
    assert hit.num_tokens == 48 and hit.blocks[cg] == [kv.pool.null_block] * 3
    # chunk 8, block 16: every block boundary is a chunk boundary: the full group alone decides
    kv = manager([full(), chunked(8)], 16, 64)
    a = req("a", range(50))
    run(kv, a)
    kv.free(a)
    hit = kv.find_cache_hit(req("b", range(50)))
    assert hit.num_tokens == 48 and hit.blocks[group_of(kv, "chunked")] == [kv.pool.null_block] * 3


def test_preempted_request_resumes_from_its_own_blocks():
    kv = manager([full(), sliding(4)], 2, 32)
    r = req("r", range(11))
    run(kv, r, step=3)
    kv.free(r)
    r.num_computed_tokens = 0
    hit = run(kv, r)
    assert hit.num_tokens == 10 and kv.pool.num_evictions == 0


# ---- eviction and retention ------------------------------------------------------------------------
def pressure(kv, n, rid="p"):
    """Another request takes ``n`` blocks of fresh content (evicting cached blocks once uncached run out)."""
    groups = kv.num_groups
    p = req(rid, [10**6 + i for i in range(kv.block_size * (n // groups))])
    assert kv.allocate_slots(p, len(p.all_token_ids))
    return p


def test_cached_blocks_evicted_only_when_no_uncached_block_is_free():
    kv = manager([full()], 4, 11)  # 10 usable
    a = req("a", range(17))
    run(kv, a)
    kv.free(a)
    assert kv.pool.num_cached_blocks == 4
    pressure(kv, 5)  # 5 uncached blocks are free: nothing evicted
    assert kv.pool.num_evictions == 0 and kv.find_cache_hit(req("b", range(17))).num_tokens == 16
    pressure(kv, 2, "q")  # tail blocks go first: the prefix survives
    assert kv.pool.num_evictions == 1 and kv.find_cache_hit(req("c", range(17))).num_tokens == 12


def long_sliding_run(retention_interval=None, n=100):
    # block 4, window 8: a hit ending at block e needs blocks e-2, e-1; default retention: every 32 tokens
    kv = manager([full(), sliding(8)], 4, 128, retention_interval=retention_interval)
    a = req("a", range(n))
    run(kv, a, step=16)
    kv.free(a)
    return kv, a


def test_retention_keeps_a_hit_inside_a_shared_prefix():
    """vLLM #48435: B shares A's first 70 tokens. Naive recycling of freed sliding blocks loses the hit."""
    results = {}
    kv, _ = long_sliding_run()
    n = len(kv.pool._uncached) + kv.pool._evict_first.size  # the same pressure for both
    for interval in (None, 0):
        kv, a = long_sliding_run(interval)
        pressure(kv, n)
        b = req("b", list(range(70)) + [-1] * 20)
        results[interval] = kv.find_cache_hit(b).num_tokens
    assert results[None] == 64  # checkpoint at 64 tokens (16 blocks): its window (blocks 14, 15) was retained
    assert results[0] == 0


def test_no_cliff_when_a_block_in_the_final_window_is_evicted():
    """SGLang PR 35515: one evicted block inside the last window must not make the whole prefix unmatchable."""
    hits = {}
    for interval in (None, 0):
        kv, a = long_sliding_run(interval)
        sg = group_of(kv, "sliding")
        pressure(kv, len(kv.pool._uncached) + kv.pool._evict_first.size)  # every evict-first block goes
        evict(kv.pool, cached_block(kv, a, sg, 23))  # inside the final window (blocks 23, 24)
        hits[interval] = kv.find_cache_hit(req("b", list(range(100)) + [7] * 20)).num_tokens
    assert hits[None] == 64  # back to the last retained checkpoint below the evicted block
    assert hits[0] == 0  # without retention: the cliff


def test_hit_shrinks_gradually_under_growing_pressure():
    """Blocks freed tail first in every group, retained checkpoints included: no cliff from LRU order either."""
    seen = []
    for k in range(16):
        kv, a = long_sliding_run()
        base = len(kv.pool._uncached) + kv.pool._evict_first.size
        pressure(kv, base + k)
        seen.append(kv.find_cache_hit(req("b", list(range(100)) + [7] * 20)).num_tokens // 4)
    # evicted in order: full 24, sliding 24, full 23 (-> checkpoint 16), ..., full 15 (-> checkpoint 8)
    assert seen == [25, 24, 24] + [16] * 10 + [8] * 3


# ---- branch points: prefixes shared by several requests ------------------------------------------------
def traffic(kv, seed, n_tokens):
    """An unrelated request that runs and finishes, pushing cached blocks out when the pool is short."""
    o = req(f"traffic-{seed}", [10**6 * seed + j for j in range(n_tokens)])
    run(kv, o, step=8, use_hit=False)
    kv.free(o)


@pytest.mark.parametrize("kind", ["sliding", "chunked"])
def test_shared_system_prompt_is_hit_on_first_turns_under_pressure(kind):
    """Conversations share a 30-token system prompt that ends on no retention checkpoint; between two first turns
    other traffic takes most of the pool. Once a request has found the system prompt's full-attention blocks
    without the window before their end (the branch point), that window is kept in LRU by every request through
    it, and every later conversation hits the whole system prompt (28 tokens: 7 full blocks). With request-end
    retention alone they would all get 0 (sliding) or the chunk boundary at 24 (chunked)."""
    local = sliding(8) if kind == "sliding" else chunked(8)
    kv = manager([full(), local], 4, 60)
    system = list(range(30))
    hits = []
    for i in range(6):
        r = req(f"c{i}", system + [1000 * (i + 1) + j for j in range(20)])
        hits.append(run(kv, r, step=8).num_tokens)
        kv.free(r)
        traffic(kv, 10 + i, 100)
    assert hits == ([0, 0, 0] if kind == "sliding" else [0, 24, 24]) + [28, 28, 28]
    assert kv.pool.num_evictions > 100  # the pool really was short
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


def test_document_asked_several_questions_after_other_traffic():
    """A 90-token document (sliding window 8, block 4, checkpoints every 32 tokens) asked four questions with
    other traffic in between. The second question still finds the window before the document's end in the
    evict-first queue: that hit reveals a branch point nobody retained, so from then on every request through the
    document keeps that window in LRU and every question hits the whole document (88 tokens). Before branch
    points, the hit wandered: 88, then 0 (the second question demoted the window again), then 32."""
    kv = manager([full(), sliding(8)], 4, 90)
    document = list(range(90))
    hits = []
    for q in range(4):
        r = req(f"q{q}", document + [5000 + 100 * q + j for j in range(10)])
        hits.append(run(kv, r, step=8).num_tokens)
        kv.free(r)
        traffic(kv, 20 + q, 100)
    assert hits == [0, 88, 88, 88]
    assert kv.pool.num_evictions > 100


def test_branch_point_window_survives_while_a_conversation_keeps_the_prefix_hot():
    """A conversation whose later turns extend past the shared system prompt touches the prompt's full blocks
    each turn but not the window before its end (its tables hold nulls there). That window must not age out ahead
    of the full blocks it makes usable: releasing a turn refreshes it in sequence order. Under growing pressure, a
    new conversation with the same system prompt hits all of it for as long as its full blocks are cached."""
    system = list(range(30))
    outcomes = set()
    for k in range(0, 64, 3):
        kv = manager([full(), sliding(8)], 4, 90)
        for i in range(2):  # the second one finds the branch point (the end of the system prompt)
            r = req(f"a{i}", system + [7000 + 100 * i + j for j in range(10)])
            run(kv, r)
            kv.free(r)
        history = system + [7000 + j for j in range(10)]
        for turn in range(3):  # later turns extend the first conversation: hits beyond the system prompt
            history = history + [8000 + 100 * turn + j for j in range(20)]
            r = req(f"turn{turn}", history)
            assert run(kv, r, step=8).num_tokens > 28
            kv.free(r)
        pressure(kv, min(len(kv.pool._uncached) + kv.pool._evict_first.size + k, kv.pool.num_free_blocks))
        probe = req("new", system + [9999] * 10)
        hit = kv.find_cache_hit(probe).num_tokens
        full_prefix = all(cached_block(kv, probe, group_of(kv, "full"), i) for i in range(7))
        outcomes.add((full_prefix, hit))
    assert outcomes == {(True, 28), (False, 0)}  # never the full blocks without the window
