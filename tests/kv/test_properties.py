"""Random workloads over random hybrid layouts; exact pool invariants checked after every operation."""

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvutil import chunked, full, manager, req, sliding

from hybridkv.kv.block_pool import EVICT_FIRST, LRU, NOT_FREE, UNCACHED
from hybridkv.kv.specs import cdiv

MAX_STEP = 8
OPS = ["new", "new", "step", "step", "step", "step", "free", "free", "preempt", "resume"]


@st.composite
def layouts(draw):
    kinds = draw(st.lists(st.sampled_from(["full", "sliding", "chunked"]), min_size=1, max_size=4))
    specs = []
    for k in kinds:
        if k == "full":
            specs.append(full())
        elif k == "sliding":
            specs.append(sliding(draw(st.integers(1, 12))))
        else:
            specs.append(chunked(draw(st.integers(1, 12))))
    return specs, draw(st.sampled_from([1, 2, 4, 8, 16]))


def queue_ids(pool):
    return [b.block_id for b in pool._uncached], [b.block_id for b in pool._evict_first], [b.block_id for b in pool._lru]


def snapshot(kv):
    return [(b.ref_cnt, b.free_list, b.hash_key) for b in kv.pool.blocks], queue_ids(kv.pool)


def check_invariants(kv, live):
    pool = kv.pool
    owners = Counter()
    for r in live.values():
        if not kv.has_blocks(r.request_id):
            continue
        seen = set()
        for m in kv.managers:
            ids = m.block_ids(r.request_id).tolist()
            assert len(ids) >= cdiv(r.num_computed_tokens, kv.block_size)
            first = m.first_needed_block(r.num_computed_tokens)
            assert all(i == 0 for i in ids[:first]), (m.spec, ids, r.num_computed_tokens)
            assert m.num_live_blocks(r.request_id) <= m.spec.max_live_blocks(len(ids) * kv.block_size, kv.block_size, MAX_STEP)
            for i, bid in enumerate(ids):
                if bid:
                    assert bid not in seen  # a request never holds one block twice
                    seen.add(bid)
                    owners[bid] += 1
                    assert pool.blocks[bid].group_id == m.group.group_id
    null = pool.null_block
    assert null.ref_cnt == 1 and null.free_list == NOT_FREE and null.hash_key is None
    uncached, evict_first, lru = queue_ids(pool)
    free_ids = uncached + evict_first + lru
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks and 0 not in free_ids
    for ids, mark in ((uncached, UNCACHED), (evict_first, EVICT_FIRST), (lru, LRU)):
        for bid in ids:
            b = pool.blocks[bid]
            assert b.free_list == mark and b.ref_cnt == 0
            assert (b.hash_key is None) == (mark == UNCACHED)
    in_use = Counter()
    for b in pool.blocks[1:]:
        assert b.ref_cnt == owners[b.block_id], (b, owners[b.block_id])  # ref counts exact
        if b.ref_cnt:
            assert b.free_list == NOT_FREE
            in_use[b.group_id] += 1
        if b.ref_cnt > 1:
            assert b.hash_key is not None  # only cached blocks are shared
        if b.hash_key is not None:
            assert pool.lookup(b.hash_key) is b
    assert len(free_ids) + sum(in_use.values()) == pool.num_usable_blocks
    assert {g: n for g, n in pool.in_use_by_group.items() if n} == dict(in_use)
    assert all(k == b.hash_key for k, b in pool._cached.items())


def check_hit(kv, r, hit):
    b = kv.block_size
    assert hit.num_tokens % b == 0 and hit.num_tokens < len(r.all_token_ids)
    n = hit.num_tokens // b
    for m in kv.managers:
        blocks = hit.blocks[m.group.group_id]
        assert len(blocks) == n
        for i in range(m.first_needed_block(hit.num_tokens), n):
            assert blocks[i] is not kv.pool.null_block
            assert blocks[i].hash_key == (r.block_hashes[i], m.group.group_id)


def drive_workload(data, kv, prefixes, live, admit, compute, salts=(None,)):
    """The random op sequence both property tests run: new requests (one of ``prefixes`` plus a random tail),
    resumes of preempted ones, prefill chunks and decode steps, frees and preemptions, checking the pool's invariants
    after each. ``admit(r)`` -> admitted; ``compute(r, k)`` runs a step of ``k`` tokens the manager allocated."""
    waiting: list = []  # preempted or refused, to be admitted again
    prompt_len: dict[str, int] = {}
    for next_id in range(data.draw(st.integers(8, 60), "num_ops")):
        op = data.draw(st.sampled_from(OPS), "op")
        if op == "new" and len(live) + len(waiting) < 6:
            tokens = data.draw(st.sampled_from(prefixes)) + data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=24))
            r = req(f"r{next_id}", tokens, cache_salt=data.draw(st.sampled_from(salts)))
            prompt_len[r.request_id] = len(tokens)
            if not admit(r):
                waiting.append(r)
        elif op == "resume" and waiting:
            r = waiting.pop(data.draw(st.integers(0, len(waiting) - 1)))
            if not admit(r):
                waiting.append(r)
        elif op == "step" and live:
            r = live[data.draw(st.sampled_from(sorted(live)))]
            todo = prompt_len[r.request_id] - r.num_computed_tokens
            if todo > 0:
                k = min(todo, data.draw(st.integers(1, MAX_STEP)))
            else:  # decode: the last sampled token becomes an input
                r.all_token_ids.append(data.draw(st.integers(0, 3)))
                k = len(r.all_token_ids) - r.num_computed_tokens
            before = snapshot(kv)
            if kv.allocate_slots(r, k):
                check_invariants(kv, live)
                compute(r, k)
            else:
                assert snapshot(kv) == before
        elif op in ("free", "preempt") and live:
            r = live.pop(data.draw(st.sampled_from(sorted(live))))
            kv.free(r)
            if op == "preempt":
                r.num_computed_tokens = 0
                prompt_len[r.request_id] = len(r.all_token_ids)
                waiting.append(r)
        check_invariants(kv, live)


@settings(max_examples=1200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(layout=layouts(), data=st.data())
def test_random_workloads_keep_the_pool_consistent(layout, data):
    specs, block_size = layout
    kv = manager(
        specs,
        block_size,
        data.draw(st.integers(4, 40), "num_blocks"),
        enable_prefix_caching=data.draw(st.sampled_from([True, True, True, False]), "caching"),
        hash_algorithm=data.draw(st.sampled_from(["xxh3_128", "sha256"]), "hash"),
        max_step_tokens=MAX_STEP,
        retention_interval=data.draw(st.sampled_from([None, 0, 4, 16]), "retention"),
    )
    prefixes = data.draw(st.lists(st.lists(st.integers(0, 3), max_size=40), min_size=1, max_size=3), "prefixes")
    live: dict[str, object] = {}  # admitted, holding blocks

    def admit(r):
        hit = kv.find_cache_hit(r)
        if kv.enable_prefix_caching:
            check_hit(kv, r, hit)
        k = min(len(r.all_token_ids) - hit.num_tokens, data.draw(st.integers(1, MAX_STEP), "k"))
        before = snapshot(kv)
        if not kv.allocate_slots(r, k, hit):
            assert snapshot(kv) == before and not kv.has_blocks(r.request_id)
            return False
        r.num_computed_tokens = hit.num_tokens
        live[r.request_id] = r
        check_invariants(kv, live)
        compute(r, k)
        return True

    def compute(r, k):
        r.num_computed_tokens += k
        kv.on_tokens_computed(r)

    drive_workload(data, kv, prefixes, live, admit, compute, salts=[None, None, "s"])

    for r in list(live.values()):
        kv.free(live.pop(r.request_id))
        check_invariants(kv, live)
    pool = kv.pool
    assert pool.num_free_blocks == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert not any(pool.in_use_by_group.values())
    assert pool.num_cached_blocks == pool._evict_first.size + pool._lru.size
