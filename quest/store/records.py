"""Typed records for what quest reads back from its own files: every field's type and range checked before anything
believes it (docs/training.md, "What quest reads back").

A file quest wrote may come back cut, edited by hand or from another program: a checkpoint whose ``metrics_bytes`` is
-5 or the string "669", a training state whose step is -4, a config that is a list. A record class declares each
field with its type (the annotation) and, where a type is not enough, its range (:func:`bounded` metadata); the
reader calls :func:`check_fields` on what it loaded, which refuses the first field that does not fit with one
:class:`~quest.store.damage.DamagedFile` (the error of every file quest cannot believe) naming the file, the field,
what it holds and what was expected. Nothing is coerced: a string is not a number, a bool is not an int, and a float
field takes only finite numbers.

The types understood: ``int``, ``float``, ``str``, ``bool``, ``Any``, ``None``, unions (``X | None``),
``list[T]``, ``tuple[T, ...]``, ``dict[str, T]``, ``Literal[...]``, a nested record class (a dataclass, checked as a
dict of its fields), and ``torch.Tensor``.

The same declarations (:func:`bounded` with open ends, :func:`one_of`, :func:`listed`, :func:`matching`,
:func:`described`) state what a config value may be on its schema field (quest.config.schema), and
:func:`fits_declaration` is the one test of both; quest.config.checks words a config refusal its own way.

A file's key that a Python name cannot hold (``val/top1``) is declared with :func:`stored_as`; a field that names a
path inside the file's folder (or a mapping keyed by such paths) with :func:`relative_path`; a string of a fixed form
(a SHA-256) with :func:`matching`; the type of the values under keys a record does not declare (a metrics row's
per-layer statistics) with a class attribute ``extra_values``. Keys a record does not declare are otherwise left
alone (a newer quest may add some), unless its class attribute ``closed`` is true: then the record is the whole
mapping, every key declared and every field without a default present, wherever it sits. A declared key is always
checked.
"""
from __future__ import annotations

import dataclasses
import math
import re
import sys
import types
import typing
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path, PurePosixPath
from typing import Any

from quest.store.damage import DamagedFile

__all__ = ["bounded", "one_of", "listed", "described", "fits_declaration", "type_name", "unwrap_optional",
           "bound_ends", "record", "stored_as", "relative_path", "matching", "key_of", "path_problem", "check_fields",
           "check_record", "field_problem", "Number", "SEED_RANGE"]

# the folder a checked file's paths must stay inside, named in the message (set by check_fields for the records
# nested in the file too, which the type checks reach without it)
_FOLDER: ContextVar[Any] = ContextVar("records_folder", default=None)

#: an end of a :func:`bounded` range: a number, None (no limit), or a function giving the number when checked
Bound = float | typing.Callable[[], float] | None

#: a number as quest writes it: finite, or JSON's text for a non-finite one (quest.store.files.plain writes nan as "nan")
Number = float | typing.Literal["nan", "inf", "-inf"]


def bounded(low: Bound = None, high: Bound = None, *, open_low: bool = False, open_high: bool = False,
            **metadata: Any) -> dict[str, Any]:
    """Field metadata: the value (each number of a list) lies in [low, high], no limit at an end that is None and the
    end itself excluded with ``open_low`` / ``open_high``: ``field(metadata=bounded(0))``. An end may be a function
    called when the value is checked (a limit that depends on the machine)."""
    ends = {"open": (open_low, open_high)} if open_low or open_high else {}
    return {"bounds": (low, high), **ends, **metadata}


def one_of(*choices: Any, **metadata: Any) -> dict[str, Any]:
    """Field metadata: the value is one of ``choices`` (for a config field, which OmegaConf cannot type as a
    ``Literal``)."""
    return {"choices": choices, **metadata}


def listed(length: int | None = None, *, min_length: int = 0, distinct: bool = False, **metadata: Any) -> dict[str, Any]:
    """Field metadata of a list: exactly ``length`` elements (any number when None), at least ``min_length``,
    each element once when ``distinct``."""
    return {"length": (length, min_length, distinct), **metadata}


def described(words: str, **metadata: Any) -> dict[str, Any]:
    """Field metadata: what a refusal says the value must be, where the words derived from the declaration would not
    say enough (its unit, an example): ``field(metadata=described("an integer in 1..4096 (pixels)", **bounded(1,
    4096)))``."""
    return {"allowed": words, **metadata}


def stored_as(key: str, **metadata: Any) -> dict[str, Any]:
    """Field metadata: the field's key in the file is ``key`` (``field(metadata=stored_as("val/top1",
    **bounded(0, 100)))``), for keys that are not Python names."""
    return {"key": key, **metadata}


#: numpy's seeds (and torch's, which take them): every seed a config or a record holds
SEED_RANGE = (0, 2**32 - 1)


def relative_path(**metadata: Any) -> dict[str, Any]:
    """Field metadata: a path (or a list of paths, or a mapping's keys) relative to the file's folder, which must stay
    inside it."""
    return {"path": True, **metadata}


def matching(pattern: str, what: str, **metadata: Any) -> dict[str, Any]:
    """Field metadata: a string that matches ``pattern`` whole (``what`` says its form in the message:
    ``field(metadata=matching("[0-9a-f]{64}", "64 hex digits"))``)."""
    return {"pattern": (re.compile(pattern), what), **metadata}


def key_of(f: dataclasses.Field) -> str:
    """The key a record's field has in its file."""
    return f.metadata.get("key", f.name)


def path_problem(name: Any, where: str, folder: Any = None) -> str | None:
    """Why ``name`` (a path a file names, at ``where``) is not a relative path that stays inside ``folder`` (the
    file's folder), or None. Where ``folder`` is on disk, the folders on the way are followed too: a link among them
    to somewhere else would have a file outside moved or removed as the record's. The last part may be a link
    (moving or removing it touches the link only)."""
    if isinstance(name, str) and name and "\0" not in name and not PurePosixPath(name).is_absolute() \
            and ".." not in PurePosixPath(name).parts:
        if folder is None or not Path(folder).is_dir():
            return None
        inside = Path(folder).resolve()
        if (Path(folder) / name).parent.resolve().is_relative_to(inside):
            return None
        parts = PurePosixPath(name).parts[:-1]
        link = next(Path(folder, *parts[:i]) for i in range(1, len(parts) + 1)
                    if not Path(folder, *parts[:i]).resolve().is_relative_to(inside))
        return (f"{where} is {name!r}, which leads out of {folder} through the link {link} -> {link.resolve()}; "
                f"expected a path inside {folder} (make {link.name} a folder of its own)")
    folder = "the folder" if folder is None else folder
    return f"{where} is {name!r}, a path outside {folder}; expected a path relative to {folder} and inside it"


def _describe(value: Any) -> str:
    try:
        text = repr(value)
    except ValueError:  # an integer of over 4,300 digits, which Python will not write out
        return f"{type(value).__name__} of more than 4,300 digits"
    return f"{type(value).__name__} {text if len(text) <= 60 else text[:57] + '...'}"


def type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if hint is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in typing.get_args(hint))
    if origin is typing.Literal:  # "the string 'nan'": beside "a finite number", a float NaN reads as allowed
        choices = typing.get_args(hint)
        kind = "the string " if all(isinstance(a, str) for a in choices) else ""
        return (f"{kind}{choices[0]!r}" if len(choices) == 1 else
                f"one of {kind.replace('string', 'strings')}" + ", ".join(repr(a) for a in choices))
    if origin in (list, tuple):
        item = typing.get_args(hint)[0]
        plural = {int: "integers", float: "finite numbers", str: "strings", bool: "booleans"}
        return "a list" if item is Any else f"a list of {plural.get(item) or type_name(item)}"
    if origin is dict:
        values = typing.get_args(hint)[1]
        return "a mapping" if values is Any else f"a mapping of str to {type_name(values)}"
    if dataclasses.is_dataclass(hint):
        return f"a mapping of {hint.__name__}'s fields"
    return {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}.get(
        hint, getattr(hint, "__name__", str(hint)))


def field_problem(value: Any, hint: Any, bounds: tuple[Bound, Bound] = (None, None),
                  where: str = "", open_ends: tuple[bool, bool] = (False, False)) -> str | None:
    """Why ``value`` is not of type ``hint`` within ``bounds`` (an end excluded where ``open_ends`` says so; naming
    the part at ``where`` inside it), or None."""
    problem = _type_problem(value, hint, where)
    if problem is None and _is_number(value) and _outside(value, bounds, open_ends):
        (low, high), (open_low, open_high) = bound_ends(bounds), open_ends
        above, below = f"{'>' if open_low else '>='} {low}", f"{'<' if open_high else '<='} {high}"
        span = (f"between {low} and {high}" if low is not None and high is not None and open_ends == (False, False)
                else f"{above} and {below}" if low is not None and high is not None
                else above if low is not None else below)
        return f"{where or 'it'} is {value!r}, expected a value {span}"
    return problem


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def bound_ends(bounds: tuple[Bound, Bound]) -> tuple[float | None, float | None]:
    """The numbers of a :func:`bounded` range, an end given as a function called now."""
    return tuple(end() if callable(end) else end for end in bounds)  # type: ignore[return-value]


def _outside(number: float, bounds: tuple[Bound, Bound], open_ends: tuple[bool, bool] = (False, False)) -> bool:
    (low, high), (open_low, open_high) = bound_ends(bounds), open_ends
    return (low is not None and (number <= low if open_low else number < low)) or (
        high is not None and (number >= high if open_high else number > high))


def unwrap_optional(hint: Any) -> Any:
    """``hint`` without its ``None`` option (``Optional[int]`` -> ``int``)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return options[0] if len(options) == 1 else hint
    return hint


def fits_declaration(value: Any, hint: Any, metadata: Mapping[str, Any]) -> bool:
    """Whether ``value`` is of type ``hint`` and within what ``metadata`` declares (:func:`bounded`, :func:`one_of`,
    :func:`listed`, :func:`matching`), each number of a list included: the one test of a declared field, for the
    records quest reads back and the config values a user sets."""
    if _type_problem(value, hint, "") is not None:
        return False
    if value is None:
        return True
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    bounds, open_ends = metadata.get("bounds", (None, None)), metadata.get("open", (False, False))
    if any(_is_number(v) and _outside(v, bounds, open_ends) for v in items):
        return False
    if "choices" in metadata and not all(v in metadata["choices"] for v in items):
        return False
    pattern = metadata.get("pattern", (None, ""))[0]
    if pattern is not None and not all(isinstance(v, str) and pattern.fullmatch(v) for v in items):
        return False
    length, min_length, distinct = metadata.get("length", (None, 0, False))
    if isinstance(value, (list, tuple)):
        if (length is not None and len(value) != length) or len(value) < min_length:
            return False
        if distinct and len({repr(v) for v in value}) != len(value):
            return False
    return True


def _type_problem(value: Any, hint: Any, where: str) -> str | None:
    origin = typing.get_origin(hint)
    label = where or "it"
    if hint is Any or hint is object:
        return None
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        problems = [_type_problem(value, option, where) for option in options]
        if any(p is None for p in problems):
            return None
        # one option of the value's own kind explains best (a list's bad element, not "expected null")
        inner = [p for option, p in zip(options, problems) if _same_kind(value, option)]
        return inner[0] if inner else f"{label} is {_describe(value)}, expected {type_name(hint)}"
    if origin is typing.Literal:
        choices = typing.get_args(hint)
        return None if value in choices and type(value) in {type(c) for c in choices} else (
            f"{label} is {_describe(value)}, expected {type_name(hint)}")
    if hint is type(None):
        return None if value is None else f"{label} is {_describe(value)}, expected null"
    if hint is bool:
        return None if isinstance(value, bool) else f"{label} is {_describe(value)}, expected true or false"
    if hint is int:  # of 64 bits, as torch and numpy count: a larger one is no value quest writes
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{label} is {_describe(value)}, expected an integer"
        return None if -2**63 <= value < 2**63 else f"{label} is {_describe(value)}, expected an integer of 64 bits"
    if hint is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= sys.float_info.max \
            and math.isfinite(value)  # an int beyond a float's range would overflow in isfinite
        return None if ok else f"{label} is {_describe(value)}, expected a finite number"
    if hint is str:
        return None if isinstance(value, str) else f"{label} is {_describe(value)}, expected a string"
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return f"{label} is {_describe(value)}, expected {type_name(hint)}"
        item = typing.get_args(hint)[0] if typing.get_args(hint) else Any
        for i, element in enumerate(value):
            problem = _type_problem(element, item, f"{label}[{i}]")
            if problem:
                return problem
        return None
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) for k in value):
            return f"{label} is {_describe(value)}, expected {type_name(hint)}"
        item = typing.get_args(hint)[1] if typing.get_args(hint) else Any
        for key, element in value.items():
            problem = _type_problem(element, item, _key_label(label, key))
            if problem:
                return problem
        return None
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            return f"{label} is {_describe(value)}, expected {type_name(hint)}"
        return _fields_problem(hint, value, label)
    if isinstance(hint, type):
        return None if isinstance(value, hint) else f"{label} is {_describe(value)}, expected {type_name(hint)}"
    return None  # a hint this checker does not know: not judged


def _same_kind(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint) or hint
    kinds = {list: (list, tuple), tuple: (list, tuple), dict: Mapping}
    return origin in kinds and isinstance(value, kinds[origin]) or (
        dataclasses.is_dataclass(hint) and isinstance(value, Mapping))


def _allows_none(hint: Any) -> bool:
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in typing.get_args(hint)


def record(cls: type, **bounds: Any) -> dict[str, Any]:
    """Field metadata: a ``dict`` field whose mapping is checked as record class ``cls``."""
    return {"record": cls, **bounds}


def _fields_problem(cls: type, data: Mapping, prefix: str = "") -> str | None:
    hints = typing.get_type_hints(cls)
    declared = set()
    for f in dataclasses.fields(cls):
        key = key_of(f)
        declared.add(key)
        if key not in data:
            continue
        where = f"{prefix}.{key}" if prefix else key
        hint = hints[f.name]
        nested = f.metadata.get("record")  # a mapping declared as a plain dict, checked as this record class
        if nested is not None:
            hint = nested | None if _allows_none(hint) else nested
        value = data[key]
        problem = field_problem(value, hint, f.metadata.get("bounds", (None, None)), where,
                                f.metadata.get("open", (False, False)))
        if problem is None and not fits_declaration(value, hint, f.metadata):  # its choices or length
            problem = f"{where} is {_describe(value)}, expected what its declaration allows ({_declared(f.metadata)})"
        if problem is None and f.metadata.get("path") and value is not None:
            named = ([(name, f"a key of {where}") for name in value] if isinstance(value, Mapping)
                     else [(name, f"{where}[{i}]") for i, name in enumerate(value)] if isinstance(value, list)
                     else [(value, where)])
            problem = next((p for name, at in named if (p := path_problem(name, at, _FOLDER.get()))), None)
        pattern, form = f.metadata.get("pattern", (None, ""))
        if problem is None and pattern is not None and isinstance(value, str) and not pattern.fullmatch(value):
            problem = f"{where} is {value!r:.80}, expected {form}"
        if problem:
            return problem
    if getattr(cls, "closed", False):  # the whole mapping: no key it does not declare, every required one there
        unknown = [str(k) for k in data if k not in declared]
        missing = [key for key in _required(cls) if key not in data]
        if unknown or missing:
            found = f"holds {', '.join(unknown)}" if unknown else f"has no {', '.join(missing)}"
            return (f"{prefix or 'it'} {found}, expected the keys {', '.join(key_of(f) for f in dataclasses.fields(cls))}"
                    f" ({', '.join(_required(cls))} required)")
    extra = getattr(cls, "extra_values", None)  # the type of every value under a key the record does not declare
    if extra is not None:
        for key, value in data.items():
            if key not in declared:
                problem = field_problem(value, extra, where=f"{prefix}.{key}" if prefix else str(key))
                if problem:
                    return problem
    return None


def _declared(metadata: Mapping[str, Any]) -> str:
    """A :func:`one_of` / :func:`listed` / :func:`matching` declaration in words."""
    words = [f"one of {', '.join(map(repr, metadata['choices']))}"] if "choices" in metadata else []
    length, min_length, distinct = metadata.get("length", (None, 0, False))
    words += [f"{length} entries"] if length is not None else []
    words += [f"at least {min_length} entries"] if min_length else []
    words += [metadata["pattern"][1]] if "pattern" in metadata else []  # a matching(): its form in words
    return ", ".join(words + (["each entry once"] if distinct else [])) or "its declaration"


def _key_label(label: str, key: str) -> str:
    """Where the value under ``key`` of the mapping at ``label`` sits: dotted, or subscripted where a dot would read
    as part of the path (a file's name, ``files['model.safetensors']``)."""
    return f"{label}[{key!r}]" if not key or any(c in key for c in ". ") else f"{label}.{key}"


def _required(cls: type) -> list[str]:
    return [key_of(f) for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]


def check_fields(cls: type, data: Mapping, source: Any, folder: Any = None) -> None:
    """Refuse (:class:`~quest.store.damage.DamagedFile`) the first field of ``data`` that is not of ``cls``'s declared
    type and range, or (a :func:`relative_path` field) a path outside ``folder``, naming ``source`` (the file) and the
    field; fields ``cls`` does not declare are the caller's to refuse."""
    if not isinstance(data, Mapping):
        raise DamagedFile(source, f"holds {_describe(data)}, expected a mapping of {cls.__name__}'s fields", joined=" ")
    token = _FOLDER.set(folder)
    try:
        problem = _fields_problem(cls, data)
    finally:
        _FOLDER.reset(token)
    if problem:
        raise DamagedFile(source, problem, joined=": ")


def check_record(cls: type, data: Any, source: Any, what: str = "", folder: Any = None) -> None:
    """:func:`check_fields`, and every field of ``cls`` without a default present: what a reader of a whole file
    calls (``what``: what the file should be, for the message)."""
    check_fields(cls, data, source, folder)
    missing = [key for key in _required(cls) if key not in data]
    if missing:
        raise DamagedFile(source, f"no {', '.join(missing)}; expected {what or f'the fields of {cls.__name__}'}",
                          joined=": ")
