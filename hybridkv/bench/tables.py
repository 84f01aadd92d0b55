"""The one Markdown table every benchmark script prints (and docs/benchmarks.md records)."""

from __future__ import annotations

from typing import Sequence


def markdown_table(head: Sequence[object], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell.

    >>> print(markdown_table(["a", "bb"], [[1, 2]]))
    | a | bb |
    |---|----|
    | 1 | 2  |
    """
    cells = [[str(c) for c in r] for r in [head, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])
