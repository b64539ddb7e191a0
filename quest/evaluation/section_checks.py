"""The vocabulary of an evaluation's own value check (the ``check`` it registers with, quest.evaluation.kinds) beside
:class:`quest.config.checks.Checks`: a list of distinct entries of a set known only when the check runs (eval.run
against the registered evaluations). A value's range or fixed choices are declared on its section's dataclass field
instead (quest.store.records: ``bounded``, ``one_of``, ``listed``), and checked with every other declared value. A
module below the evaluations, so that they use it without importing the whole config check (quest.evaluation.checks),
which reads the schema built from every registered evaluation. No torch.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from quest.config.checks import Checks

__all__ = ["sublist"]


def sublist(checks: Checks, key: str, allowed: Iterable[Any], what: str) -> None:
    """A list of distinct entries, each one of ``allowed``."""
    allowed = list(allowed)
    checks.check(key, lambda v: all(x in allowed for x in v) and len(set(v)) == len(v),
                 f"a list of distinct {what} from {', '.join(map(str, allowed))}")
