"""Tables for people, JSON for scripts: every command builds rows once and prints them either way."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any, TextIO


def emit(
    rows: Sequence[dict[str, Any]], columns: Sequence[str], *, as_json: bool, out: TextIO | None = None
) -> None:
    out = out or sys.stdout
    if as_json:
        json.dump(list(rows), out, indent=2, default=str)
        out.write("\n")
        return
    if not rows:
        out.write("(none)\n")
        return
    cells = [[_cell(row.get(col)) for col in columns] for row in rows]
    widths = [max(len(col), *(len(r[i]) for r in cells)) for i, col in enumerate(columns)]
    out.write("  ".join(col.upper().ljust(w) for col, w in zip(columns, widths, strict=True)).rstrip() + "\n")
    for r in cells:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n")


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, (dict, list)):
        text = json.dumps(value, default=str)
        return text if len(text) <= 60 else text[:57] + "..."
    return str(value)
