"""Paper-style tables from sweeps of training runs (QUEST paper Tables 1, A1 and A3): ``python -m quest.report``.

A run is a directory with ``summary.json`` (written by quest.engine.fit), ``run.json`` (its config; older runs:
``.hydra/config.yaml``, written by Hydra for ``python train.py``) and
``eval/<suite>/<checkpoint stem>-<model|ema>/eval_results.json`` (written by ``eval.py``). Runs are grouped
into rows by formulation, model and every other setting that varies across them, except the seed; the seeds are the
repetitions. Definitions of every column: docs/report.md.
"""
from __future__ import annotations

import csv
import io
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from quest.schema import OPERATIONAL_KEYS

from .stats import LRSensitivity, init_loss, lower_is_better, lr_sensitivity, mean_std, welch_p

__all__ = ["ReportInputError", "RunResult", "Row", "LRSweep", "Report", "load_runs", "row_keys", "build_report",
           "runs_markdown", "runs_csv", "lr_markdown", "lr_csv", "write_outputs", "DEFAULT_PRIMARY"]

DEFAULT_PRIMARY = "val/top1"
#: Settings that repeat an experiment rather than define it: the seeds.
REPEAT_KEYS = ("trainer.seed", "data.subset_seed", "seed")
#: Settings that never define a row: where and how a run was executed and logged, not what was trained; and
#: trainer.max_steps, a cap that stops a run early: such a run is marked "stopped" in its setting's row instead.
IGNORED_KEYS = (*(k.removesuffix(".*") for k in OPERATIONAL_KEYS), "trainer.init_from", "trainer.eval_every_n_epochs",
                "data.root", "diagnostics", "run_dir")
#: Settings that set the learning rate: an lr sweep differs in these only.
LR_KEYS = ("recipe.lr", "recipe.base_lr", "lr")
#: Leaf names of the eval_results.json numbers shown by default (the rest: --metrics, e.g. 'imagenet_c/ce/*').
EVAL_HEADLINE = ("top1", "mce", "relative_mce", "mean_error", "relative_mean_error")
# Formulations in the order of the paper's Table 1; others follow alphabetically.
_ATTENTION_ORDER = ("standard", "qnorm", "qknorm", "qknorm_ds", "qknorm_hs", "quest")


class ReportInputError(ValueError):
    """Input that cannot be reported on; the message names the path or option and what was expected."""


# --- loading ----------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    """One run directory: status completed | stopped | diverged | incomplete (no summary.json yet)."""

    path: Path
    status: str
    summary: dict[str, Any]  # summary.json, nested dicts flattened to dotted keys ("choices.model")
    config: dict[str, Any] | None  # run.json's config (or .hydra/config.yaml), resolved and flattened; None without
    metrics: dict[str, float]  # numbers of summary.json and of eval/<suite>/<stem>-<weights>/eval_results.json

    def value(self, key: str) -> Any:
        """A setting: ``attention`` / ``model`` (the formulation and timm name), else a config key, else a summary
        field."""
        if key in ("attention", "model"):
            if isinstance(self.summary.get(key), str):
                return self.summary[key]
            return (self.config or {}).get(f"{key}.name")
        if self.config is not None and key in self.config:
            return self.config[key]
        return self.summary.get(key)

    @property
    def lr(self) -> float | None:
        lr = self.summary.get("lr")  # the lr the run actually used (base_lr already scaled by the batch)
        lr = lr if lr is not None else (self.config or {}).get("recipe.lr")
        return float(lr) if isinstance(lr, (int, float)) else None


def _flatten(tree: Any, prefix: str = "", sep: str = ".") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}{sep}{key}" if prefix else str(key), sep))
        return out
    return {prefix: tuple(tree) if isinstance(tree, list) else tree}


def _number(value: Any) -> float | None:
    """JSON numbers, and the strings 'nan' / 'inf' that the writers use for non-finite values; not booleans."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value)
    return None


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ReportInputError(f"{path}: cannot read {what} ({err})") from None
    if not isinstance(data, dict):
        raise ReportInputError(f"{path}: expected a JSON object ({what}), got {type(data).__name__}")
    return data


def _read_config(run_dir: Path) -> dict[str, Any] | None:
    """The run's own record of its config (run.json, written by quest.engine.fit), else Hydra's copy of the latest
    command's config for runs written before run.json existed."""
    record = run_dir / "run.json"
    if record.is_file():
        config = _read_json(record, "the run record written by train.py").get("config")
        if isinstance(config, dict):
            return _flatten(config)
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        return None
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(path)
    try:
        tree = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an interpolation that needs Hydra's runtime: compare the unresolved text instead
        tree = OmegaConf.to_container(cfg, resolve=False)
    return _flatten(tree)


def _eval_suffix(target: dict[str, Any]) -> str:
    """How an evaluation's columns say which weights were evaluated: nothing for last.pt's model weights (the
    headline, as DeiT reports), ``_ema`` for the EMA weights (like val_ema/), ``@<stem>`` for another checkpoint."""
    suffix = "_ema" if target.get("weights") == "ema" else ""
    checkpoint = target.get("checkpoint")
    if isinstance(checkpoint, str) and Path(checkpoint).stem != "last":
        suffix += f"@{Path(checkpoint).stem}"
    return suffix


def _eval_metrics(run_dir: Path) -> dict[str, float]:
    """Numbers of every <run>/eval/<suite>/<stem>-<model|ema>/eval_results.json (and the older
    <run>/eval/<suite>/eval_results.json) as '<evaluation><suffix>/<path>' (e.g. 'imagenet_c/mce',
    'imagenet_v2_ema/top1'); an evaluation present in two suites takes the more recently written file."""
    files = sorted({*run_dir.glob("eval/*/eval_results.json"), *run_dir.glob("eval/*/*/eval_results.json")},
                   key=lambda p: p.stat().st_mtime)
    out: dict[str, float] = {}
    for path in files:
        report = _read_json(path, "evaluation results")
        results = report.get("results")
        if not isinstance(results, dict):
            raise ReportInputError(f"{path}: no 'results' object (expected eval.py's eval_results.json)")
        target = report.get("target") if isinstance(report.get("target"), dict) else {}
        suffix = _eval_suffix(target)
        for evaluation, result in results.items():
            for key, value in _flatten({f"{evaluation}{suffix}": result}, sep="/").items():
                number = _number(value)
                if number is not None:
                    out[key] = number
    return out


def _load_run(run_dir: Path) -> RunResult:
    summary_path = run_dir / "summary.json"
    config = _read_config(run_dir)
    if not summary_path.is_file():
        return RunResult(run_dir, "incomplete", {}, config, {})
    raw = _read_json(summary_path, "the run summary written by train.py")
    status = raw.get("status")
    if status in ("interrupted", "requeued"):  # saved by a signal and not finished: like a run still going
        return RunResult(run_dir, "incomplete", {}, config, {})
    if status not in ("completed", "stopped", "diverged"):
        raise ReportInputError(f"{summary_path}: status {status!r}, expected completed, stopped, diverged, "
                               "interrupted or requeued")
    metrics = {k: n for k, v in raw.items() if not isinstance(v, dict) and (n := _number(v)) is not None}
    metrics.update(_eval_metrics(run_dir))
    return RunResult(run_dir, status, _flatten(raw), config, metrics)


def _run_files(sweep: Path, name: str) -> list[Path]:
    """``name`` files of the runs under ``sweep``, not those under hidden directories (a replaced run's archive in
    <run>/.replaced/, submitit's logs)."""
    return [p for p in sweep.rglob(name) if not any(part.startswith(".") for part in p.relative_to(sweep).parts)]


def load_runs(sweep_dirs: Sequence[str | Path]) -> list[RunResult]:
    """Every run under the sweep directories (recursively): each directory with summary.json, and each with
    metrics.jsonl but no summary.json yet (incomplete: running, or killed before the end)."""
    if not sweep_dirs:
        raise ReportInputError("no sweep directories given")
    runs: dict[Path, RunResult] = {}
    for sweep in map(Path, sweep_dirs):
        expected = "a sweep directory holding run directories written by train.py, each with summary.json"
        if not sweep.is_dir():
            raise ReportInputError(f"{sweep}: {'not a directory' if sweep.exists() else 'does not exist'} "
                                   f"(expected {expected})")
        finished = {p.parent for p in _run_files(sweep, "summary.json")}
        unfinished = {p.parent for p in _run_files(sweep, "metrics.jsonl")} - finished
        if not finished:
            more = f"; {len(unfinished)} run directories have metrics.jsonl but no summary.json yet" \
                if unfinished else ""
            raise ReportInputError(f"{sweep}: no summary.json under it (expected {expected}){more}")
        for run_dir in sorted(finished | unfinished):
            runs.setdefault(run_dir.resolve(), _load_run(run_dir))  # overlapping arguments: each run once
    return list(runs.values())


# --- grouping -----------------------------------------------------------------------------------------------------
def _ignored(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in (*REPEAT_KEYS, *IGNORED_KEYS))


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True, default=str) if isinstance(value, (dict, list)) else value


def row_keys(runs: Sequence[RunResult]) -> list[str]:
    """The settings that tell rows apart: attention and model, the recipe and data set names when they differ
    between runs, and every other setting that differs between runs of one (attention, model, recipe, data).

    Settings come from .hydra/config.yaml when every finished run has one, else from summary.json (the Hydra
    choices, the lr actually used and the global batch). Seeds and settings of execution and logging never count.
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
    varying = [k for k in candidates if not _ignored(k)
               and any(len({_hashable(r.value(k)) for r in cell}) > 1 for cell in cells.values())]
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
    p_value: float | None = None  # Welch vs the best row of its table, on the primary metric
    best: bool = False

    @property
    def n(self) -> int:
        return len(self.runs)

    @property
    def n_diverged(self) -> int:
        return sum(r.status == "diverged" for r in self.runs)

    def values(self, metric: str) -> list[float]:
        """The metric of every counted run that has it (seed order); empty when any counted run diverged."""
        if self.n_diverged:
            return []
        runs = sorted(self.runs, key=lambda r: _sort_key(r.value("seed")))
        return [r.metrics[metric] for r in runs if metric in r.metrics]

    def stat(self, metric: str) -> tuple[float, float | None, int] | None:
        """(mean, sample std or None, number of runs) of the metric, None when there is nothing to average."""
        values = self.values(metric)
        return (*mean_std(values), len(values)) if values else None

    def notes(self) -> str:
        stopped = sum(r.status == "stopped" for r in self.runs)
        parts = [f"includes {stopped} stopped" if stopped else "",
                 f"{len(self.excluded)} stopped (excluded)" if self.excluded else "",
                 f"{len(self.incomplete)} incomplete (no summary.json)" if self.incomplete else ""]
        return "; ".join(p for p in parts if p)


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


def build_report(runs: Sequence[RunResult], metrics: Sequence[str] | None = None, by: Sequence[str] | None = None,
                 primary: str = DEFAULT_PRIMARY, include_stopped: bool = False, num_classes: int | None = None,
                 decimals: int = 2) -> Report:
    """Group ``runs`` into rows (``by`` or :func:`row_keys`), take mean ± std per metric, Welch p-values against
    the best row of each table, and the lr sensitivity of every lr sweep."""
    finished = [r for r in runs if r.status != "incomplete"]
    if not finished:
        raise ReportInputError("no run with summary.json to report on")
    keys = list(by) if by else row_keys(runs)
    for key in keys:
        if all(r.value(key) is None for r in finished):
            raise ReportInputError(f"--by {key!r}: no run has this setting (expected 'attention', 'model', a key of "
                                   ".hydra/config.yaml such as recipe.lr, or a field of summary.json such as lr)")
    chosen = _select_metrics(finished, metrics, primary)
    rows: dict[tuple, Row] = {}
    for r in finished:
        values = {k: r.value(k) for k in keys}
        row = rows.setdefault(tuple(_hashable(v) for v in values.values()), Row(values))
        (row.excluded if r.status == "stopped" and not include_stopped else row.runs).append(r)
    unmatched = []
    for r in runs:
        if r.status == "incomplete":
            key = tuple(_hashable(r.value(k)) for k in keys)
            (rows[key].incomplete if key in rows else unmatched).append(r)
    ordered = sorted(rows.values(), key=lambda row: (
        [(0, 0, "") if k == "attention" else _sort_key(row.keys[k]) for k in keys],
        _attention_sort(row.keys.get("attention"))))
    report = Report(keys, chosen, primary, ordered, [], unmatched, decimals)
    for _, table_rows in report.tables():
        _welch_vs_best(table_rows, primary)
    report.sweeps = _lr_sweeps(ordered, num_classes)
    return report


# --- rendering ----------------------------------------------------------------------------------------------------
def _fmt_value(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return "[" + ", ".join(map(str, value)) + "]"
    return str(value)


def _decimals(metric: str, decimals: int) -> int:
    # losses and NLLs are a few nats: one more decimal than the percentages
    return decimals + 1 if metric.split("/")[-1] in ("loss", "nll") else decimals


def _fmt_p(p: float | None) -> str:
    if p is None:
        return "n/a"
    return f"{p:.3f}" if p >= 0.001 else f"{p:.1e}"


def _cell(row: Row, metric: str, decimals: int) -> str:
    if row.n_diverged:
        return f"diverged ({row.n_diverged}/{row.n})"
    stat = row.stat(metric)
    if stat is None:
        return "—"
    mean, std, n = stat
    d = _decimals(metric, decimals)
    text = f"{mean:.{d}f}" if std is None else f"{mean:.{d}f} ± {std:.{d}f}"
    return text if n == row.n else f"{text} (n={n})"


def _md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    esc: Callable[[str], str] = lambda s: str(s).replace("|", "\\|")
    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(map(esc, row)) + " |" for row in rows]


def _context_title(context: dict[str, Any]) -> str:
    return ", ".join(f"{k}={_fmt_value(v)}" for k, v in context.items()) or "all runs"


def runs_markdown(report: Report) -> str:
    """Table 1 / A1 style: one table per setting, a row per formulation (mean ± std over seeds, n, Welch p)."""
    direction = "lower" if lower_is_better(report.primary) else "higher"
    lines = ["## Results: mean ± std over seeds", "",
             f"Primary metric {report.primary} ({direction} is better); p: two-sided Welch t-test against the "
             "best row of the table on the primary metric.", ""]
    if any(row.excluded for row in report.rows):
        lines += ["Runs stopped at trainer.max_steps are left out of the means (see notes); --include-stopped "
                  "averages them too.", ""]
    row_key_cols = ["attention"] if "attention" in report.keys else [k for k in report.keys]
    for context, rows in report.tables():
        if "attention" in report.keys:
            lines += [f"### {_context_title(context)}", ""]
        header = [*row_key_cols, "n", *report.metrics, f"p ({report.primary})", "notes"]
        body = [[*(_fmt_value(row.keys[k]) for k in row_key_cols), str(row.n),
                 *(_cell(row, m, report.decimals) for m in report.metrics),
                 "best" if row.best else _fmt_p(row.p_value), row.notes()] for row in rows]
        lines += _md_table(header, body) + [""]
    if report.unmatched:
        lines += ["Runs without summary.json that match no row (not counted):", ""]
        lines += [f"- {r.path}" for r in report.unmatched] + [""]
    return "\n".join(lines)


def runs_csv(report: Report) -> str:
    """One line per row: its settings, run counts, then mean, std and n per metric (empty when undefined)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    metric_cols = [f"{m} {s}" for m in report.metrics for s in ("mean", "std", "n")]
    writer.writerow([*report.keys, "n", "diverged", "stopped_excluded", "incomplete", *metric_cols,
                     "best", f"p_welch {report.primary}", "notes"])
    for row in report.rows:
        cells: list[Any] = []
        for m in report.metrics:
            stat = row.stat(m)
            cells += ["", "", 0] if stat is None else [repr(stat[0]), "" if stat[1] is None else repr(stat[1]), stat[2]]
        writer.writerow([*(_fmt_value(row.keys[k]) for k in report.keys), row.n, row.n_diverged, len(row.excluded),
                         len(row.incomplete), *cells, row.best, "" if row.p_value is None else repr(row.p_value),
                         row.notes()])
    return buf.getvalue()


def _lr_point(runs: list[RunResult], decimals: int) -> tuple[str, str]:
    """(val/top1 cell, val/loss cell) at one lr of a sweep."""
    diverged = sum(r.status == "diverged" for r in runs)
    if diverged:
        text = f"diverged ({diverged}/{len(runs)})" if len(runs) > 1 else "diverged"
        return text, text
    cells = []
    for metric in ("val/top1", "val/loss"):
        values = [r.metrics[metric] for r in runs if metric in r.metrics]
        if not values:
            cells.append("—")
            continue
        mean, std = mean_std(values)
        d = _decimals(metric, decimals)
        cells.append(f"{mean:.{d}f}" if std is None else f"{mean:.{d}f} ± {std:.{d}f}")
    return cells[0], cells[1]


def lr_markdown(report: Report) -> str:
    """Table A3 style: val/top1 at each lr of every lr sweep, and its lr sensitivity (Wortsman et al. 2024)."""
    if not report.sweeps:
        return ""
    d = report.decimals
    lines = ["## Learning-rate sensitivity", "",
             "LR sensitivity (Wortsman et al. 2024) = mean over the sweep's lrs of min(loss(lr), loss0) - loss*, "
             "with loss = final val/loss (mean over seeds), a diverged run counted as loss0 = ln(num_classes) "
             "(the cross-entropy of a uniform prediction) and loss* = the smallest loss of the sweep.", ""]
    for sweep in report.sweeps:
        s = sweep.sensitivity
        lines += [f"### {_context_title(sweep.keys)}", ""]
        body = []
        for lr, runs in sweep.runs_at.items():
            top1, loss = _lr_point(runs, d)
            gap = "n/a" if s is None else f"{s.gap(lr):.{d + 1}f}"
            body.append([f"{lr:g}", str(len(runs)), top1, loss, gap])
        lines += _md_table(["lr", "n", "val/top1", "val/loss", "min(loss, loss0) - loss*"], body) + [""]
        if s is None:
            lines += ["LR sensitivity: n/a (the number of classes is unknown: pass --num-classes)", ""]
        else:
            e = d + 1
            lines += [f"LR sensitivity: **{s.value:.{e}f}** (loss0 = ln({sweep.num_classes}) = {s.loss0:.{e}f}, "
                      f"loss* = {s.loss_star:.{e}f})", ""]
    lrs = sorted({lr for sweep in report.sweeps for lr in sweep.runs_at})
    body = []
    for sweep in report.sweeps:
        cells = [_lr_point(sweep.runs_at[lr], d)[0] if lr in sweep.runs_at else "—" for lr in lrs]
        value = "n/a" if sweep.sensitivity is None else f"{sweep.sensitivity.value:.{d + 1}f}"
        body.append([_context_title(sweep.keys), *cells, value])
    lines += ["### val/top1 by learning rate", ""]
    lines += _md_table(["setting", *(f"lr {lr:g}" for lr in lrs), "LR sensitivity"], body) + [""]
    return "\n".join(lines)


def lr_csv(report: Report) -> str:
    """One line per (sweep, lr): settings, lr, run counts, val/top1 and val/loss mean, capped loss, sensitivity."""
    keys = [k for k in report.keys if k not in LR_KEYS]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([*keys, "lr", "n", "diverged", "val/top1 mean", "val/top1 std", "val/loss mean",
                     "capped_loss", "loss_star", "loss0", "lr_sensitivity"])
    for sweep in report.sweeps:
        s = sweep.sensitivity
        for lr, runs in sweep.runs_at.items():
            ok = [r for r in runs if r.status != "diverged"]
            diverged = len(runs) - len(ok)
            top1 = [r.metrics["val/top1"] for r in ok if "val/top1" in r.metrics]
            loss = [r.metrics["val/loss"] for r in ok if "val/loss" in r.metrics]
            top1_stat = mean_std(top1) if top1 and not diverged else None
            writer.writerow([
                *(_fmt_value(sweep.keys.get(k)) for k in keys), repr(lr), len(runs), diverged,
                "" if top1_stat is None else repr(top1_stat[0]),
                "" if top1_stat is None or top1_stat[1] is None else repr(top1_stat[1]),
                repr(mean_std(loss)[0]) if loss and not diverged else "",
                *(("", "", "", "") if s is None else (repr(s.loss_at[lr]), repr(s.loss_star), repr(s.loss0),
                                                      repr(s.value))),
            ])
    return buf.getvalue()


def write_outputs(report: Report, out_dir: str | Path) -> list[Path]:
    """runs.md / runs.csv, and lr_sensitivity.md / .csv when there is an lr sweep, in ``out_dir``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = {"runs.md": runs_markdown(report), "runs.csv": runs_csv(report)}
    if report.sweeps:
        texts.update({"lr_sensitivity.md": lr_markdown(report), "lr_sensitivity.csv": lr_csv(report)})
    paths = []
    for name, text in texts.items():
        path = out_dir / name
        path.write_text(text if text.endswith("\n") else text + "\n")
        paths.append(path)
    return paths
