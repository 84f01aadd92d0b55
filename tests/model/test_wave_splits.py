"""How a long prefill's KV range is split so its tiles fill whole waves of SMs (pure arithmetic, no GPU)."""

from hybridkv.model.attention.triton_metadata import wave_splits


def test_scout_rank_steps_on_an_h200():
    # 16,384 tokens = 322 tiles: 3 waves on 132 SMs, the last 44% full; split in 2 -> 644 programs, 98% full
    assert wave_splits(322, 132) == 2
    # 32,768 tokens = 643 tiles already fill 5 waves 97%: no split
    assert wave_splits(643, 132) == 1


def test_exact_waves_are_not_split_and_the_smallest_good_split_wins():
    assert wave_splits(264, 132) == 1
    assert wave_splits(9, 4) == 4  # 75% -> 90% -> 100%
    assert wave_splits(133, 132) == 4  # 50% -> 67% -> 80%
