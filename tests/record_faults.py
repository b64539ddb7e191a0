"""Faults for a typed record (quest.records): for every field of a record class, and of the records nested in it,
values of the wrong type and values out of its declared range, each with the dotted path of the field it goes in.
Tests of a file kind plant each in a good file and check that its reader refuses it naming the field."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Iterator

# values of every kind: a field takes the ones its type does not
SAMPLES: list[Any] = ["669", -5, 2.5, True, float("nan"), None, [1, 2], {"a": 1}]


def _accepts(hint: Any, value: Any) -> bool:
    from quest.records import field_problem

    return field_problem(value, hint) is None


def faults(cls: type, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted field path, a value that field must refuse) for every field of ``cls`` and its nested records."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        hint = hints[f.name]
        nested = f.metadata.get("record")
        if nested is not None:
            allows_none = (typing.get_origin(hint) in (typing.Union, types.UnionType)
                           and type(None) in typing.get_args(hint))
            hint = nested | None if allows_none else nested
            yield from faults(nested, f"{path}.")
        for value in SAMPLES:
            if not _accepts(hint, value):
                yield path, value
        low, high = f.metadata.get("bounds", (None, None))
        if low is not None:
            yield path, (low - 1 if isinstance(low, int) else low - 0.5)
        if high is not None:
            yield path, (high + 1 if isinstance(high, int) else high + 0.5)


def planted(data: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of ``data`` with ``value`` at dotted ``path`` (the mappings on the way copied, the rest shared)."""
    out = dict(data)
    node = out
    *parents, last = path.split(".")
    for key in parents:
        node[key] = dict(node[key])
        node = node[key]
    node[last] = value
    return out
