"""The KV cache manager's per-step shortcuts: ``tables_version`` (one version names one request's block tables as they
are, so a decode step re-sends only the tables whose version changed), and drops and publishes that run once per
computed count yet again for a request freed and admitted anew."""

import random

from kvutil import chunked, full, group_of, manager, req, sliding, table


def snapshot(kv, rid):
    return tuple(tuple(t.tolist()) for t in kv.block_tables(rid))


class Watcher:
    """Checks, after every operation, that equal versions mean equal tables of one request, and that a request
    whose tables changed got a new version."""

    def __init__(self, kv) -> None:
        self.kv = kv
        self.seen: dict[int, tuple[str, tuple]] = {}  # version -> (request, tables)
        self.last: dict[str, tuple[int, tuple]] = {}  # request -> (version, tables)
        self.changes = 0

    def check(self, live) -> None:
        for r in live:
            if not self.kv.has_blocks(r.request_id):
                continue
            version, tables = self.kv.tables_version(r.request_id), snapshot(self.kv, r.request_id)
            assert self.seen.setdefault(version, (r.request_id, tables)) == (r.request_id, tables)
            before = self.last.get(r.request_id)
            if before is not None and before[1] != tables:
                assert before[0] != version
                self.changes += 1
            self.last[r.request_id] = (version, tables)


def test_versions_follow_appends_drops_hits_preemption_and_frees():
    kv = manager([full(), sliding(6), chunked(8)], 2, 40, max_step_tokens=6)
    watch = Watcher(kv)
    rnd = random.Random(0)
    prefix = [rnd.randrange(50) for _ in range(9)]
    waiting = [req(f"r{i}", prefix[: rnd.randint(3, 9)] + [rnd.randrange(50) for _ in range(rnd.randint(1, 8))])
               for i in range(8)]
    running, hits, preempted, finished = [], 0, 0, 0
    for _ in range(400):
        if waiting and (not running or rnd.random() < 0.3):
            r = waiting.pop(0)
            hit = kv.find_cache_hit(r)
            n = min(len(r.all_token_ids) - hit.num_tokens, 6)
            if kv.allocate_slots(r, n, hit):
                hits += hit.num_tokens > 0
                r.num_computed_tokens += hit.num_tokens + n
                kv.on_tokens_computed(r)
                running.append(r)
            else:
                waiting.insert(0, r)
        elif running:
            r = rnd.choice(running)
            if r.num_computed_tokens == len(r.all_token_ids):
                r.all_token_ids.append(rnd.randrange(50))  # decode: the sampled token
            n = min(len(r.all_token_ids) - r.num_computed_tokens, 6)
            if not kv.allocate_slots(r, n):
                victim = running.pop()  # preempt the newest
                kv.free(victim)
                victim.num_computed_tokens = 0
                waiting.insert(0, victim)
                preempted += 1
            else:
                r.num_computed_tokens += n
                kv.on_tokens_computed(r)
                if len(r.all_token_ids) >= 30 and rnd.random() < 0.2:
                    running.remove(r)
                    kv.free(r)
                    finished += 1
                    r2 = req(r.request_id + "+", r.all_token_ids[:12])  # a later turn of the same prefix
                    waiting.append(r2)
        watch.check(running)
    assert hits and preempted and finished and watch.changes > 100  # the scenario reached every case


def test_out_of_reach_blocks_drop_once_per_computed_count_and_again_after_a_free():
    kv = manager([full(), sliding(4)], 2, 20, enable_prefix_caching=False)
    sg = group_of(kv, "sliding")
    for life in range(2):  # freed in between: the second life's tables drop again at the same count
        r = req("r", range(9))
        assert kv.allocate_slots(r, 9)
        r.num_computed_tokens = 9  # computed, but nobody called on_tokens_computed: the next allocation drops
        version = kv.tables_version("r")
        assert kv.allocate_slots(r, 1)
        assert table(kv, r, sg)[:3] == [0, 0, 0] and 0 not in table(kv, r, sg)[3:], life  # needed from token 6
        assert kv.tables_version("r") != version
        version = kv.tables_version("r")
        assert kv.allocate_slots(r, 1) and kv.tables_version("r") == version  # nothing more to drop or add
        kv.free(r)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


def test_full_blocks_publish_once_per_count_and_again_after_a_free():
    kv = manager([full(), sliding(4)], 2, 20)
    for life, tokens in enumerate([[1, 2, 3, 4, 5], [6, 7, 8, 9, 5]]):  # same id, other tokens: other blocks
        r = req("r", tokens)
        assert kv.allocate_slots(r, 4)
        r.num_computed_tokens = 4
        kv.on_tokens_computed(r)  # two full computed blocks: the count the first life ended at, too
        kv.on_tokens_computed(r)  # nothing new
        assert all(kv.pool.lookup((r.block_hashes[i], g.group_id)) is not None
                   for i in range(2) for g in kv.layout.groups), life
        kv.free(r)


def test_a_decoding_request_drops_each_block_the_step_it_falls_out_of_reach_and_looks_only_then():
    from hybridkv.kv.managers import SingleTypeManager

    kv = manager([full(), sliding(5), chunked(8)], 2, 80, enable_prefix_caching=False)
    calls = []
    drop = SingleTypeManager.drop_out_of_reach

    def counted(m, rid, n):
        calls.append(n)
        drop(m, rid, n)

    SingleTypeManager.drop_out_of_reach = counted
    try:
        r = req("r", range(3))
        assert kv.allocate_slots(r, 3)
        for n in range(3, 60):  # a prefill of 3, then one decode step at a time
            r.num_computed_tokens = n
            kv.on_tokens_computed(r)
            for m in kv.managers:
                ids = table(kv, r, m.group.group_id)
                needed = m.spec.first_needed_token(n) // 2  # blocks below it are out of reach
                assert ids[:needed] == [0] * needed and 0 not in ids[needed:], (m.spec.kind, n)
            r.all_token_ids.append(n)
            assert kv.allocate_slots(r, 1)
    finally:
        SingleTypeManager.drop_out_of_reach = drop
    # the two local groups were looked at only at the steps where one of them had a block to drop (and at the first)
    local = [m.spec for m in kv.managers if not m.spec.keeps_every_token]
    due = [n for n in range(4, 60) if any(s.first_needed_token(n) // 2 > s.first_needed_token(n - 1) // 2
                                          for s in local)]
    assert calls == [n for n in [0, 3, *due] for _ in local] and len(due) < 57 * 2 // 3  # 0: before any table
    kv.free(r)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
