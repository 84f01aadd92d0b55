"""The replay behind benchmarks/prefix_tiers.py: a host tier turns a too-small device pool's misses into hits."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "prefix_trace.py"


@pytest.fixture(scope="module")
def pt():
    spec = importlib.util.spec_from_file_location("prefix_trace", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize("name", ["sliding (Gemma-3 15:3)", "chunked (Scout TP-8 rank)"])
def test_a_host_tier_recovers_the_hits_a_small_device_pool_loses(pt, name):
    shape = pt.TraceShape(system_prompts=2, system_len=(600, 700), conversations=16, turns=(3, 3), user_len=(20, 40),
                          reply_len=(10, 30), documents=2, document_len=(2000, 2000), questions=(3, 3))
    trace = pt.make_trace(shape, seed=1)
    unique = pt.unique_tokens(trace)
    layout = pt.layouts()[name]
    device = pt.pool_blocks(layout, trace, unique, 0.1, 512)
    off = pt.replay(pt.HybridKV(layout, device, 512), trace, 4, 512)
    cache = pt.HybridKV(layout, device, 512, host_blocks=int(1.1 * unique / pt.BLOCK * len(layout.groups)))
    on = pt.replay(cache, trace, 4, 512)
    assert off.hit_tokens < on.hit_tokens
    assert cache.kv.host.stats.hit_tokens > 0 and cache.kv.host.stats.bytes_read > 0
    assert cache.kv.pool.num_free_blocks == cache.kv.pool.num_usable_blocks
