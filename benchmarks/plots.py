"""Line plots of what a benchmark measured in its own run, for `--plot PATH` (a PNG).

matplotlib's Agg canvas is used directly, without pyplot, so plotting changes no global state and needs no display.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(slots=True)
class Series:
    label: str
    points: list[tuple[float, float]] = field(default_factory=list)  # (x, y); drawn in x order
    style: str = "o-"  # a matplotlib format string: "o" points alone, "s--" squares on a dashed line


@dataclass(slots=True)
class Panel:
    title: str
    xlabel: str
    ylabel: str
    series: list[Series]
    log_x: bool = False  # base 2, ticked at the measured x values


def tokens_label(x: float, _pos=None) -> str:
    """A token count as people say it: 8,192 -> 8K, 1,048,576 -> 1M, 2,845,646 -> 2.85M."""
    n = int(round(x))
    for unit, name in ((1 << 20, "M"), (1 << 10, "K")):
        if n >= unit and n % unit == 0:
            return f"{n // unit}{name}"
    for unit, name in ((10**6, "M"), (10**3, "K")):
        if n >= unit:
            return f"{n / unit:.3g}{name}"
    return str(n)


def save_plot(path: str | Path, panels: list[Panel], title: str) -> list[int]:
    """Draw ``panels`` side by side into a PNG at ``path``; return how many series each panel drew (a series without
    points is left out of the plot and its legend)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig = Figure(figsize=(5.5 * len(panels), 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    # one colour per label across the panels, so a peer looks the same in each
    colours = {label: f"C{i % 10}" for i, label in enumerate(dict.fromkeys(
        s.label for p in panels for s in p.series if s.points))}
    drawn = []
    for ax, panel in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        shown = [s for s in panel.series if s.points]
        for s in shown:
            xs, ys = zip(*sorted(s.points))
            ax.plot(xs, ys, s.style, label=s.label, color=colours[s.label])
        if panel.log_x and shown:
            ax.set_xscale("log", base=2)
            ax.set_xticks(sorted({x for s in shown for x, _ in s.points}))
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.xaxis.set_major_formatter(FuncFormatter(tokens_label))
        ax.set(title=panel.title, xlabel=panel.xlabel, ylabel=panel.ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        if shown:
            ax.legend(fontsize="small")
        drawn.append(len(shown))
    fig.suptitle(title)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    return drawn
