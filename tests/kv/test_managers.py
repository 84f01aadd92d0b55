"""Per-type managers through the coordinator: freeing out of reach, block tables, admission."""

import pytest

from kvutil import SCOUT, chunked, full, group_of, manager, req, run, sliding, table

from hybridkv.kv import KVCacheManager, layer_specs_from_hf_config, plan_layout
from hybridkv.model.loading.hf_config import load_hf_config


def computed_table(kv, n_total, n_computed):
    r = req("r", range(n_total))
    assert kv.allocate_slots(r, n_total)
    r.num_computed_tokens = n_computed
    kv.on_tokens_computed(r)
    return table(kv, r)


@pytest.mark.parametrize(
    ("n", "freed"), [(4, 0), (5, 1), (6, 1), (7, 2), (10, 3), (11, 4)]
)
def test_sliding_window_4_block_2_frees(n, freed):
    kv = manager([sliding(4)], 2, 16, enable_prefix_caching=False)
    t = computed_table(kv, 12, n)
    assert t == [0] * freed + list(range(freed + 1, 7))
    assert kv.pool.num_free_blocks == 15 - 6 + freed


@pytest.mark.parametrize(("n", "freed"), [(3, 0), (4, 2), (7, 2), (8, 4), (12, 6)])
def test_chunked_4_block_2_frees(n, freed):
    kv = manager([chunked(4)], 2, 16, enable_prefix_caching=False)
    t = computed_table(kv, 14, n)
    assert t == [0] * freed + list(range(freed + 1, 8))
    assert kv.pool.num_free_blocks == 15 - 7 + freed


def test_chunk_boundary_inside_a_block():
    # chunk 8, block 16: after 8 tokens block 0 still takes tokens 8..15; after 16 it goes.
    kv = manager([chunked(8)], 16, 8, enable_prefix_caching=False)
    assert computed_table(kv, 40, 8) == [1, 2, 3]
    kv = manager([chunked(8)], 16, 8, enable_prefix_caching=False)
    assert computed_table(kv, 40, 16) == [0, 2, 3]
    kv = manager([chunked(24)], 16, 8, enable_prefix_caching=False)
    assert computed_table(kv, 80, 47) == [0, 2, 3, 4, 5]  # first needed token 24 is in block 1
    kv = manager([chunked(24)], 16, 8, enable_prefix_caching=False)
    assert computed_table(kv, 80, 48) == [0, 0, 0, 4, 5]


def test_full_attention_never_frees_and_decode_grows_one_block_at_a_time():
    kv = manager([full(), sliding(4)], 2, 32, enable_prefix_caching=False)
    fg, sg = group_of(kv, "full"), group_of(kv, "sliding")
    r = req("r", range(5))
    run(kv, r)
    for _ in range(6):  # decode 6 tokens
        r.all_token_ids.append(7)
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        kv.on_tokens_computed(r)
    assert len(table(kv, r, fg)) == 6 and 0 not in table(kv, r, fg)
    st = table(kv, r, sg)
    assert st[:4] == [0] * 4 and 0 not in st[4:] and len(st) == 6  # 11 computed -> first needed block 4
    assert kv.blocks_in_use_by_kind() == {"full": 6, "sliding": 2}
    assert kv.usage_by_kind() == pytest.approx({"full": 6 / 31, "sliding": 2 / 31})
    kv.free(r)
    assert kv.pool.num_free_blocks == 31 and not kv.has_blocks("r")
    assert kv.blocks_in_use_by_kind() == {"full": 0, "sliding": 0}


def test_block_tables_per_group_are_views():
    kv = manager([full(), chunked(4), full(), chunked(4)], 2, 16)
    r = req("r", range(5))
    assert kv.allocate_slots(r, 5)
    tabs = kv.block_tables("r")
    # same-spec layers share a group: 2 groups of 2 layers, one table each
    assert len(tabs) == 2 and [len(g.layer_ids) for g in kv.layout.groups] == [2, 2]
    assert sorted(b for t in tabs for b in t.tolist()) == list(range(1, 7))
    assert tabs[0].base is not None  # a view of the table's buffer
    assert kv.allocate_slots(r, 0)  # nothing new: still fine
    assert kv.pool.num_free_blocks == 9


# ---- admission -------------------------------------------------------------------------------------
def scout_manager(num_blocks):
    layout = plan_layout(layer_specs_from_hf_config(load_hf_config(SCOUT), 8), 16)
    return KVCacheManager(layout, num_blocks, max_step_tokens=8192)


def test_scout_peak_blocks_and_can_ever_fit():
    kv = scout_manager(11265)  # 11,264 usable
    assert kv.peak_blocks(1) == 4
    assert kv.peak_blocks(8192) == 512 * 4
    assert kv.peak_blocks(131072) == 8192 + 3 * 1024  # chunked groups hold a chunk + a step at most
    assert kv.peak_blocks(10_000_000) == 625_000 + 3 * 1024
    assert kv.can_ever_fit(131072) and not kv.can_ever_fit(131073)
    assert kv.max_tokens_that_fit(10**7) == 131072
    assert kv.max_tokens_that_fit(1000) == 1000


def test_allocate_slots_false_leaves_state_unchanged():
    kv = manager([full(), sliding(4)], 2, 9)  # 8 usable
    a = req("a", range(7))
    run(kv, a)
    kv.free(a)  # full 1-4, sliding 5-8; blocks 1-3 and 5-7 stay cached
    free, cached = kv.pool.num_free_blocks, kv.pool.num_cached_blocks
    assert (free, cached) == (8, 6)
    b = req("b", list(range(7)) + [9] * 6)
    hit = kv.find_cache_hit(b)
    assert hit.num_tokens == 6
    # 7 new tokens: full 4 new + 3 revived, sliding 4 new + 2 revived (block 0 is not needed) = 13 > 8
    assert kv.blocks_needed(b, 7, hit) == 13
    before = [(blk.ref_cnt, blk.free_list) for blk in kv.pool.blocks]
    assert kv.blocks_needed(b, 7, hit) > free
    assert not kv.allocate_slots(b, 7, hit)
    assert [(blk.ref_cnt, blk.free_list) for blk in kv.pool.blocks] == before
    assert kv.pool.num_free_blocks == free and kv.pool.num_cached_blocks == cached
    assert not kv.has_blocks("b") and sum(kv.pool.in_use_by_group.values()) == 0
    # a smaller step fits, and reuses the hit
    assert kv.allocate_slots(b, 1, hit)
    assert table(kv, b, group_of(kv, "full"))[:3] == [1, 2, 3]
    assert table(kv, b, group_of(kv, "sliding"))[:3] == [0, 6, 7]
    assert kv.pool.num_free_blocks == 1  # 5 revived + one new block per group


def test_allocate_slots_false_for_a_running_request():
    kv = manager([full()], 4, 4, enable_prefix_caching=False)  # 3 usable
    r = req("r", range(8))
    assert kv.allocate_slots(r, 8)
    r.num_computed_tokens = 8
    kv.on_tokens_computed(r)
    assert not kv.allocate_slots(r, 5)  # needs 2 more, 1 free
    assert table(kv, r) == [1, 2] and kv.pool.num_free_blocks == 1
    assert kv.allocate_slots(r, 4)
    assert table(kv, r) == [1, 2, 3]


@pytest.mark.parametrize("spec", [sliding(8), chunked(12), full()], ids=["sliding", "chunked", "full"])
def test_retained_over_an_array_of_blocks_is_the_scalar_rule_elementwise(spec):
    """``release`` asks which of a request's blocks are retained for all of them at once (31,250 blocks for 2M
    tokens of 64): the array form gives what the scalar form gives block by block, with a request end, branch
    ranges and periodic retention (every 32 tokens here) all in play."""
    import numpy as np

    kv = manager([full(), spec], 4, 64, retention_interval=32)
    m = next(m for m in kv.managers if m.spec is spec or m.spec == spec)
    index, kept = np.arange(60), []
    for end_block, ranges in [(None, ()), (17, ()), (40, ((3, 6), (20, 22))), (59, ((0, 1),))]:
        got = m._retained(index, end_block, ranges)
        assert got.dtype == bool and got.tolist() == [bool(m._retained(i, end_block, ranges)) for i in range(60)]
        kept.append(int(got.sum()))
    if spec.kind != "full":  # the cases retain different blocks, never all: the rule is exercised
        assert len(set(kept)) > 2 and max(kept) < 60
