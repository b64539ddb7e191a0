"""``eval_results.json`` as a typed record: the one reader of the file for eval.py (quest.evaluation.directory) and
quest-report (quest.report.runs), which checks every field's type and range before either believes it (no torch
here: quest-report imports it).

A file whose ``status`` is none of those eval.py writes, whose top-1 is a string or above 100, or whose sample count
is negative is refused naming the field, instead of being reused as valid results or averaged into a table.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from quest.store.compat import upgrade_eval_results
from quest.store.damage import DamagedFile
from quest.store.records import bounded, check_fields, field_problem, matching

__all__ = ["EvalResultsRecord", "checked_results", "METRIC_RULES"]


_SHA256 = ("[0-9a-f]{64}", "64 hex digits (a SHA-256)")


@dataclass
class DataIdentity:
    """The data an input of an evaluation read, by content (quest.evaluation.inputs.data_identity)."""

    size: int | None = field(default=None, metadata=bounded(0))
    classes_sha256: str | None = field(default=None, metadata=matching(*_SHA256))
    files_sha256: str | None = field(default=None, metadata=matching(*_SHA256))


@dataclass
class EvalResultsRecord:
    """The top level of an eval_results.json (docs/evaluation.md, "Results")."""

    status: Literal["running", "complete", "partial"]  # as written; "interrupted" is derived from a dead "running"
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # evaluation -> its numbers (METRIC_RULES)
    suite: str | None = None
    evaluations: list[str] = field(default_factory=list)
    target: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    data: dict[str, DataIdentity] = field(default_factory=dict)  # setting -> what it read, by content
    settings: dict[str, Any] = field(default_factory=dict)
    command: list[str] | None = None  # None: evaluated through the Python API
    world_size: int = field(default=1, metadata=bounded(1))
    device: str | None = None
    precision: str | None = None
    versions: dict[str, str | None] = field(default_factory=dict)
    started: str | None = None
    fingerprint: dict[str, Any] = field(default_factory=dict)
    key: str | None = None
    wall_time_s: float | None = field(default=None, metadata=bounded(0.0))


_PERCENT = (float | None, (0.0, 100.0))
_COUNT = (int | None, (0, None))
_LOSS = (float | None, (0.0, None))
#: what a number of a given name holds, wherever it sits in ``results`` (an evaluation's own, a variant's, an
#: attack's): percentages within [0, 100], counts >= 0, losses >= 0; None where a suite could not score it
METRIC_RULES: dict[str, tuple[Any, tuple[float | None, float | None]]] = {
    **dict.fromkeys(("top1", "top5", "clean_top1", "clean_top5", "miou"), _PERCENT),
    **dict.fromkeys(("n", "correct", "top5_correct", "excluded_empty"), _COUNT),
    **dict.fromkeys(("nll", "clean_nll"), _LOSS),
}


#: a percentage and the count it is made of, out of ``n`` (every suite writes 100 * count / n)
_FROM_COUNTS = (("top1", "correct"), ("top5", "top5_correct"))


def _counts_problem(scores: Mapping, where: str) -> str | None:
    """Where ``scores`` holds ``n`` and the counts its percentages come from, they must agree: a figure edited by
    hand (top1 99 of 70 correct in 360) would be reported as measured."""
    n = scores.get("n")
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        return None
    for rate, count in _FROM_COUNTS:
        value, counted = scores.get(rate), scores.get(count)
        if not isinstance(counted, int) or isinstance(counted, bool):
            continue
        if counted > n:
            return f"{where}.{count} is {counted}, more than {where}.n {n}"
        if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value - 100 * counted / n) > 1e-9 * 100:
            return (f"{where}.{rate} is {value!r}, but {counted} of {n} is {100 * counted / n!r}; expected the "
                    f"percentage its counts make")
    return None


def _metric_problem(value: Any, where: str) -> str | None:
    if isinstance(value, Mapping):
        for key, inner in value.items():
            rule = METRIC_RULES.get(key)
            problem = (field_problem(inner, rule[0], rule[1], f"{where}.{key}") if rule is not None
                       else _metric_problem(inner, f"{where}.{key}"))
            if problem:
                return problem
        return _counts_problem(value, where)
    elif isinstance(value, list):
        for i, inner in enumerate(value):
            problem = _metric_problem(inner, f"{where}[{i}]")
            if problem:
                return problem
    return None


def checked_results(data: Any, path: Path | str) -> dict[str, Any]:
    """The eval_results.json object ``data`` (read from ``path``) in today's form (an older quest's upgraded by
    quest.store.compat), every field checked; :class:`quest.store.damage.DamagedFile` naming the file and the first field that
    does not fit."""
    if not isinstance(data, dict):
        raise DamagedFile(path, f"holds a JSON {type(data).__name__} without a 'results' object, not eval.py's "
                                "results", joined=" ")
    record = upgrade_eval_results(data)
    check_fields(EvalResultsRecord, record, path)
    problem = _metric_problem(record.get("results", {}), "results")
    if problem:
        raise DamagedFile(path, problem, joined=": ")
    return record
