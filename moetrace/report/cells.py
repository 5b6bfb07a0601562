"""The cells of the terminal's tables: figures with the marks of their sources (and of synthetic acceptance, which
the dashboard marks alike), sizes in bytes, and tables whose short headers a legend under them explains."""

from __future__ import annotations

from typing import Any

from rich import box
from rich.table import Table

from moetrace.analysis.sources import MARKS, Source

# beside an acceptance figure whose drafts vLLM kept at set rates (synthetic rejection sampling): no drafter's; the
# terminal and the dashboard both mark such figures with it
SYNTHETIC_MARK = "§"
SYNTHETIC_LEGEND = f"{SYNTHETIC_MARK} acceptance set by vLLM's synthetic rejection sampling, no drafter's"


def marked(value: str, source: str | None) -> str:
    """A figure with the mark of its source (``analysis.sources.MARKS``; measured has none)."""
    return value + (MARKS[Source(source)] if source else "")


MARK_LEGEND = "marks: " + ", ".join(f"{mark} {source.value}" for source, mark in MARKS.items() if mark)


def with_synthetic_mark(value: str, synthetic: bool) -> str:
    """An acceptance figure, marked where the drafts were kept at set rates."""
    return value + (SYNTHETIC_MARK if synthetic else "")


def any_synthetic(run: dict[str, Any]) -> bool:
    """Whether some recorded k of ``run`` had its acceptance set (``acceptance_set_by``)."""
    return any(row["set_by"] == "synthetic" for row in run["acceptance_set_by"])


def number(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def byte_size(value: Any) -> str:
    if value is None:
        return "–"
    size = float(value)
    for unit in ("B", "kB", "MB", "GB"):
        if abs(size) < 1000:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


def titled_table(title: str, columns: list[tuple[str, str]]) -> Table:
    """Short headers that fit 80 columns, each explained in a legend under the table where it needs it; no vertical
    rules (a dozen columns of numbers then fit 80 characters); a cell that still does not fit wraps (never "…")."""
    legend = "; ".join(f"{header}: {meaning}" for header, meaning in columns if meaning)
    table = Table(title=title, title_justify="left", caption=legend or None, caption_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True, pad_edge=False)
    for header, _ in columns:
        table.add_column(header, justify="right", overflow="fold")
    return table
