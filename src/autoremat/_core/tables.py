"""Plain-text tables: aligned columns, numbers right (tapes, plans and reports use it)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["render_table"]


def render_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Align columns; numbers right, text left."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    numeric = [
        all(_looks_numeric(row[i]) for row in cells[1:]) if rows else False
        for i in range(len(headers))
    ]

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(w) if num else c.ljust(w)
                 for c, w, num in zip(row, widths, numeric, strict=False)]
        return "  ".join(parts).rstrip()

    out = [line(cells[0]), "  ".join("-" * w for w in widths)]
    out.extend(line(row) for row in cells[1:])
    return "\n".join(out)


def _looks_numeric(text: str) -> bool:
    head = text.split(" ")[0].replace(".", "", 1).replace("-", "", 1).replace("%", "")
    return head.isdigit()
