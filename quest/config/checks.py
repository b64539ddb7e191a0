"""Config checks that run before any work: every key known to its schema, every value in its allowed range.

Hydra's structured configs already refuse a misspelt key given as ``key=value``, but ``+key=value`` and
``++key=value`` open the node and add it; :func:`check_known_keys` walks the composed config against the schema
dataclasses and refuses such keys with the same kind of message. :class:`Checks` collects value problems so that a
user sees every bad value of a command line at once, each naming the key, the value and what is allowed.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from typing import Any, Callable, Iterable

from omegaconf import DictConfig, OmegaConf

__all__ = ["ConfigError", "check_known_keys", "Checks", "dataclass_of", "float_keys", "is_int", "DEVICE_PATTERN",
           "PRECISIONS", "MATMUL_PRECISIONS"]

#: what trainer.device and eval.device accept
DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
#: autocast precisions of training (recipe.precision, trainer.precision besides auto) and evaluation (eval.precision)
PRECISIONS = ("fp32", "bf16", "fp16")
#: trainer.matmul_precision: torch.set_float32_matmul_precision's levels (highest: IEEE float32; high: TF32 tensor
#: cores; medium: bfloat16 passes), quest.train.precision.set_matmul_precision
MATMUL_PRECISIONS = ("highest", "high", "medium")


def is_int(value: Any) -> bool:
    """An int that is not a bool (YAML's true is an int to Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A finite int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def most_processes() -> int:
    """The most worker processes or threads a config may ask for: 4 per CPU this process may use, at least 64. Past a
    few per CPU they only add memory, and a typo (10**6) would fork or spawn until the machine runs out of it."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(64, 4 * cpus)


def process_count_problem(value: Any, minimum: int) -> str | None:
    """What a count of processes or threads must be, when ``value`` is not that (see :func:`most_processes`)."""
    most = most_processes()
    if is_int(value) and minimum <= value <= most:
        return None
    return f"an integer in {minimum}..{most} (at most 4 per CPU this process may use, or 64)"


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


def _is_float_type(annotation: Any) -> bool:
    """float, Optional[float], List[float] or Optional[List[float]]."""
    if annotation is float:
        return True
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Union and len(args) == 1:
        return _is_float_type(args[0])
    return origin in (list, typing.List) and args == [float]


def float_keys(schema: type, prefix: str = "") -> list[str]:
    """Every key of the ``schema`` dataclass tree typed float (also Optional[float], List[float]) whose value must be
    finite: all of them except fields with ``metadata={"finite": False}`` (quest.config.schema.NON_FINITE_OK)."""
    hints = typing.get_type_hints(schema)
    keys: list[str] = []
    for f in dataclasses.fields(schema):
        child = dataclass_of(hints[f.name])
        if child is not None:
            keys.extend(float_keys(child, f"{prefix}{f.name}."))
        elif _is_float_type(hints[f.name]) and f.metadata.get("finite", True):
            keys.append(prefix + f.name)
    return keys


def _finite(value: Any) -> bool:
    values = value if isinstance(value, (list, tuple)) or OmegaConf.is_list(value) else [value]
    return all(v is None or (isinstance(v, (int, float)) and math.isfinite(v)) for v in values)


class Checks:
    """Collects value problems of one config; :meth:`raise_if_any` reports them all at once."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.problems: list[str] = []

    def value(self, key: str) -> Any:
        return OmegaConf.select(self.cfg, key)

    def fail(self, key: str, message: str) -> None:
        """Record a problem: ``message`` completes "<key> ...", e.g. "must be a positive integer"."""
        self.problems.append(f"  {key} {message}, got {self.value(key)!r}")

    def check(self, key: str, ok: Callable[[Any], bool], allowed: str, optional: bool = False) -> None:
        value = self.value(key)
        if value is None and optional:
            return
        try:
            good = value is not None and bool(ok(value))
        except TypeError:
            good = False
        if not good:
            self.fail(key, f"must be {allowed}" + (" (or null)" if optional else ""))

    def process_count(self, *keys: str, minimum: int = 1, optional: bool = False) -> None:
        """A count of worker processes or threads: :func:`process_count_problem`."""
        for key in keys:
            problem = process_count_problem(self.value(key), minimum)
            if problem is not None and not (optional and self.value(key) is None):
                self.fail(key, f"must be {problem}" + (" (or null)" if optional else ""))

    def finite(self, *keys: str) -> None:
        """Each value (each element of a list) a finite number, or null where the key allows it."""
        for key in keys:
            self.check(key, _finite, "finite (not nan, inf or -inf)", optional=True)

    def positive_int(self, *keys: str, optional: bool = False) -> None:
        for key in keys:
            self.check(key, lambda v: isinstance(v, int) and v >= 1, "a positive integer", optional)

    def non_negative(self, *keys: str, optional: bool = False) -> None:
        for key in keys:
            self.check(key, lambda v: v >= 0, ">= 0", optional)

    def positive(self, *keys: str, optional: bool = False) -> None:
        for key in keys:
            self.check(key, lambda v: v > 0, "> 0", optional)

    def fraction(self, *keys: str, low_open: bool = False, high_open: bool = False, optional: bool = False) -> None:
        """A value in [0, 1], with either end excluded on request."""
        lo, hi = ("(" if low_open else "["), (")" if high_open else "]")
        for key in keys:
            self.check(key, lambda v: (v > 0 if low_open else v >= 0) and (v < 1 if high_open else v <= 1),
                       f"in {lo}0, 1{hi}", optional)

    def one_of(self, key: str, choices: Iterable[Any], optional: bool = False) -> None:
        choices = list(choices)
        self.check(key, lambda v: v in choices, f"one of {', '.join(map(str, choices))}", optional)

    def raise_if_any(self, what: str) -> None:
        if self.problems:
            raise ConfigError(f"invalid {what} values:\n" + "\n".join(self.problems))
