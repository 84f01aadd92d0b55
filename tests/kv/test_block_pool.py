"""The shared block pool: allocation order, free queues, eviction order, touch, ref counts."""

import pytest

from hybridkv.kv import BlockPool


def ids(blocks):
    return [b.block_id for b in blocks]


def cached_free(pool, n, evict_first=False, start=0):
    """Take ``n`` blocks, publish them under distinct keys, free them in allocation order."""
    blocks = pool.get_new_blocks(n)
    for i, b in enumerate(blocks):
        pool.cache_block(b, (bytes([start + i]), 0))
    pool.free_blocks(blocks, evict_first=evict_first)
    return blocks


def test_allocation_order_and_null_block():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4 and pool.num_free_blocks == 4
    blocks = pool.get_new_blocks(4, group_id=2)
    assert ids(blocks) == [1, 2, 3, 4] and all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 0 and pool.usage() == 1.0 and pool.in_use_by_group == {2: 4}
    with pytest.raises(MemoryError):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block, *blocks])
    assert pool.null_block.ref_cnt == 1 and pool.num_free_blocks == 4 and pool.in_use_by_group == {2: 0}
    # freed uncached blocks are reused most recently freed first
    assert ids(pool.get_new_blocks(2)) == [4, 3]
    with pytest.raises(ValueError):
        BlockPool(1)


def test_double_free_raises():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free_blocks([b])


def test_eviction_only_when_no_uncached_block_is_left():
    pool = BlockPool(7)
    cached = cached_free(pool, 3)  # 1, 2, 3 cached and free; 4, 5, 6 uncached
    assert pool.num_free_blocks == 6 and pool.num_cached_blocks == 3
    assert ids(pool.get_new_blocks(3)) == [4, 5, 6]
    assert pool.num_evictions == 0 and pool.num_cached_blocks == 3
    got = pool.get_new_blocks(1)
    assert got == cached[:1] and got[0].hash_key is None and pool.num_evictions == 1
    assert pool.lookup((bytes([0]), 0)) is None and pool.lookup((bytes([1]), 0)) is cached[1]


def test_lru_order_and_evict_first_queue():
    pool = BlockPool(7)
    lru = pool.get_new_blocks(3)
    low = pool.get_new_blocks(3)
    for i, b in enumerate(lru + low):
        pool.cache_block(b, (bytes([i]), 0))
    # callers pass the tail first: the tail is evicted first
    pool.free_blocks(lru[::-1])
    pool.free_blocks(low[::-1], evict_first=True)
    assert ids(pool.get_new_blocks(6)) == [6, 5, 4, 3, 2, 1]
    assert pool.num_evictions == 6 and pool.num_cached_blocks == 0


def test_touch_removes_from_the_middle():
    pool = BlockPool(6)
    blocks = cached_free(pool, 5)  # LRU: 1 2 3 4 5
    pool.touch([pool.null_block, blocks[2]], group_id=1)
    assert blocks[2].ref_cnt == 1 and pool.num_free_blocks == 4 and pool.in_use_by_group[1] == 1
    pool.touch([blocks[2]], group_id=1)  # a second owner: only the ref count changes
    assert blocks[2].ref_cnt == 2 and pool.in_use_by_group[1] == 1
    assert ids(pool.get_new_blocks(4)) == [1, 2, 4, 5]
    pool.free_blocks([blocks[2]])
    assert pool.num_free_blocks == 0
    pool.free_blocks([blocks[2]])
    assert pool.num_free_blocks == 1 and pool.lookup((bytes([2]), 0)) is blocks[2]


def test_touch_from_evict_first_queue():
    pool = BlockPool(4)
    a, b, c = cached_free(pool, 3, evict_first=True)
    pool.touch([b])
    pool.free_blocks([b])  # back in the LRU queue now: evicted after a and c
    assert ids(pool.get_new_blocks(3)) == [1, 3, 2]


def test_cache_block_keeps_the_first_publisher():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, (b"x", 0))
    pool.cache_block(b, (b"x", 0))  # same content computed twice: b stays private
    pool.cache_block(a, (b"y", 0))  # a block is published once
    assert pool.lookup((b"x", 0)) is a and b.hash_key is None and pool.lookup((b"y", 0)) is None
    assert pool.lookup((b"x", 1)) is None  # keys include the group


def test_reset_prefix_cache():
    pool = BlockPool(4)
    cached_free(pool, 2)
    (held,) = pool.get_new_blocks(1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks([held])
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and pool.num_free_blocks == 3 and pool.lookup((bytes([0]), 0)) is None
    assert all(b.hash_key is None for b in pool.blocks)
    pool.get_new_blocks(3)
    assert pool.num_evictions == 0
