"""The one markdown table renderer quest's reports share: ``quest.report``'s tables, an evaluation's report, an
export's model card, the toy study's outcomes."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["markdown_table"]


def markdown_table(header: Sequence[Any], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A GitHub markdown table, one string per line; ``|`` inside a cell is escaped."""
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(map(esc, row)) + " |" for row in rows]
