"""The vocabulary of an evaluation's own value check (the ``check`` it registers with, quest.evaluation.kinds):
besides :class:`quest.config.checks.Checks`'s own checks, a list of distinct entries of a set and a list of
ImageNet-C severities. A module below the evaluations, so that they use it without importing the whole config check
(quest.evaluation.checks), which reads the schema built from every registered evaluation. No torch.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from quest.config.checks import Checks, is_int

__all__ = ["sublist", "severities"]


def sublist(checks: Checks, key: str, allowed: Iterable[Any], what: str) -> None:
    """A list of distinct entries, each one of ``allowed``."""
    allowed = list(allowed)
    checks.check(key, lambda v: all(x in allowed for x in v) and len(set(v)) == len(v),
                 f"a list of distinct {what} from {', '.join(map(str, allowed))}")


def severities(checks: Checks, key: str) -> None:
    checks.check(key, lambda v: all(is_int(s) and 1 <= s <= 5 for s in v) and len(set(v)) == len(v),
                 "a list of distinct severities from 1, 2, 3, 4, 5")
