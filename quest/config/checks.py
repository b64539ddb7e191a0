"""Config checks that run before any work: every key known to its schema, every value in its allowed range.

Hydra's structured configs already refuse a misspelt key given as ``key=value``, but ``+key=value`` and
``++key=value`` open the node and add it; :func:`check_known_keys` walks the composed config against the schema
dataclasses and refuses such keys with the same kind of message. What a value may be is declared once, on its schema
field, with the metadata quest's records use (:func:`quest.store.records.bounded`, ``one_of``, ``listed``,
``matching``, ``described``; :func:`process_count`); :func:`declared_problems` walks the composed config against
those declarations. :class:`Checks` collects the problems of one config, those and the relations between keys a
declaration cannot state, so that a user sees every bad value of a command line at once, each naming the key, the
value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import typing
from collections.abc import Mapping
from typing import Any, Callable, Iterable

from omegaconf import DictConfig, OmegaConf

from quest.runtime.workers import process_count

# the declarations a config field takes are records' own (one mechanism), importable from here too
from quest.store.records import (
    bound_ends,
    bounded,
    described,
    fits_declaration,
    listed,
    matching,
    one_of,
    type_name,
    unwrap_optional,
)

__all__ = ["ConfigError", "check_known_keys", "Checks", "dataclass_of", "declared_problems", "allowed_words",
           "process_count", "is_int", "DEVICE_PATTERN", "DEVICE", "PRECISIONS", "MATMUL_PRECISIONS", "bounded", "one_of",
           "listed", "described", "matching"]

#: what trainer.device and eval.device accept
DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
#: the declaration of a device key (trainer.device, eval.device, the toy study's device)
DEVICE = matching(DEVICE_PATTERN.pattern, "auto, cpu, cuda or cuda:N")
#: autocast precisions of training (recipe.precision, trainer.precision besides auto) and evaluation (eval.precision)
PRECISIONS = ("fp32", "bf16", "fp16")
#: trainer.matmul_precision: torch.set_float32_matmul_precision's levels (highest: IEEE float32; high: TF32 tensor
#: cores; medium: bfloat16 passes), quest.train.compute.set_matmul_precision
MATMUL_PRECISIONS = ("highest", "high", "medium")


def is_int(value: Any) -> bool:
    """An int that is not a bool (YAML's true is an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class ConfigError(ValueError):
    """A config key or value that cannot run; the message names every offending key."""


def dataclass_of(annotation: Any) -> type | None:
    """The dataclass an annotation names (unwrapping Optional[...]), else None."""
    if dataclasses.is_dataclass(annotation):
        return annotation
    for arg in typing.get_args(annotation):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


def _unknown(node: DictConfig, schema: type, prefix: str) -> list[tuple[str, list[str]]]:
    hints = typing.get_type_hints(schema)
    known = {f.name for f in dataclasses.fields(schema)}
    found: list[tuple[str, list[str]]] = []
    for key in node.keys():
        key = str(key)
        if key not in known:
            found.append((prefix + key, sorted(known)))
            continue
        child_schema = dataclass_of(hints.get(key))
        if child_schema is not None and OmegaConf.is_dict(node._get_node(key)) and node[key] is not None:
            own = OmegaConf.get_type(node[key])  # a subclass the node was typed by (data=<name>: its settings)
            if isinstance(own, type) and dataclasses.is_dataclass(own) and issubclass(own, child_schema):
                child_schema = own
            found.extend(_unknown(node[key], child_schema, f"{prefix}{key}."))
    return found


def check_known_keys(cfg: DictConfig, schema: type, ignore: Iterable[str] = ("hydra",)) -> None:
    """Raise :class:`ConfigError` naming every key of ``cfg`` that the ``schema`` dataclass tree does not define
    (free-form ``Dict[str, Any]`` fields such as ``attention.options`` accept any key and are checked where used)."""
    problems = [(k, known) for k, known in _unknown(cfg, schema, "") if k.split(".")[0] not in set(ignore)]
    if not problems:
        return
    lines = []
    for key, known in problems:
        leaf = key.rsplit(".", 1)[-1]
        close = difflib.get_close_matches(leaf, known, n=1)
        hint = f"; did you mean {key.rsplit('.', 1)[0] + '.' if '.' in key else ''}{close[0]}?" if close else ""
        node = key.rsplit(".", 1)[0] if "." in key else "the top level"
        lines.append(f"  {key}: not a key of {node}{hint} (its keys: {', '.join(known)})")
    raise ConfigError("unknown config keys (added with + or ++ or misspelt; every key is typed by the schema):\n"
                      + "\n".join(lines))


#: a list's length in a refusal's words ("two values in [0, 1)")
_COUNTS = {1: "one", 2: "two", 3: "three", 4: "four"}


def _number_words(kind: Any, metadata: Mapping[str, Any], plural: bool) -> str:
    low, high = bound_ends(metadata.get("bounds", (None, None)))
    open_low, open_high = metadata.get("open", (False, False))
    if kind is int:
        noun = "integers" if plural else "an integer"
        if low == 1 and high is None:
            return "positive integers" if plural else "a positive integer"
        if low is not None and high is not None:
            return f"{noun} in {low}..{high}"
        return f"{noun} {'>' if open_low else '>='} {low}" if low is not None else (
            f"{noun} {'<' if open_high else '<='} {high}" if high is not None else noun)
    noun = "values " if plural else ""
    if low is not None and high is not None:
        return f"{noun}in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
    if low is not None:
        return f"{noun}{'>' if open_low else '>='} {low}"
    if high is not None:
        return f"{noun}{'<' if open_high else '<='} {high}"
    return "finite numbers" if plural else "a finite number"


def allowed_words(hint: Any, metadata: Mapping[str, Any]) -> str:
    """What a value of a field declared with ``hint`` and ``metadata`` may be, in the words a refusal completes
    ("must be <words>"): the field's :func:`described` words, else derived from its type and declaration."""
    if "allowed" in metadata:  # a function where the words hold a limit found when checked (process_count)
        return metadata["allowed"]() if callable(metadata["allowed"]) else metadata["allowed"]
    kind = unwrap_optional(hint)
    is_list = typing.get_origin(kind) in (list, tuple)
    item = unwrap_optional(typing.get_args(kind)[0]) if is_list and typing.get_args(kind) else kind
    if "choices" in metadata:
        words = "one of " + ", ".join(map(str, metadata["choices"]))
    elif "pattern" in metadata:
        words = metadata["pattern"][1]
    elif item in (int, float):
        words = _number_words(item, metadata, plural=is_list)
    else:
        return type_name(kind)
    if not is_list:
        return words
    length, min_length, distinct = metadata.get("length", (None, 0, False))
    if length is not None:
        return f"{_COUNTS.get(length, length)} {words}"
    return (f"a {'non-empty ' if min_length else ''}list of {'distinct ' if distinct else ''}"
            f"{words if item in (int, float) else 'values each ' + words}")


def _leaf_problem(key: str, value: Any, hint: Any, metadata: Mapping[str, Any]) -> str | None:
    if fits_declaration(value, hint, metadata):
        return None
    numbers = value if isinstance(value, list) else [value]
    if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
        return f"  {key} must be a finite number (not nan, inf or -inf), got {value!r}"
    unbounded = bound_ends(metadata.get("bounds", (None, None)))[1] is None  # else its words give the end
    if unbounded and any(isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63 for v in numbers):
        return f"  {key} must be {allowed_words(hint, metadata)} that fits in 64 bits, got {value!r}"
    optional = value is not None and unwrap_optional(hint) is not hint
    return f"  {key} must be {allowed_words(hint, metadata)}{' (or null)' if optional else ''}, got {value!r}"


def _plain(value: Any) -> Any:
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def declared_problems(node: DictConfig, schema: type, prefix: str = "") -> list[str]:
    """One line per value of ``node`` that breaks its ``schema`` field's type or declaration ("  <key> must be
    <allowed>, got <value>"), walking nested dataclasses (a node typed by a subclass, a data set's settings, by its
    own) and the entries of ``Dict[str, ...]`` fields. A missing value (``???``) is left to Hydra's own error."""
    hints = typing.get_type_hints(schema)
    problems: list[str] = []
    for f in dataclasses.fields(schema):
        if f.name not in node or OmegaConf.is_missing(node, f.name):
            continue
        key, hint, value = prefix + f.name, hints[f.name], node[f.name]
        if typing.get_origin(unwrap_optional(hint)) is dict and OmegaConf.is_dict(value):
            entry = typing.get_args(unwrap_optional(hint))[1]
            for name in value.keys():
                if dataclasses.is_dataclass(entry) and OmegaConf.is_dict(value[name]):
                    problems += declared_problems(value[name], entry, f"{key}.{name}.")
                elif entry is not Any:  # a free-form mapping (attention.options) is checked where it is used
                    problems.append(_leaf_problem(f"{key}[{name}]", _plain(value[name]), entry, f.metadata))
        elif dataclass_of(hint) is not None and OmegaConf.is_dict(value):
            own, child = OmegaConf.get_type(value), dataclass_of(hint)
            schema_of = own if isinstance(own, type) and dataclasses.is_dataclass(own) and issubclass(own, child) \
                else child
            problems += declared_problems(value, schema_of, f"{key}.")
        elif hint is not Any:
            problems.append(_leaf_problem(key, _plain(value), hint, f.metadata))
    return [p for p in problems if p is not None]


class Checks:
    """Collects value problems of one config; :meth:`raise_if_any` reports them all at once. :meth:`declared` adds
    every value that breaks its schema field's declaration; :meth:`check`, :meth:`one_of` and :meth:`fail` add what a
    declaration cannot state (a name against a registry that plugins fill, a relation between keys)."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.problems: list[str] = []

    def value(self, key: str) -> Any:
        return OmegaConf.select(self.cfg, key)

    def fail(self, key: str, message: str) -> None:
        """Record a problem: ``message`` completes "<key> ...", e.g. "must be a positive integer". A key already
        refused is not refused again: a relation judged on a value that broke its own declaration says nothing more
        (one line per key)."""
        if not any(problem.startswith(f"  {key} ") for problem in self.problems):
            self.problems.append(f"  {key} {message}, got {self.value(key)!r}")

    def check(self, key: str, ok: Callable[[Any], bool], allowed: str, optional: bool = False) -> None:
        """Refuse ``key`` ("must be <allowed>") unless ``ok(value)``; null passes where ``optional``."""
        value = self.value(key)
        if value is None and optional:
            return
        try:
            good = value is not None and bool(ok(value))
        except TypeError:
            good = False
        if not good:
            self.fail(key, f"must be {allowed}" + (" (or null)" if optional else ""))

    def declared(self, schema: type, prefix: str = "") -> None:
        """Every value under ``prefix`` against its declaration on ``schema`` (:func:`declared_problems`)."""
        node = self.cfg if not prefix else OmegaConf.select(self.cfg, prefix.rstrip("."))
        if node is not None:
            self.problems.extend(declared_problems(node, schema, prefix))

    def one_of(self, key: str, choices: Iterable[Any], optional: bool = False) -> None:
        """Refuse ``key`` unless its value is one of ``choices`` known only now (a registry's names)."""
        choices = list(choices)
        self.check(key, lambda v: v in choices, f"one of {', '.join(map(str, choices))}", optional)

    def raise_if_any(self, what: str) -> None:
        if self.problems:
            raise ConfigError(f"invalid {what} values:\n" + "\n".join(self.problems))
