"""The two-tier prefix cache (device pool + host tier), as bookkeeping: examples, then random workloads whose page
contents are simulated through the recorded copies and checked at every read."""

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvutil import full, manager, req, run, sliding
from test_properties import MAX_STEP, check_invariants, drive_workload, layouts, snapshot

from hybridkv.kv.block_pool import EVICT_FIRST, LRU, KVBlock
from hybridkv.kv.host_tier import HostBlock, HostTier, host_tier_tokens


def apply(ops, dev, host):
    """Run recorded copies on simulated pages (block/slot -> the (hash, group) whose KV the page holds)."""
    for op in ops:
        for b, s in zip(op.device_blocks.tolist(), op.host_slots.tolist()):
            if op.to_host:
                host[s] = dev.get(b)
            else:
                dev[b] = host.get(s)


def test_write_back_keeps_lru_blocks_only_and_a_full_tier_drops_its_oldest_page():
    tier = HostTier(2, page_bytes=100)
    pool_blocks = []
    for i, free_list in enumerate([LRU, EVICT_FIRST, LRU, LRU]):
        block = KVBlock(i + 1, hash_key=(bytes([i]), 0), free_list=free_list)
        pool_blocks.append(block)
        tier.write_back(block)
    ops = tier.take_ops()
    assert [(op.to_host, op.device_blocks.tolist(), op.host_slots.tolist()) for op in ops] == [
        (True, [1, 3, 4], [0, 1, 0])  # block 4 reuses the slot of block 1, the least recently used
    ]
    assert tier.lookup((bytes([0]), 0)) is None and tier.lookup((bytes([1]), 0)) is None
    assert tier.lookup((bytes([3]), 0)).slot == 0
    assert tier.stats.evictions == 1 and tier.stats.bytes_written == 300
    tier.write_back(pool_blocks[2])  # already here: refreshed only, no copy
    assert tier.take_ops() == []


def test_a_full_attention_prefix_evicted_from_the_device_comes_back_from_the_host():
    kv = manager([full()], 2, 8, host_blocks=16)
    a = req("a", range(1, 12))
    run(kv, a, step=4)
    kv.free(a)  # 5 full blocks cached, free
    b = req("b", range(50, 62))
    run(kv, b, step=4)  # needs 6 blocks: evicts a's, which go to the host
    kv.free(b)
    written = kv.take_block_ops()
    assert written and all(op.to_host for op in written)
    c = req("c", list(range(1, 12)) + [99])
    hit = kv.find_cache_hit(c)
    assert hit.num_tokens == 10 and hit.host_tokens > 0
    assert any(isinstance(x, HostBlock) for x in hit.blocks[0])
    assert kv.allocate_slots(c, 2, hit)
    loads = [op for op in kv.take_block_ops() if not op.to_host]
    table = kv.block_tables("c")[0].tolist()
    assert sorted(b for op in loads for b in op.device_blocks.tolist()) == sorted(
        table[i] for i, x in enumerate(hit.blocks[0]) if table[i] in {b for op in loads for b in op.device_blocks}
    )
    assert all(kv.pool.blocks[i].hash_key == (c.block_hashes[j], 0) for j, i in enumerate(table[:5]))
    kv.free(c)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


def test_pages_being_loaded_are_not_reused_by_write_backs_of_the_same_admission():
    kv = manager([full()], 2, 4, host_blocks=2)  # 3 usable device blocks, 2 host pages
    a = req("a", [1, 2, 3, 4, 5])
    run(kv, a)
    kv.free(a)
    b = req("b", [6, 7, 8, 9, 10])
    run(kv, b)  # evicts a's two cached blocks: host pages 0, 1, the host tier is full
    kv.free(b)
    assert [(op.to_host, op.host_slots.tolist()) for op in kv.take_block_ops()] == [(True, [0, 1])]
    c = req("c", [1, 2, 3, 4, 11])
    hit = kv.find_cache_hit(c)
    assert hit.host_tokens == 4
    # the fresh blocks for a's pages evict b's cached blocks, whose write-back must not take pages 0 or 1
    assert kv.allocate_slots(c, 1, hit)
    ops = [(op.to_host, op.host_slots.tolist()) for op in kv.take_block_ops()]
    # a's blocks were evicted tail first (block 1 went to page 0); b's first evicted block finds no page to take
    # (both are being loaded) and is dropped; the block for c's new token evicts b's second one, whose write-back
    # takes the host tier's least recent page (1) after the load from it
    assert ops == [(False, [1, 0]), (True, [1])], ops
    assert kv.host.num_cached_blocks == 2 and kv.host.lookup((c.block_hashes[1], 0)).slot == 0


def test_sliding_groups_write_back_only_the_window_before_a_hit_point():
    # window 4, block 2: a hit at the end of a 16-token prompt needs blocks 6 and 7 of the sliding group only
    kv = manager([full(), sliding(4)], 2, 40, host_blocks=64, retention_interval=0)
    a = req("a", range(1, 18))
    run(kv, a, step=4)
    kv.free(a)
    group_of = {b.block_id: b.group_id for b in kv.pool.blocks}
    taken = kv.pool.get_new_blocks(kv.pool.num_free_blocks)  # memory pressure: every cached block is evicted
    kv.pool.free_blocks(taken)
    stored = Counter(group_of[b] for op in kv.take_block_ops() for b in op.device_blocks.tolist())
    sliding_gid = next(m.group.group_id for m in kv.managers if m.spec.kind == "sliding")
    full_gid = 1 - sliding_gid
    assert stored[full_gid] == 8  # every full block whole
    assert stored[sliding_gid] == 2  # the window before the end point (tokens 12..15), nothing else
    assert kv.host.stats.kept == 10 < kv.host.stats.device_evictions
    b = req("b", list(range(1, 17)) + [77, 78])
    hit = kv.find_cache_hit(b)
    assert hit.num_tokens == 16 and hit.host_tokens == 16


def test_a_load_that_cannot_get_device_blocks_takes_nothing_and_waits_like_a_recompute():
    kv = manager([full()], 2, 10, host_blocks=16)
    a = req("a", range(1, 12))
    run(kv, a, step=4)
    kv.free(a)
    filler = req("f", range(100, 117))
    run(kv, filler, step=4)  # holds 9 of 9 usable blocks: a's blocks are all in the host tier now
    kv.take_block_ops()
    c = req("c", list(range(1, 12)) + [5])
    hit = kv.find_cache_hit(c)
    assert hit.num_tokens == 10 and hit.host_tokens == 10
    # the five loads need five device blocks, as recomputing those tokens would: refused, nothing taken
    host_before = dict(kv.host._slots)
    assert kv.blocks_for_all_tokens(c, hit) == kv.blocks_for_all_tokens(c, kv.find_cache_hit(req("x", [7] * 12)))
    assert not kv.allocate_slots(c, 2, hit, full_sequence_must_fit=True)
    assert dict(kv.host._slots) == host_before and not kv.take_block_ops() and not kv.has_blocks("c")
    kv.free(filler)
    hit = kv.find_cache_hit(c)
    assert kv.allocate_slots(c, 2, hit, full_sequence_must_fit=True)
    assert sum(len(op) for op in kv.take_block_ops() if not op.to_host) == 5


def test_plan_tokens_of_the_host_tier():
    # Scout TP-8 rank, block 16: page 96 KiB = 16 tokens x 12 full layers x 512 B; one full group
    assert host_tier_tokens(100 << 30, 16 * 12 * 512, 16, 1) == (100 << 30) // (12 * 512) // 16 * 16
    assert host_tier_tokens(1 << 30, 4096, 16, 0) is None


def expected(r, gid, i):
    return (r.block_hashes[i], gid)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(layout=layouts(), data=st.data())
def test_random_workloads_keep_both_tiers_consistent(layout, data):
    """No block owned twice (the pool's exact invariants), every cached page (device or host) holds the KV of its
    hash once the recorded copies have run, every page a step reads holds what its position needs (so no page is
    read before its copy ran), and at the end everything is free and no copy is left over."""
    specs, block_size = layout
    kv = manager(specs, block_size, data.draw(st.integers(4, 30), "num_blocks"), max_step_tokens=MAX_STEP,
                 host_blocks=data.draw(st.integers(1, 24), "host_blocks"),
                 retention_interval=data.draw(st.sampled_from([None, 0, 4]), "retention"))
    dev: dict[int, object] = {}
    host: dict[int, object] = {}
    prefixes = data.draw(st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=3), "prefixes")
    live: dict[str, object] = {}

    def check_tiers():
        for key, block in kv.pool._cached.items():
            assert dev.get(block.block_id) == key
        slots = list(kv.host._slots.values())
        assert len(set(slots)) == len(slots) and not set(slots) & set(kv.host._free)
        assert len(slots) + len(kv.host._free) == kv.host.num_blocks
        for key, slot in kv.host._slots.items():
            assert host.get(slot) == key

    def compute(r, k):
        """The step: run the copies, read what the step attends to, write its tokens."""
        apply(kv.take_block_ops(), dev, host)
        check_tiers()
        c = r.num_computed_tokens
        tables = [t.tolist() for t in kv.block_tables(r.request_id)]  # copies: the step may null entries
        for m in kv.managers:
            gid = m.group.group_id
            table = tables[gid]
            for i in range(m.first_needed_block(c), c // block_size):
                assert dev.get(table[i]) == expected(r, gid, i), (m.spec, i, c)
        r.num_computed_tokens += k
        kv.on_tokens_computed(r)
        for m in kv.managers:
            gid = m.group.group_id
            table = tables[gid]
            for i in range(c // block_size, min(r.num_computed_tokens // block_size, len(r.block_hashes))):
                dev[table[i]] = expected(r, gid, i)
        check_tiers()

    def admit(r):
        hit = kv.find_cache_hit(r)
        for m in kv.managers:
            blocks = hit.blocks[m.group.group_id]
            for i in range(m.first_needed_block(hit.num_tokens), hit.num_tokens // block_size):
                key = blocks[i].key if isinstance(blocks[i], HostBlock) else blocks[i].hash_key
                assert key == expected(r, m.group.group_id, i)
        k = min(len(r.all_token_ids) - hit.num_tokens, data.draw(st.integers(1, MAX_STEP), "k"))
        before = snapshot(kv), dict(kv.host._slots), len(kv.host._ops)
        if not kv.allocate_slots(r, k, hit):
            assert (snapshot(kv), dict(kv.host._slots), len(kv.host._ops)) == before
            return False
        kv.record_hit(r, hit)
        r.num_computed_tokens = hit.num_tokens
        live[r.request_id] = r
        check_invariants(kv, live)
        compute(r, k)
        return True

    drive_workload(data, kv, prefixes, live, admit, compute)

    for r in list(live.values()):
        kv.free(live.pop(r.request_id))
    apply(kv.take_block_ops(), dev, host)
    check_tiers()
    check_invariants(kv, live)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    assert not kv.take_block_ops()
