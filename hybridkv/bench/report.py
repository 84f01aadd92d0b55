"""The result table (laid out like vLLM's ``bench serve``), the JSON result file and the plot."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from hybridkv.bench.client import RequestResult
from hybridkv.bench.metrics import BenchMetrics, Stats, token_timeline, tpot_s

_WIDTH = 50
_LABEL = 40

_LATENCIES = (
    ("ttft_ms", "TTFT", "Time to First Token"),
    ("tpot_ms", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl_ms", "ITL", "Inter-token Latency"),
    ("e2el_ms", "E2EL", "End-to-end Latency"),
)


def _row(label: str, value: Any) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<{_LABEL}}{value:>{_WIDTH - _LABEL}}"


def _header(title: str, fill: str) -> str:
    return f" {title} ".center(_WIDTH, fill) if title else fill * _WIDTH


def format_table(m: BenchMetrics, config: dict[str, Any]) -> str:
    lines = [
        _header("Serving Benchmark Result", "="),
        _row("Successful requests:", m.completed),
        _row("Failed requests:", m.failed),
        _row("Maximum request concurrency:", config.get("max_concurrency") or "unlimited"),
        _row("Request rate (req/s):", str(config.get("request_rate"))),
        _row("Benchmark duration (s):", m.duration_s),
        _row("Total input tokens:", m.total_input_tokens),
        *([_row("Server-counted input tokens:", m.server_input_tokens)]
          if m.server_input_tokens not in (None, m.total_input_tokens) else []),
        _row("Total generated tokens:", m.total_output_tokens),
        _row("Request throughput (req/s):", m.request_throughput),
        _row("Input token throughput (tok/s):", m.input_throughput),
        _row("Output token throughput (tok/s):", m.output_throughput),
        _row("Peak output token throughput (tok/s):", m.peak_output_throughput),
        _row("Peak concurrent requests:", m.max_concurrent_requests),
        _row("Total token throughput (tok/s):", m.total_token_throughput),
    ]
    for key, short, title in _LATENCIES:
        stats: Stats = getattr(m, key)
        lines += [
            _header(title, "-"),
            _row(f"Mean {short} (ms):", stats.mean),
            _row(f"Median {short} (ms):", stats.median),
            _row(f"P99 {short} (ms):", stats.p99),
        ]
    lines.append(_header("", "="))
    lines += [f"error: {e}" for e in m.errors]
    return "\n".join(lines)


def request_record(r: RequestResult) -> dict[str, Any]:
    record = asdict(r)
    record.pop("generated_text")
    record["output_chars"] = len(r.generated_text)
    record["itl_s"] = r.itl_s
    record["tpot_s"] = tpot_s(r)
    return record


def result_dict(m: BenchMetrics, config: dict, dataset: dict, results: list[RequestResult]) -> dict:
    return {
        "config": config,
        "dataset": dataset,
        "metrics": m.to_dict(),
        "requests": [request_record(r) for r in results],
    }


def write_json(path: str | Path, result: dict) -> None:
    Path(path).write_text(json.dumps(result, indent=2, default=_jsonable) + "\n", encoding="utf-8")


def _jsonable(value: Any) -> Any:
    if isinstance(value, (np.integer, np.floating)):
        return value.item()
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def write_plot(path: str | Path, results: list[RequestResult], m: BenchMetrics, title: str = "") -> None:
    """Histograms of TTFT, TPOT and ITL, and output tokens/s per second over the run (Agg, no pyplot)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in results if r.success]
    series = (
        ("TTFT (ms)", [r.ttft_s * 1000 for r in ok], m.ttft_ms),
        ("TPOT (ms)", [t * 1000 for r in ok if (t := tpot_s(r)) is not None], m.tpot_ms),
        ("ITL (ms)", [gap * 1000 for r in ok for gap in r.itl_s], m.itl_ms),
    )
    fig = Figure(figsize=(12, 8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).ravel()
    for ax, (label, values, stats) in zip(axes, series):
        _histogram(ax, label, values, stats)
    _timeline(axes[3], ok)
    fig.suptitle(title or "hybridkv bench serve")
    fig.savefig(path, format="png", dpi=100)


def _histogram(ax, label: str, values: list[float], stats: Stats) -> None:
    if values:
        top, above = histogram_top(values)
        shown = [v for v in values if v <= top]
        ax.hist(shown, bins=min(50, max(5, len(shown) // 2)), color="tab:blue", alpha=0.8)
        for value, name, style in ((stats.median, "median", "-"), (stats.p99, "p99", "--")):
            if value <= top:
                ax.axvline(value, color="tab:red", linestyle=style, label=f"{name} {value:.2f}")
        ax.legend(title=None if not above else f"{above} above {top:.2f} not shown (max {max(values):.2f})")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(label)
    ax.set_ylabel("count")
    ax.set_title(f"{label.split()[0]} distribution (n={len(values)})")


def histogram_top(values: list[float], q: float = 99.5, spread: float = 2.0) -> tuple[float, int]:
    """Where a histogram's axis ends, and how many values lie past it: at the ``q``-th percentile when the largest
    value is more than ``spread`` times that (one stall of seconds among 10 ms gaps would squash every bar into the
    first), else at the largest value::

        >>> histogram_top([10.0] * 999 + [5000.0])
        (10.0, 1)
        >>> histogram_top([10.0, 12.0, 15.0])
        (15.0, 0)
    """
    top, largest = float(np.percentile(values, q)), max(values)
    if largest <= spread * top:
        return float(largest), 0
    return top, sum(v > top for v in values)


def _timeline(ax, results: list[RequestResult]) -> None:
    """1 s buckets; a run shorter than 5 s gets 20 finer buckets, so it still shows a shape."""
    span = max((r.start_s + r.latency_s for r in results), default=0.0)
    bucket = 1.0 if span >= 5.0 else max(span / 20, 0.005)
    starts, rates = token_timeline(results, bucket)
    if rates.size:
        ax.bar(starts, rates, width=bucket, align="edge", color="tab:green", alpha=0.7)
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"output throughput over time ({bucket:.3g} s buckets)")
