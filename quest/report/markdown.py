"""The one markdown table renderer quest's reports share: ``quest.report``'s tables, an evaluation's report, an
export's model card, the toy study's outcomes."""
from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["markdown_table", "md_text"]

# line breaks (a newline ends a table row or a heading) and other control characters
_BREAKS = re.compile(r"[\x00-\x1f\x7f\u0085\u2028\u2029]")


def md_text(value: Any) -> str:
    """``value`` as text that stays on its line of a markdown table or heading: every line break and control
    character shown as a space, ``|`` (a cell's end) escaped. The one escape of every string a report writes from a
    file (a model name, a run directory, a config value)."""
    return _BREAKS.sub(" ", str(value)).replace("|", "\\|")


def markdown_table(header: Sequence[Any], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A GitHub markdown table, one string per line; each cell escaped by :func:`md_text`."""
    esc = md_text
    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(map(esc, row)) + " |" for row in rows]
