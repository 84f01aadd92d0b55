"""The host-memory tier through the whole engine: multi-turn conversations under a device pool too small to keep
the previous turn, greedy output identical with the tier on and off, and the tier really serving the hits."""

from __future__ import annotations

import pytest
from tiny_models import random_prompts

from hybridkv import LLM, SamplingParams

TURNS = 4
REPLY = 6


def conversations(llm: LLM, num: int = 3) -> list[list[int]]:
    """``num`` conversations, their turns interleaved (A1 B1 C1 A2 B2 ...): each turn's prompt is the previous
    prompt, its greedy reply and a new user message; every output, in order. ``llm.lost_turns``: the later turns
    whose prefix hit fell short of the previous turn's computed blocks (evicted in between)."""
    histories = random_prompts([22, 19, 25][:num], seed=7)
    news = [random_prompts([5] * TURNS, seed=10 + c) for c in range(num)]
    params = SamplingParams(temperature=0, max_tokens=REPLY, ignore_eos=True)
    outputs = []
    llm.lost_turns = 0
    for turn in range(TURNS):
        for c in range(num):
            prompt = histories[c] + news[c][turn]
            result = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
            out = result.outputs[0].token_ids
            outputs.append(out)
            computed = len(histories[c]) - 1  # the previous reply's last token was sampled, never computed
            llm.lost_turns += turn > 0 and result.num_cached_tokens < computed // 4 * 4
            histories[c] = prompt + out
    return outputs


def pool_pages(path: str) -> tuple[int, int]:
    """(page bytes, pages): the longest turn (66 tokens) fits at its peak, the three conversations' histories do
    not, so each turn's allocation evicts what the other conversations' previous turns left in the pool."""
    probe = LLM(model=path, block_size=4, max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20).engine
    return probe.layout.page_bytes, probe.kv.peak_blocks(72) + 1  # + the null block


@pytest.mark.parametrize("name", ["llama4", "gemma3"])  # chunked (chunk 8) and sliding (window 8) layers
def test_greedy_output_is_the_same_with_the_tier_and_the_tier_serves_the_hits(tiny_model, name):
    path = str(tiny_model(name).path)
    page, pages = pool_pages(path)
    kw = dict(model=path, block_size=4, max_num_batched_tokens=16, kv_cache_memory_bytes=pages * page)
    off = LLM(**kw)
    on = LLM(**kw, kv_offload_bytes=4096 * page)
    assert conversations(on) == conversations(off)

    # without the tier at least every second later turn lost part of its history (in fact all do); with it none
    later = (TURNS - 1) * 3
    assert off.lost_turns >= later // 2 and on.lost_turns == 0, (off.lost_turns, on.lost_turns)
    kv_on, kv_off = on.engine.kv, off.engine.kv
    host = kv_on.host.stats
    assert kv_off.pool.num_evictions > 0 and kv_on.pool.num_evictions > 0
    assert host.hit_tokens > 0 and host.bytes_read > 0 and host.bytes_written > 0
    # the tier turned evictions into hits: fewer prompt tokens recomputed (its loads also change what the device
    # pool holds later, so the difference is not exactly what it served)
    assert kv_on.stats.query_tokens == kv_off.stats.query_tokens
    assert kv_on.stats.hit_tokens > kv_off.stats.hit_tokens
    assert host.hit_tokens <= kv_on.stats.hit_tokens
    for kv in (kv_on, kv_off):
        assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
        assert not kv.take_block_ops()  # every copy ran with the step it was recorded for


def test_a_full_host_tier_evicts_its_own_lru_and_output_is_unchanged(tiny_model):
    path = str(tiny_model("llama4").path)
    page, pages = pool_pages(path)
    kw = dict(model=path, block_size=4, max_num_batched_tokens=16, kv_cache_memory_bytes=pages * page)
    small = LLM(**kw, kv_offload_bytes=12 * page)
    assert conversations(small) == conversations(LLM(**kw))
    stats = small.engine.kv.host.stats
    assert stats.evictions > 0 and small.engine.kv.host.num_free_blocks == 0
    assert small.engine.kv.pool.num_free_blocks == small.engine.kv.pool.num_usable_blocks


def test_offload_size_is_checked(tiny_model):
    path = str(tiny_model("llama3").path)
    with pytest.raises(ValueError, match="holds no page"):
        LLM(model=path, block_size=4, kv_offload_bytes=10)
    with pytest.raises(ValueError, match="needs prefix caching"):
        LLM(model=path, block_size=4, kv_offload_bytes=1 << 20, enable_prefix_caching=False)
    with pytest.raises(ValueError, match=">= 0"):
        LLM(model=path, block_size=4, kv_offload_bytes=-1)


def test_tensor_parallel_ranks_copy_their_own_heads(tiny_model):
    """TP 2 (this process and a spawned worker, gloo): the step's copies reach the worker, which loads its own
    heads' pages; output equals one rank's without the tier."""
    path = str(tiny_model("llama4").path)
    page, pages = pool_pages(path)
    one = LLM(model=path, block_size=4, max_num_batched_tokens=16, kv_cache_memory_bytes=pages * page)
    # each rank holds 1 of the 2 KV heads: half the page, the same number of pages
    two = LLM(model=path, block_size=4, max_num_batched_tokens=16, kv_cache_memory_bytes=pages * page // 2,
              kv_offload_bytes=4096 * page // 2, tensor_parallel_size=2)
    try:
        assert two.engine.kv.pool.num_blocks == one.engine.kv.pool.num_blocks
        assert conversations(two) == conversations(one)
        assert two.engine.kv.host.stats.hit_tokens > 0
    finally:
        two.shutdown()
