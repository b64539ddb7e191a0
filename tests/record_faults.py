"""Faults for a typed record (quest.store.records): for every field of a record class, and of the records nested in it,
values of the wrong type, values out of its declared range and, for a field that names a path, paths outside the
file's folder, each with the dotted path of the field it goes in (its key in the file: ``val/top1``); for a record
that types the values of keys it does not declare (``extra_values``), a wrong value under such a key. Tests of a file
kind plant each in a good file and check that its reader refuses it naming the field."""
from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Iterator

# values of every kind: a field takes the ones its type does not
SAMPLES: list[Any] = ["669", -5, 2.5, True, float("nan"), None, [1, 2], {"a": 1}]
# paths that leave the folder of the file that names them
OUTSIDE: list[str] = ["../outside", "/etc/passwd", "a/../../b"]
# an undeclared key, for a record whose extra_values are typed
UNDECLARED = "undeclared/key"


def _accepts(hint: Any, value: Any) -> bool:
    from quest.store.records import field_problem

    return field_problem(value, hint) is None


def faults(cls: type, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted field path, a value that field must refuse) for every field of ``cls`` and its nested records."""
    from quest.store.records import key_of

    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{key_of(f)}"
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
        if f.metadata.get("path"):
            many = any(typing.get_origin(h) is list for h in (hint, *typing.get_args(hint)))
            for name in OUTSIDE:
                yield path, [name] if many else name
    extra = getattr(cls, "extra_values", None)
    if extra is not None:
        for value in SAMPLES:
            if not _accepts(extra, value):
                yield f"{prefix}{UNDECLARED}", value


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
