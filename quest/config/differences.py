"""The differences between two configs: a run directory's stored config and a resume's (quest.run.directory), an
evaluation directory's fingerprint and a new evaluation's (quest.evaluation.directory). Both compare dotted keys
(:func:`flatten`), and show each key that differs as ``key: stored -> new`` (:class:`Difference`).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ABSENT", "Difference", "differences", "flatten"]


class _Absent:
    """A key one config lacks; shown as ``(absent)`` (a string would be quoted and could be a real value)."""

    def __repr__(self) -> str:
        return "(absent)"


ABSENT: Any = _Absent()


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of nested dicts. Lists are values, not branches: a list-valued key (``data.mean``) is one
    key that differs as a whole. An empty dict below the top is kept as a value (``{"a": {}}`` -> ``{"a": {}}``), so
    that it differs from a missing key; the empty top-level dict has no keys."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out if out or not prefix else {prefix: {}}
    return {prefix: tree}


@dataclass(frozen=True)
class Difference:
    """One key whose value differs between the stored config and the new one (:data:`ABSENT` where one lacks it)."""

    key: str
    stored: Any
    new: Any

    def __str__(self) -> str:
        return self.show()

    def show(self, width: int | None = None) -> str:
        """``key: stored -> new`` with each value's repr cut to ``width`` characters (a long list stays one line)."""
        cut = (lambda v: f"{v!r:.{width}}") if width else repr
        return f"{self.key}: {cut(self.stored)} -> {cut(self.new)}"


def differences(stored: Mapping[str, Any], new: Mapping[str, Any],
                defaults: Mapping[str, Any] | None = None) -> list[Difference]:
    """The keys of two nested configs whose values differ, in key order. A key one of them lacks counts as its value
    in ``defaults`` (flattened keys; e.g. the schema's default, for a config an older quest stored), else as
    :data:`ABSENT`."""
    a, b, defaults = flatten(dict(stored)), flatten(dict(new)), defaults or {}
    found = []
    for key in sorted(set(a) | set(b)):
        old, now = a.get(key, defaults.get(key, ABSENT)), b.get(key, defaults.get(key, ABSENT))
        if old != now:
            found.append(Difference(key, old, now))
    return found
