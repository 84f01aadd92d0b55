"""`--plot` of benchmarks/gpu/attention.py and scout_rank.py, fed synthetic rows on the CPU: a PNG with the series
each panel should draw."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def plots():
    yield load("benchmarks/plots.py")
    del sys.modules["plots"]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_save_plot_draws_each_series_with_points_and_skips_empty_ones(plots, tmp_path):
    panels = [plots.Panel("a", "tokens", "TFLOP/s", [plots.Series("ours", [(8192, 490.0), (1 << 20, 632.0)]),
                                                     plots.Series("cuDNN", [(8192, 380.0)], "s--"),
                                                     plots.Series("never ran", [])], log_x=True),
              plots.Panel("b", "tokens", "%", [plots.Series("ours", [(1 << 20, 85.0)])])]
    path = tmp_path / "sub" / "plot.png"
    assert plots.save_plot(path, panels, "title") == [2, 1]
    width, height = png_size(path)
    assert width > height > 100  # two panels side by side


@pytest.mark.parametrize("x, label", [(0, "0"), (8192, "8K"), (131072, "128K"), (1 << 20, "1M"), (2845646, "2.85M"),
                                      (2_000_000, "2M"), (500, "500")])
def test_token_counts_are_labelled_as_people_say_them(plots, x, label):
    assert plots.tokens_label(x) == label


def test_attention_plot_has_prefill_peers_by_length_and_decode_share(tmp_path):
    attention = pytest.importorskip("triton") and load("benchmarks/gpu/attention.py")
    prefill = {False: [(8192, {"ours": 490.0, "SDPA cuDNN": 380.0, "SDPA flash": 197.0, "FlexAttention": 279.0,
                               "ours, FP8 compute": 600.0}),
                       (1 << 20, {"ours": 632.0, "SDPA cuDNN": 477.0, "SDPA flash": 304.0,
                                  "ours, FP8 compute": 916.0})],
               True: [(8192, {"ours": 490.0, "SDPA flash": 196.0})]}
    panels = attention.plot_panels(prefill, [(1 << 20, {"ours": 85.0, "SDPA flash": 30.0})])
    assert [p.title for p in panels] == ["prefill, full layers", "prefill, chunked(8192) layers",
                                        "decode, full layer (one query)"]
    full = {s.label: s.points for s in panels[0].series}
    assert full["FlexAttention"] == [(8192, 279.0)] and full["ours"] == [(8192, 490.0), (1 << 20, 632.0)]
    assert attention.save_plot(tmp_path / "attention.png", panels, "t") == [5, 2, 2]
    png_size(tmp_path / "attention.png")
    del sys.modules["attention"]


def test_scout_plot_has_the_step_fit_the_model_and_vllm_runs(tmp_path):
    scout = load("benchmarks/gpu/scout_rank.py")
    contexts = [0, 1 << 20, 4 << 20, 9_800_000]
    steps = {"bfloat16": (contexts, [0.2 + 0.85e-6 * c for c in contexts]),
             "fp8_compute": (contexts, [0.19 + 0.57e-6 * c for c in contexts])}
    panels = scout.plot_panels(steps, {"bfloat16": {1 << 20: 40.0}, "fp8_compute": {}})
    fit = {s.label: s.points for s in panels[0].series}
    assert fit["bfloat16, fit 200 ms + 850 ms per 1M"] == [(0, pytest.approx(0.2)),
                                                           (9_800_000, pytest.approx(0.2 + 0.85e-6 * 9_800_000))]
    model = {s.label: s.points for s in panels[1].series}
    # the model's cold 9,811,859-token prompt is the sum of its steps: ~599 steps at a mean context of ~4.9M
    n, seconds = model["bfloat16, step model"][-1]
    assert n == 9_811_859 and seconds == pytest.approx(scout.predicted_prefill(0.2, 0.85e-6, n), rel=1e-6)
    assert 2_400 < seconds < 2_700
    assert model["vLLM 8xH200 (bfloat16 KV)"] == [(2845646, 334.9), (4908091, 957.1)]  # cold runs only
    assert model["vLLM 8xH200 (fp8_e4m3 KV)"] == [(9811859, 2964.4)]
    assert scout.save_plot(tmp_path / "scout.png", panels, "t") == [4, 5]  # fp8_compute measured nothing
    png_size(tmp_path / "scout.png")
    del sys.modules["scout_rank"]
