"""The trace replay behind benchmarks/prefix_trace.py: it must run a trace to the end and leave the pool whole."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "prefix_trace.py"


@pytest.fixture(scope="module")
def trace_module():
    spec = importlib.util.spec_from_file_location("prefix_trace", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_replay_of_a_small_trace_hits_shared_prefixes_and_frees_everything(trace_module):
    pt = trace_module
    shape = pt.TraceShape(system_prompts=2, system_len=(600, 700), conversations=6, turns=(2, 3), user_len=(20, 40),
                          reply_len=(10, 30), documents=1, document_len=(3000, 3000), questions=(3, 3))
    trace = pt.make_trace(shape, seed=1)
    assert len(trace) == sum(1 for r in trace if r.rid.startswith("c")) + 3
    turns = {r.rid: r for r in trace}
    for r in trace:  # a later turn's prompt extends the earlier turn's prompt and reply
        if r.after is not None:
            prev = turns[r.after]
            assert r.prompt[: len(prev.prompt) + len(prev.output)] == prev.prompt + prev.output
    unique = pt.unique_tokens(trace)
    layout = pt.layouts()["sliding (Gemma-3 15:3)"]
    for share in (1.1, 0.3):
        cache = pt.HybridKV(layout, pt.pool_blocks(layout, trace, unique, share, 512), 512)
        res = pt.replay(cache, trace, max_running=4, budget=512)
        assert set(res.per_request_hits) == set(turns)
        assert 0 < res.hit_tokens < res.prompt_tokens == sum(len(r.prompt) for r in trace)
        assert cache.kv.pool.num_free_blocks == cache.kv.pool.num_usable_blocks
        if share < 1:
            continue
        # roomy: every question after the first hits the whole document, every later turn all of the previous one
        for r in trace:
            if r.rid.startswith("d") and not r.rid.endswith("q0"):
                assert res.per_request_hits[r.rid] == 3000 // 16 * 16
            if r.after is not None:
                prev = turns[r.after]
                assert res.per_request_hits[r.rid] == (len(prev.prompt) + len(prev.output) - 1) // 16 * 16


# benchmarks/prefix_tiers.py: a host tier turns a too-small device pool's misses into hits
@pytest.mark.parametrize("name", ["sliding (Gemma-3 15:3)", "chunked (Scout TP-8 rank)"])
def test_a_host_tier_recovers_the_hits_a_small_device_pool_loses(trace_module, name):
    pt = trace_module
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
