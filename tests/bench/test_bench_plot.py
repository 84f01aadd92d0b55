"""The bench plot: a title that says what the run was, and histograms that one outlier does not squash."""

from __future__ import annotations

from hybridkv.bench.report import histogram_top
from hybridkv.commands.bench import plot_title


def test_the_title_names_the_concurrency_and_the_rate():
    config = {"model": "m", "endpoint": "/v1/chat/completions", "input_len": 512, "output_len": 128,
              "num_prompts": 64, "max_concurrency": 16, "request_rate": "inf"}
    assert plot_title(config) == "m /v1/chat/completions in=512 out=128 prompts=64 concurrency=16 rate=inf"
    assert "concurrency=unlimited rate=4.0" in plot_title({**config, "max_concurrency": None, "request_rate": 4.0})


def test_one_outlier_is_left_off_the_axis_and_counted():
    gaps = [10.0 + i % 7 for i in range(2000)] + [4000.0]  # one 4 s stall among 10-16 ms gaps
    top, above = histogram_top(gaps)
    assert top == 16.0 and above == 1
    assert histogram_top([10.0, 12.0, 15.0, 25.0]) == (25.0, 0)  # no outlier: the whole range
