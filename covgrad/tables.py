"""Row tables (lists of dicts) as CSV and markdown text: the tables stages write beside their stores and
the report's tables (pure formatting; storage writes the files)."""

from __future__ import annotations

import csv
import io
from typing import Any


def uniform(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` over the union of their keys (first-seen order); absent cells are empty strings."""
    cols = list(dict.fromkeys(k for r in rows for k in r))
    return [{c: r.get(c, "") for c in cols} for r in rows]


def to_csv(rows: list[dict[str, Any]]) -> str:
    """CSV text of ``rows`` (columns: the union of their keys)."""
    rows = uniform(rows)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def to_markdown(rows: list[dict[str, Any]], floatfmt: str = ".4g") -> str:
    """A GitHub-style markdown table of ``rows``: columns are the union of their keys, floats use
    ``floatfmt``, and ``|`` inside a cell is escaped so the table keeps its columns."""
    rows = uniform(rows)
    cols = list(rows[0])

    def cell(v: Any) -> str:
        text = format(v, floatfmt) if isinstance(v, float) else str(v)
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines) + "\n"
