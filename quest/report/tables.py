"""Paper-style tables from sweeps of training runs (QUEST paper Tables 1, A1 and A3): ``python -m quest.report``.

Runs (quest.report.runs) are grouped into rows by formulation, model and every other setting that varies across
them, except the seed; the seeds are the repetitions. Rendering: quest.report.render. Definitions of every column:
docs/report.md.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from .runs import ReportInputError, RunResult
from .settings import DATA_SET, NEUTRAL_KEYS, REPEAT_KEYS, neutral, setting, value_of
from .settings import hashable as _hashable
from .stats import LRSensitivity, init_loss, lower_is_better, lr_sensitivity, mean_std, welch_p

__all__ = ["Row", "LRSweep", "Report", "row_keys", "build_report", "DEFAULT_PRIMARY", "REPEAT_KEYS", "NEUTRAL_KEYS",
           "DATA_SET", "LR_KEYS", "EVAL_HEADLINE"]

log = logging.getLogger("quest.report")

DEFAULT_PRIMARY = "val/top1"
#: Settings that set the learning rate: an lr sweep differs in these only.
LR_KEYS = ("recipe.lr", "recipe.base_lr", "lr")
#: Leaf names of the eval_results.json numbers shown by default (the rest: --metrics, e.g. 'imagenet_c/ce/*').
EVAL_HEADLINE = ("top1", "mce", "relative_mce", "mean_error", "relative_mean_error")
# Formulations in the order of the paper's Table 1; others follow alphabetically.
_ATTENTION_ORDER = ("standard", "qnorm", "qknorm", "qknorm_ds", "qknorm_hs", "quest")



# --- grouping -----------------------------------------------------------------------------------------------------
#: The settings of a run without a config record (summary.json only) that tell settings apart.
_SUMMARY_SETTINGS = ("attention", "model", "choices.recipe", "choices.data", "lr", "global_batch")


def row_keys(runs: Sequence[RunResult]) -> list[str]:
    """The settings that tell rows apart: attention and model, the recipe and data set names when they differ
    between runs, and every other setting that differs between runs of one (attention, model, recipe, data).

    Settings come from the config record (run.json, .hydra/config.yaml) when every finished run has one, else from
    summary.json (the Hydra choices, the lr actually used and the global batch); the data set a run trained on
    (:data:`DATA_SET`) counts in both. Seeds and the result-neutral keys (quest.report.settings.NEUTRAL_KEYS) never
    do; every other key does, a new one included.
    """
    finished = [r for r in runs if r.status != "incomplete"]
    from_config = all(r.config is not None for r in finished)
    names = ["recipe.name", "data.name"] if from_config else ["choices.recipe", "choices.data"]
    keys = ["attention", "model"] + [k for k in names if len({_hashable(r.value(k)) for r in finished}) > 1]
    cells: dict[tuple, list[RunResult]] = {}
    for r in finished:
        cells.setdefault(tuple(_hashable(r.value(k)) for k in ["attention", "model", *names]), []).append(r)
    if from_config:
        candidates = sorted({k for r in finished for k in r.config})
        candidates = [k for k in candidates if k not in ("attention.name", "model.name", *names)]
    else:
        candidates = ["lr", "global_batch"]
    varying = [k for k in [*candidates, DATA_SET] if not neutral(k)
               and any(len({_hashable(value_of(r, k)) for r in cell}) > 1 for cell in cells.values())]
    return keys + varying


def _sort_key(value: Any) -> tuple:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (1, float(value), "")
    if value is None:
        return (3, 0.0, "")
    return (2, 0.0, str(value))


def _attention_sort(value: Any) -> tuple:
    if value in _ATTENTION_ORDER:
        return (0, _ATTENTION_ORDER.index(value), "")
    return (1, 0, str(value))


# --- rows ---------------------------------------------------------------------------------------------------------
@dataclass
class Row:
    """The runs of one setting: ``runs`` are counted (completed and diverged; stopped too with include_stopped),
    ``excluded`` are stopped runs left out, ``incomplete`` have no summary.json."""

    keys: dict[str, Any]
    runs: list[RunResult] = field(default_factory=list)
    excluded: list[RunResult] = field(default_factory=list)
    incomplete: list[RunResult] = field(default_factory=list)
    duplicates: list[RunResult] = field(default_factory=list)  # same setting and seed as a counted run: left out
    not_pooled: list[str] = field(default_factory=list)  # metrics left unpooled, each with why (build_report)
    p_value: float | None = None  # Welch vs the best row of its table, on the primary metric
    best: bool = False

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def n_diverged(self) -> int:
        return sum(r.status == "diverged" for r in self.runs)

    def values(self, metric: str) -> list[float]:
        """The metric of every counted run that has it (seed order); empty when any counted run diverged, or when
        it is an evaluation's and the runs' evaluations differ in settings or data (:meth:`apart`)."""
        if self.n_diverged or self.apart(metric):
            return []
        runs = sorted(self.runs, key=lambda r: _sort_key(r.value("seed")))
        return [r.metrics[metric] for r in runs if metric in r.metrics]

    def apart(self, metric: str) -> list[str]:
        """The settings in which the runs' evaluations behind ``metric`` differ (an evaluation's settings, its input
        transform, the data it read: quest.report.runs.RunResult.evaluations), empty when they agree or it is not
        an evaluation's: numbers of other evaluations are not one measurement and are not pooled."""
        evaluation = metric.split("/", 1)[0]
        found = [r.evaluations[evaluation] for r in self.runs if metric in r.metrics and evaluation in r.evaluations]
        keys = sorted({k for setting in found for k in setting})
        return [k for k in keys if len({repr(setting.get(k)) for setting in found}) > 1]

    def stat(self, metric: str) -> tuple[float, float | None, int] | None:
        """(mean, sample std or None, number of runs) of the metric, None when there is nothing to average."""
        values = self.values(metric)
        return (*mean_std(values), len(values)) if values else None

    def notes(self) -> str:
        stopped = sum(r.status == "stopped" for r in self.runs)
        parts = [f"includes {stopped} stopped" if stopped else "",
                 f"{len(self.excluded)} stopped (excluded)" if self.excluded else "",
                 f"{len(self.incomplete)} incomplete (no summary.json)" if self.incomplete else "",
                 f"{len(self.duplicates)} duplicate seed (counted once)" if self.duplicates else "",
                 f"{sum(len(r.older) for r in self.runs)} older evaluation(s) left out (not of the run's current "
                 "weights)" if any(r.older for r in self.runs) else "",
                 *self.not_pooled, kernel_note(self.runs)]
        return "; ".join(p for p in parts if p)


def kernel_note(runs: list[RunResult]) -> str:
    """Which path the q/k transforms took (summary.json's ``attention_kernels``), where any run used the fused
    kernels or fell back from them; nothing where none came near them (the CPU)."""
    paths = [(r.summary.get("attention_kernels.path"), r.summary.get("attention_kernels.reason")) for r in runs]
    checked = [(p, why) for p, why in paths if p and (p != "pytorch" or "failed its check" in str(why))]
    if not checked:
        return ""
    counts = Counter(p for p, _ in checked)
    fell_back = next((why for p, why in checked if p != "fused"), None)
    return ("kernels: " + ", ".join(f"{n} {p}" for p, n in sorted(counts.items()))
            + (f" ({fell_back})" if fell_back else ""))


@dataclass
class LRSweep:
    """Runs of one setting that differ only in the learning rate."""

    keys: dict[str, Any]
    runs_at: dict[float, list[RunResult]]  # lr -> counted runs
    sensitivity: LRSensitivity | None  # None without the number of classes
    num_classes: int | None


@dataclass
class Report:
    keys: list[str]  # row keys, "attention" first
    metrics: list[str]  # table columns (the primary among them)
    primary: str
    rows: list[Row]
    sweeps: list[LRSweep]
    unmatched: list[RunResult]  # incomplete runs that match no row
    decimals: int = 2
    left_out: list[str] = field(default_factory=list)  # runs noted and left out (quest.report.runs.Runs), with why

    def tables(self) -> list[tuple[dict[str, Any], list[Row]]]:
        """(context, rows) per table: rows that differ only in the formulation are compared with each other (all
        rows in one table when the formulation is not a row key)."""
        if "attention" not in self.keys:
            return [({}, list(self.rows))]
        out: dict[tuple, tuple[dict[str, Any], list[Row]]] = {}
        for row in self.rows:
            context = {k: v for k, v in row.keys.items() if k != "attention"}
            out.setdefault(tuple(_hashable(v) for v in context.values()), (context, []))[1].append(row)
        return list(out.values())


def _select_metrics(runs: Sequence[RunResult], patterns: Sequence[str] | None, primary: str) -> list[str]:
    seen: dict[str, None] = {}  # first-seen order: summary keys as trained, then evaluations in suite order
    for r in runs:
        seen.update(dict.fromkeys(r.metrics))
    if primary not in seen and any(r.status != "diverged" for r in runs):  # all diverged: nothing to compare
        raise ReportInputError(f"--primary {primary!r}: no run has it (metrics present: {', '.join(seen)})")
    if patterns:
        chosen = []
        for pattern in patterns:
            matched = [m for m in seen if fnmatchcase(m, pattern)]
            if not matched:
                raise ReportInputError(f"--metrics {pattern!r} matches no metric (present: {', '.join(seen)})")
            chosen += [m for m in matched if m not in chosen]
    else:
        summary_keys = {k for r in runs for k in r.summary}
        chosen = [m for m in ("val/top1", "val_ema/top1") if m in seen]
        chosen += [m for m in seen if m not in summary_keys and m.split("/")[-1] in EVAL_HEADLINE]
    return chosen if primary in chosen else [primary, *chosen]  # the primary is always shown


def _welch_vs_best(rows: list[Row], primary: str) -> None:
    candidates = [r for r in rows if r.stat(primary) is not None]
    if not candidates:
        return
    sign = -1.0 if lower_is_better(primary) else 1.0
    best = max(candidates, key=lambda r: sign * r.stat(primary)[0])
    best.best = True
    for row in rows:
        if row is not best:
            row.p_value = welch_p(row.values(primary), best.values(primary))


def _num_classes(runs: Iterable[RunResult], override: int | None) -> int | None:
    if override is not None:
        return override
    found = {r.config.get("data.num_classes") for r in runs if r.config is not None}
    found.discard(None)
    return int(found.pop()) if len(found) == 1 else None


def _lr_sweeps(rows: list[Row], num_classes: int | None) -> list[LRSweep]:
    """Rows that differ only in the lr settings form one sweep; a row whose own runs differ in lr (with --by
    leaving the lr out) is split by lr too."""
    groups: dict[tuple, tuple[dict[str, Any], list[RunResult]]] = {}
    for row in rows:
        rest = {k: v for k, v in row.keys.items() if k not in LR_KEYS}
        groups.setdefault(tuple(_hashable(v) for v in rest.values()), (rest, []))[1].extend(row.runs)
    sweeps = []
    for rest, runs in groups.values():
        runs_at: dict[float, list[RunResult]] = {}
        for r in runs:
            if r.lr is not None:
                runs_at.setdefault(r.lr, []).append(r)
        if len(runs_at) < 2:
            continue
        runs_at = dict(sorted(runs_at.items()))
        c = _num_classes(runs, num_classes)
        sensitivity = None
        if c is not None:
            losses = {lr: [None if r.status == "diverged" else r.metrics.get("val/loss") for r in rs]
                      for lr, rs in runs_at.items()}
            sensitivity = lr_sensitivity(losses, init_loss(c))
        sweeps.append(LRSweep(rest, runs_at, sensitivity, c))
    return sweeps


def _identity(r: RunResult) -> tuple:
    """What makes two runs the same experiment repeated with the same seed: every value that can change a result
    (quest.report.settings.setting: the config without the neutral keys, and the data set) and the seeds."""
    values = {**setting(r, _SUMMARY_SETTINGS), **{k: _hashable(r.value(k)) for k in REPEAT_KEYS}}
    return tuple(sorted(values.items(), key=lambda item: item[0]))


def _differing(runs: Sequence[RunResult]) -> list[str]:
    """The result-changing settings (seeds aside) that differ between ``runs``, in key order."""
    values = [setting(r, _SUMMARY_SETTINGS) for r in runs]
    keys = sorted({k for v in values for k in v})
    return [k for k in keys if k not in REPEAT_KEYS and len({repr(v.get(k)) for v in values}) > 1]


def _count_each_seed_once(row: Row) -> None:
    """Runs of the same setting and seed (a run repeated in another directory, e.g. with diagnostics on) are one
    repetition, not two: the first by path is counted, the others are named in a warning and in the row's notes."""
    first: dict[tuple, RunResult] = {}
    kept = []
    for r in row.runs:
        identity = _identity(r)
        if identity in first:
            row.duplicates.append(r)
            log.warning("%s repeats %s (same setting, seed %s): counted once", r.path, first[identity].path,
                        r.value("seed"))
        else:
            first[identity] = r
            kept.append(r)
    row.runs = kept


def build_report(runs: Sequence[RunResult], metrics: Sequence[str] | None = None, by: Sequence[str] | None = None,
                 primary: str = DEFAULT_PRIMARY, include_stopped: bool = False, num_classes: int | None = None,
                 decimals: int = 2) -> Report:
    """Group ``runs`` into rows (``by`` or :func:`row_keys`), take mean ± std per metric, Welch p-values against
    the best row of each table, and the lr sensitivity of every lr sweep."""
    finished = [r for r in runs if r.status != "incomplete"]
    if not finished:
        left = "".join(f"; left out: {why}" for why in getattr(runs, "left_out", []))
        raise ReportInputError(f"no run with summary.json to report on{left}")
    keys = list(by) if by else row_keys(runs)
    for key in keys:
        if all(value_of(r, key) is None for r in finished):
            raise ReportInputError(f"--by {key!r}: no run has this setting (expected 'attention', 'model', a key of "
                                   ".hydra/config.yaml such as recipe.lr, or a field of summary.json such as lr)")
    chosen = _select_metrics(finished, metrics, primary)
    rows: dict[tuple, Row] = {}
    for r in finished:
        values = {k: value_of(r, k) for k in keys}
        row = rows.setdefault(tuple(_hashable(v) for v in values.values()), Row(values))
        (row.excluded if r.status == "stopped" and not include_stopped else row.runs).append(r)
    for row in rows.values():
        _count_each_seed_once(row)
        for metric in chosen:
            differ = row.apart(metric)
            if differ:
                shown = ", ".join(differ[:3]) + (f" and {len(differ) - 3} more" if len(differ) > 3 else "")
                row.not_pooled.append(f"{metric} not pooled: its evaluations differ in {shown}")
                log.warning("row %s: %s", ", ".join(f"{k}={v}" for k, v in row.keys.items()), row.not_pooled[-1])
        differing = _differing(row.runs) if by else []
        if differing:  # --by pools them on purpose; say in what, as row_keys would have shown it
            where = ", ".join(f"{k}={v}" for k, v in row.keys.items())
            log.warning("row %s pools runs that differ in %s (--by leaves these settings out)", where,
                        ", ".join(differing))
    unmatched = []
    for r in runs:
        if r.status == "incomplete":
            key = tuple(_hashable(value_of(r, k)) for k in keys)
            (rows[key].incomplete if key in rows else unmatched).append(r)
    ordered = sorted(rows.values(), key=lambda row: (
        [(0, 0, "") if k == "attention" else _sort_key(row.keys[k]) for k in keys],
        _attention_sort(row.keys.get("attention"))))
    report = Report(keys, chosen, primary, ordered, [], unmatched, decimals, list(getattr(runs, "left_out", [])))
    for _, table_rows in report.tables():
        _welch_vs_best(table_rows, primary)
    report.sweeps = _lr_sweeps(ordered, num_classes)
    return report


