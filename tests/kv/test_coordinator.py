"""The coordinator the cache manager picks for each case, and the one-group lookup against the general fixed point."""

import random

import pytest

from kvutil import chunked, evict, full, manager, req, run, sliding

from hybridkv.kv.branch_points import BranchPoints, NoBranchPoints
from hybridkv.kv.coordinator import HybridCoordinator, NoPrefixCacheCoordinator, UnitaryCoordinator
from hybridkv.kv.tiers import DeviceAndHost, DeviceOnly


@pytest.mark.parametrize(
    "specs, kw, case, retention, tiers",
    [
        ([full(), sliding(4)], {"enable_prefix_caching": False, "host_blocks": 8}, NoPrefixCacheCoordinator,
         NoBranchPoints, DeviceOnly),
        ([full()], {}, UnitaryCoordinator, NoBranchPoints, DeviceOnly),
        ([sliding(4)], {"host_blocks": 8}, UnitaryCoordinator, BranchPoints, DeviceAndHost),
        ([full(), full(2)], {}, HybridCoordinator, NoBranchPoints, DeviceOnly),
        ([full(), chunked(8)], {"host_blocks": 8}, HybridCoordinator, BranchPoints, DeviceAndHost),
    ],
    ids=["no-prefix-cache", "one-full-group", "one-sliding-group", "two-full-groups", "hybrid-host"],
)
def test_the_case_and_its_components_are_chosen_once(specs, kw, case, retention, tiers):
    kv = manager(specs, 2, 32, **kw)
    assert type(kv.coordinator) is case
    assert type(kv.coordinator.retention) is retention and type(kv.coordinator.tiers) is tiers
    assert (kv.host is not None) == (tiers is DeviceAndHost)


@pytest.mark.parametrize("spec", [sliding(3), sliding(6), chunked(4), full()], ids=["w3", "w6", "c4", "full"])
def test_one_groups_single_lookup_is_the_fixed_point(spec):
    """The one-group coordinator asks its group once; the hybrid fixed point (asking until no group lowers the
    length) gives the same hit, block for block, over caches with random holes."""
    rng = random.Random(7)
    lengths = set()
    for trial in range(20):
        kv = manager([spec], 2, 64, retention_interval=0)
        prompt = [rng.randrange(4) for _ in range(rng.randrange(4, 30))]
        first = req("a", prompt)
        run(kv, first, step=rng.choice([1, 3, 8]))
        kv.free(first)
        cached = [kv.pool.lookup((h, 0)) for h in first.block_hashes]
        for block in cached:
            if block is not None and block.ref_cnt == 0 and rng.random() < 0.3:
                evict(kv.pool, block)
        second = req("b", prompt + [9])
        hit = kv.find_cache_hit(second)
        general = HybridCoordinator._longest_hit(kv.coordinator, second, kv.pool.lookup)
        assert hit.num_tokens == general.num_tokens and hit.shared_blocks == general.shared_blocks, trial
        assert [b.block_id for b in hit.blocks[0]] == [b.block_id for b in general.blocks[0]], trial
        lengths.add((hit.num_tokens, len(prompt) // 2 * 2))
    assert len({n for n, _ in lengths}) > 3 and any(0 < n < whole for n, whole in lengths)  # holes cut hits short
