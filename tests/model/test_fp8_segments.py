"""How an FP8 long prefill's key range is cut into segments widened to bf16 one at a time (pure numpy, no GPU)."""

import numpy as np
import pytest

from hybridkv.kv import plan_layout
from hybridkv.kv.specs import FullAttentionSpec
from hybridkv.model.attention.base import StepSequence
from hybridkv.model.attention.fp8_segments import plan_segments, segment_tokens


def test_the_docstring_example():
    segments, scratch = plan_segments([2], [14], np.array([[7, 3, 9, 4]]), block_size=4, seg_tokens=8)
    assert [(lo, hi, blocks.tolist()) for lo, hi, blocks in segments] == [(0, 8, [7, 3]), (8, 16, [9, 4])]
    assert scratch.tolist() == [[0, 1, 0, 1]]


def test_sequences_share_a_segment_and_dropped_blocks_are_never_gathered():
    # seq 0 sees keys 0..19 (blocks 0..4); seq 1's chunk starts at key 8 (blocks 0, 1 dropped: null = 0)
    table = np.array([[11, 12, 13, 14, 15], [0, 0, 21, 22, 0]])
    segments, scratch = plan_segments([0, 8], [20, 15], table, block_size=4, seg_tokens=8)
    assert [(lo, hi, blocks.tolist()) for lo, hi, blocks in segments] == [
        (0, 8, [11, 12]),
        (8, 16, [13, 14, 21, 22]),  # seq 0's rows first, then seq 1's
        (16, 24, [15]),
    ]
    assert scratch[0].tolist() == [0, 1, 0, 1, 0]
    assert scratch[1, 2:4].tolist() == [2, 3]


def test_a_segment_no_sequence_reaches_is_skipped():
    # a sliding sequence sees only keys 16..23: segments [0, 8) and [8, 16) hold nothing it reads
    table = np.array([[0, 0, 0, 0, 5, 6]])
    segments, scratch = plan_segments([16], [24], table, block_size=4, seg_tokens=8)
    assert [(lo, hi, blocks.tolist()) for lo, hi, blocks in segments] == [(16, 24, [5, 6])]
    assert scratch[0, 4:].tolist() == [0, 1]


def test_segment_length_keeps_the_whole_scratch_within_budget():
    assert segment_tokens([1_000_000, 4096, 4096], 1_000_000, 64) == (1_000_000 - 8192) // 64 * 64
    # one sequence: the budget, in whole key tiles
    assert segment_tokens([3_000_000], 1 << 20, 64) == 1 << 20
    # a reach shorter than the budget: one segment covers it
    assert segment_tokens([5000], 1 << 20, 64) == 5056
    # four equal long reaches share the budget
    assert segment_tokens([1 << 20] * 4, 1 << 20, 64) == 1 << 18
    # never below one key tile, even with many sequences
    assert segment_tokens([1 << 20] * 100_000, 1 << 20, 64) == 64
    for reaches in ([1_000_000, 4096, 4096], [1 << 20] * 4, [70_000, 300_000, 9_000]):
        s = segment_tokens(reaches, 1 << 19, 64)
        assert sum(min(s, r) for r in reaches) <= 1 << 19


def test_a_segment_holds_v_transposed_at_one_byte_a_value_or_k_and_v_widened_at_four():
    # planning only, no kernel runs: 600 new tokens over 16,000 cached, 64-token pages, 640,000 bytes a segment
    pytest.importorskip("triton")
    from hybridkv.model.attention.kernel_configs import KernelOptions
    from hybridkv.model.attention.triton_paged import TritonPagedAttention

    def segments(fp8_compute: bool) -> list[tuple[int, int]]:
        tri = TritonPagedAttention(plan_layout([FullAttentionSpec(1, 128, "fp8_e4m3")], 64), 300, "fp8_e4m3", 5,
                                   "cpu", options=KernelOptions(fp8_compute=fp8_compute, segment_bytes=640_000))
        tri.begin_step([StepSequence(16_000, 600, [np.arange(1, 300, dtype=np.int32)])])
        return [(s.lo, s.hi) for s in tri.step_state.groups[0].segments]

    # FP8 compute: V^T alone, 128 bytes a key -> 5,000 keys, less a page at each end, in whole tiles: 4,864
    assert segments(True) == [(0, 4864), (4864, 9728), (9728, 14592), (14592, 19456)]
    # widened to bf16: K and V, 512 bytes a key -> 1,250 keys, less the two pages: 1,088
    widened = segments(False)
    assert len(widened) == 16 and widened[:2] == [(0, 1088), (1088, 2176)]
