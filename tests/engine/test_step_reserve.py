"""The GPU memory the engine keeps out of the KV cache for one step (pure arithmetic; no GPU needed)."""

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.kv_sizing import step_reserve_bytes
from hybridkv.model.attention.fp8_segments import SEGMENT_BYTES


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


def test_tensor_parallel_ranks_keep_their_copy_engine_slots_up_to_four_ranks():
    """Two halves x two generations x (size - 1) peers x half a step of hidden rows, bf16: the slots the prefill
    halves' all-reduces are copied into, as the collective declares them (``CopyEngineSums.scratch_bytes``); none
    on one rank or beyond four, where NCCL sums."""
    from hybridkv.model.architectures.collectives import CopyEngineSums

    slots_of = CopyEngineSums.scratch_bytes
    base = step_reserve_bytes(EngineConfig(max_num_batched_tokens=16384), 5120, 202_048)
    for size, slots in ((2, 320 << 20), (4, 960 << 20), (8, 0)):
        config = EngineConfig(max_num_batched_tokens=16384, tensor_parallel_size=size)
        assert step_reserve_bytes(config, 5120, 202_048) - base == slots
        assert slots_of(size, 16384, 5120) == slots
    assert slots_of(2, 16383, 5120) == slots_of(2, 16384, 5120)  # half rounds up
