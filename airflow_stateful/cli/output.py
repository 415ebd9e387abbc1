"""Tables for people, JSON for scripts: every command builds rows once and prints them either way.

Rows may come from a generator (``ls`` and ``du`` print each identity as soon as its head is read), so both
forms are written as the rows come: JSON one row at a time, tables a page of rows at a time.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Collection, Iterable, Sequence
from datetime import timedelta
from typing import Any, TextIO

TABLE_PAGE = 100
"""Rows a streamed table holds back to size its columns: the first rows show after this many heads."""


def emit(
    rows: Iterable[dict[str, Any]],
    columns: Sequence[str],
    *,
    as_json: bool,
    out: TextIO | None = None,
    page: int | None = None,
    sizes: Collection[str] = (),
    exact: bool = False,
) -> int:
    """Print ``rows`` and return how many there were.

    JSON: one array, written a row at a time (the text ``json.dump(rows, indent=2)`` writes), valid once the
    last row is out; if the rows fail part-way the array is left open, so a script cannot take a partial
    answer for a whole one.

    Table: written ``page`` rows at a time (``None``: all rows as one page). A column is as wide as its widest
    cell so far: the rows of a page align, and a wider cell in a later page widens its column from there on.
    A row with an ``error`` shows its first cell, then the error across the other columns. The ``sizes``
    columns (byte counts) are shown as people read them (:func:`human_size`) unless ``exact``; JSON always
    has the exact counts.
    """
    out = out or sys.stdout
    if as_json:
        return _json_array(rows, out)
    count = 0
    shown_sizes = frozenset(() if exact else sizes)
    widths = [len(col) for col in columns]
    batch: list[dict[str, Any]] = []
    for row in rows:
        count += 1
        batch.append(row)
        if page is not None and len(batch) >= page:
            _table_page(batch, columns, widths, out, header=count == len(batch), sizes=shown_sizes)
            batch = []
    if batch or not count:
        _table_page(batch, columns, widths, out, header=count == len(batch), sizes=shown_sizes)
    return count


def human_size(size: int | None) -> str | None:
    """A byte count as people read it, in powers of 1024 as ``du -h`` does: ``0 B``, ``812 B``, ``2.2 KiB``,
    ``1.4 GiB`` (three significant digits at most)."""
    if size is None:
        return None
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(value)} B"
    return f"{value:.1f} {unit}" if abs(value) < 100 else f"{value:.0f} {unit}"


def hms(seconds: float | None) -> str | None:
    """A duration as people read it (``1 day, 2:03:04``; negative is ``0:00:00``): ``stuck``'s columns and the
    defaults the help text states, so both say an interval the same way."""
    return None if seconds is None else str(timedelta(seconds=int(max(seconds, 0))))


def _json_array(rows: Iterable[dict[str, Any]], out: TextIO) -> int:
    count = 0
    for row in rows:
        text = json.dumps(row, indent=2, default=str).replace("\n", "\n  ")
        out.write(f"{',' if count else '['}\n  {text}")
        out.flush()
        count += 1
    out.write("\n]\n" if count else "[]\n")
    return count


def _table_page(
    rows: list[dict[str, Any]],
    columns: Sequence[str],
    widths: list[int],
    out: TextIO,
    *,
    header: bool,
    sizes: Collection[str],
) -> None:
    """Write ``rows``, widening ``widths`` (shared by every page of one table) to fit them."""
    if header and not rows:
        out.write("(none)\n")
        return
    cells = [
        [_cell(human_size(row.get(col)) if col in sizes else row.get(col)) for col in columns] for row in rows
    ]
    for r, row in zip(cells, rows, strict=True):
        for i, text in enumerate(r if row.get("error") is None else r[:1]):
            widths[i] = max(widths[i], len(text))
    if header:
        out.write(
            "  ".join(col.upper().ljust(w) for col, w in zip(columns, widths, strict=True)).rstrip() + "\n"
        )
    for r, row in zip(cells, rows, strict=True):
        if row.get("error") is not None:
            error = " ".join(str(row["error"]).split())  # one line, whatever the message holds
            out.write(f"{r[0].ljust(widths[0])}  error: {error}\n")
        else:
            out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")
    out.flush()


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (dict, list)):
        text = json.dumps(value, default=str)
        return text if len(text) <= 60 else text[:57] + "..."
    return str(value)
