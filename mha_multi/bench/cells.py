"""The cells of the benchmark's Markdown tables: times, ratios, rows, and a table with its rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Table", "ms", "ratio", "row", "table", "table_head"]


def ms(seconds: float | None) -> str:
    """Seconds as milliseconds, ``"-"`` for none."""
    if seconds is None:
        return "-"
    # Small calls take fractions of a millisecond: three significant digits.
    return f"{seconds * 1e3:.1f}" if seconds >= 0.01 else f"{seconds * 1e3:.3g}"


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as ``"0.80x"``, ``"-"`` where either is missing."""
    return "-" if not a or not b else f"{a / b:.2f}x"


def row(*cells: object) -> str:
    """A Markdown table's row of ``cells``."""
    return "| " + " | ".join(str(cell) for cell in cells) + " |"


def table_head(title: str, columns: Sequence[str]) -> list[str]:
    """The lines above a table's rows: its title, its column names, the separator."""
    return ["", title, "", row(*columns), "|" + "---|" * len(columns)]


@dataclass
class Table:
    """A table across backends: its Markdown lines and the measurements it shows."""

    lines: list[str]
    rows: list[dict]


def table(columns: Sequence[str], rows: Sequence[Sequence[object]], shown: list[dict]) -> Table:
    """The table of ``rows`` under ``columns``, showing the measurements ``shown``;
    no lines where there are no rows."""
    lines = [row(*columns), "|" + "---|" * len(columns), *(row(*cells) for cells in rows)]
    return Table(lines if rows else [], shown)
