"""The scheduler over the real KV cache manager, with a stand-in for the model (next token = a function of the
sequence), so batching, chunked prefill, preemption and block accounting are tested on their own."""

from hybridkv.engine.scheduler import Scheduler
from hybridkv.engine.sequence import Sequence, SequenceStatus
from hybridkv.kv import KVCacheManager, plan_layout
from hybridkv.kv.specs import ChunkedLocalSpec, FullAttentionSpec, SlidingWindowSpec


def make(num_blocks, budget=8, max_num_seqs=8, block_size=4):
    specs = [SlidingWindowSpec(1, 4, "float32", window=6), FullAttentionSpec(1, 4, "float32"),
             ChunkedLocalSpec(1, 4, "float32", chunk=8)]
    kv = KVCacheManager(plan_layout(specs, block_size), num_blocks, max_step_tokens=budget)
    return kv, Scheduler(kv, max_num_seqs, budget)


def step(sched):
    """One step with the stand-in model. Generated token = 1000 + (length of sequence)."""
    out = sched.schedule()
    assert out.scheduled, "no progress: the scheduler is stuck"
    sched.on_step_done(out)
    for s in out.scheduled:
        if s.samples:
            s.seq.append_token(1000 + s.seq.num_tokens)
            if s.seq.num_output_tokens >= s.seq.max_tokens:
                sched.finish(s.seq)
    return out


def run(sched, seqs, max_steps=10_000):
    """Drive to completion; returns every step's output."""
    for s in seqs:
        sched.add(s)
    steps = []
    while sched.has_unfinished:
        steps.append(step(sched))
        assert len(steps) < max_steps
    return steps


def test_chunked_prefill_respects_budget_and_batches_decodes():
    kv, sched = make(num_blocks=200, budget=8)
    a = Sequence("a", list(range(3)), max_tokens=5, arrival=0)
    b = Sequence("b", list(range(100, 120)), max_tokens=3, arrival=1)
    steps = run(sched, [a, b])
    assert all(out.num_tokens <= 8 for out in steps)
    # step 1: a's whole prompt (3) + 5 of b's 20; b needs 3 more chunks of <= 7 next to a's decodes
    assert [(s.seq.request_id, s.num_new_tokens) for s in steps[0].scheduled] == [("a", 3), ("b", 5)]
    assert [(s.seq.request_id, s.num_new_tokens) for s in steps[1].scheduled] == [("a", 1), ("b", 7)]
    assert a.output_token_ids == [1003, 1004, 1005, 1006, 1007]
    assert b.output_token_ids == [1020, 1021, 1022]
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


def test_tight_pool_preempts_newest_and_everything_finishes_with_nothing_leaked():
    kv, sched = make(num_blocks=16, budget=8, block_size=4)
    seqs = [Sequence(f"r{i}", [i] * 10, max_tokens=12, arrival=i) for i in range(5)]
    for s in seqs:
        assert kv.can_ever_fit(s.max_total_tokens)
    run(sched, seqs)
    assert sched.num_preemptions > 0
    assert max(s.num_preemptions for s in seqs) >= 1 and seqs[0].num_preemptions == 0  # the oldest is never preempted
    for i, s in enumerate(seqs):
        assert s.output_token_ids == [1000 + 10 + k for k in range(12)]
        assert s.status == SequenceStatus.FINISHED
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    assert all(v == 0 for v in kv.pool.in_use_by_group.values())


def test_waiting_sequence_that_does_not_fit_waits_and_later_arrivals_do_not_overtake():
    kv, sched = make(num_blocks=40, budget=64, block_size=4)
    hog = Sequence("hog", list(range(30)), max_tokens=20, arrival=0)
    big = Sequence("big", list(range(50, 80)), max_tokens=4, arrival=1)
    small = Sequence("small", [7, 7], max_tokens=2, arrival=2)
    steps = run(sched, [hog, big, small])
    # hog takes 8 blocks in each of 3 groups; big's 24 do not fit next to it, and small must not jump the queue
    assert [s.seq.request_id for s in steps[0].scheduled] == ["hog"]
    order = [s.seq.request_id for out in steps for s in out.scheduled if s.context_len == 0]
    assert order.index("big") < order.index("small")
    assert {s.status for s in (hog, big, small)} == {SequenceStatus.FINISHED}
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


def test_a_sequence_larger_than_the_pool_is_known_never_to_fit():
    kv, _ = make(num_blocks=12, budget=64, block_size=4)
    # 34 tokens, block 4: 9 blocks in each of 3 groups = 27 > 11 usable; the engine refuses it on arrival
    assert kv.peak_blocks(34) == 27 and not kv.can_ever_fit(34)
    assert kv.max_tokens_that_fit(10_000) == 12  # 3 blocks per group


def test_second_request_with_same_prompt_is_served_from_prefix_cache():
    kv, sched = make(num_blocks=100, budget=64)
    first = Sequence("x", list(range(40)), max_tokens=2, arrival=0)
    run(sched, [first])
    again = Sequence("y", list(range(40)), max_tokens=2, arrival=1)
    steps = run(sched, [again])
    # 40 tokens, block 4: at most 39 may come from the cache; the sliding (6) and chunked (8) groups accept 36
    assert again.num_cached_prompt_tokens == 36
    assert steps[0].scheduled[0].num_new_tokens == 4
    assert again.output_token_ids == first.output_token_ids
    # a lookup counts in the metrics once per admission, not once per scheduling attempt
    assert kv.stats.queries == 2 and kv.stats.hit_tokens == 36


def test_a_waiting_request_is_counted_once_in_prefix_cache_metrics():
    kv, sched = make(num_blocks=40, budget=64, block_size=4)
    hog = Sequence("hog", list(range(30)), max_tokens=20, arrival=0)
    big = Sequence("big", list(range(50, 80)), max_tokens=4, arrival=1)
    steps = run(sched, [hog, big])
    first_big = next(i for i, out in enumerate(steps) if any(s.seq is big for s in out.scheduled))
    assert first_big >= 1  # big was looked up and refused at least once before it got in
    assert kv.stats.queries == 2


def test_a_prompt_is_admitted_only_when_all_of_it_fits():
    """As vLLM's scheduler asks (``full_sequence_must_fit``): a waiting prompt whose first chunk fits but whose
    whole prefill does not is refused, with nothing held, instead of growing chunk by chunk until it preempts
    others or itself. Full attention needs every block of the prompt; sliding and chunked groups their peak."""
    kv, sched = make(num_blocks=40, budget=8)  # 39 usable; per group of 3: sliding(6), full, chunked(8)
    a = Sequence("a", list(range(48)), max_tokens=1, arrival=0)
    hit = kv.find_cache_hit(a)
    # full 12 blocks; sliding and chunked their peak, 4 each (window 6 or chunk 8, plus a step of 8)
    assert kv.blocks_for_all_tokens(a, hit) == 12 + 4 + 4
    assert kv.allocate_slots(a, 48, hit, full_sequence_must_fit=True)
    a.num_computed_tokens = 48
    kv.on_tokens_computed(a)
    free = kv.pool.num_free_blocks
    b = Sequence("b", list(range(100, 172)), max_tokens=1, arrival=1)  # 18 + 4 + 4 blocks
    hit = kv.find_cache_hit(b)
    assert kv.blocks_for_all_tokens(b, hit) == 26 > free == 39 - 12 - 2  # a keeps its window, no chunk
    assert not kv.allocate_slots(b, 8, hit, full_sequence_must_fit=True)
    assert not kv.has_blocks("b") and kv.pool.num_free_blocks == free
    assert kv.allocate_slots(b, 8, hit)  # without the check its first chunk fits
    kv.free(b)
    kv.free(a)
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks


def test_the_scheduler_keeps_a_prompt_waiting_until_all_of_it_fits():
    """b's first chunk would fit beside a, its whole prefill would not: b waits for a instead of being admitted
    and then preempting a (or itself) half-way."""
    kv, sched = make(num_blocks=40, budget=8)
    a = Sequence("a", list(range(48)), max_tokens=20, arrival=0)
    sched.add(a)
    while a.num_output_tokens == 0:
        step(sched)
    b = Sequence("b", list(range(100, 172)), max_tokens=1, arrival=1)
    sched.add(b)
    out = step(sched)
    assert [s.seq.request_id for s in out.scheduled] == ["a"] and b.status == SequenceStatus.WAITING
    assert kv.blocks_needed(b, 7, kv.find_cache_hit(b)) <= kv.pool.num_free_blocks  # its first chunk would fit
    while sched.has_unfinished:
        step(sched)
    assert sched.num_preemptions == 0 and b.output_token_ids == [1072]
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
