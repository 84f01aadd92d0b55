"""The GPU memory the engine keeps out of the KV cache for one step (pure arithmetic; no GPU needed)."""

from hybridkv.engine.llm_engine import EngineConfig, step_reserve_bytes
from hybridkv.model.attention.triton_paged import SEGMENT_BYTES


def test_the_docstring_example():
    config = EngineConfig(max_num_batched_tokens=8192, max_num_seqs=256)
    assert step_reserve_bytes(config, hidden_size=2048, vocab_size=49152) == (1 << 30) + (1 << 30) + (144 << 20)


def test_an_fp8_cache_on_the_kernels_keeps_room_for_a_long_prefills_segments():
    base = step_reserve_bytes(EngineConfig(), 2048, 49152)
    fp8 = step_reserve_bytes(EngineConfig(kv_cache_dtype="fp8_e4m3"), 2048, 49152)
    assert fp8 - base == SEGMENT_BYTES * 3 // 2 == 768 << 20
    # the torch reference backend widens the keys each sequence sees as it gathers them: no segments
    torch_fp8 = step_reserve_bytes(EngineConfig(kv_cache_dtype="fp8_e4m3", attention_backend="torch"), 2048, 49152)
    assert torch_fp8 == base


def test_the_reserve_grows_with_the_step_budget():
    small = step_reserve_bytes(EngineConfig(max_num_batched_tokens=2048, max_num_seqs=8), 4096, 32000)
    large = step_reserve_bytes(EngineConfig(max_num_batched_tokens=16384, max_num_seqs=8), 4096, 32000)
    assert large - small == (16384 - 2048) * 4096 * 4 * 16


def test_the_engine_and_the_planner_share_one_formula():
    from hybridkv.kv.capacity import step_reserve_bytes as formula

    # the formula's docstring example, then the engine's reserve for an FP8 cache on the kernels
    assert formula(8192, 256, 2048, 49152) == (1 << 30) + (1 << 30) + (144 << 20)
    assert formula(8192, 256, 2048, 49152, segment_bytes=512 << 20) - formula(8192, 256, 2048, 49152) == 768 << 20
    config = EngineConfig(kv_cache_dtype="fp8_e4m3", max_num_seqs=32, max_num_batched_tokens=4096)
    assert step_reserve_bytes(config, 1024, 32000) == formula(4096, 32, 1024, 32000, SEGMENT_BYTES)
