"""Rendering reports: markdown (printed and runs.md / lr_sensitivity.md) and CSV, written atomically."""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from quest.store.files import write_text_atomic
from quest.store.output_folder import holding
from quest.store.tree import refuse_present

from .markdown import markdown_table, md_text
from .runs import PERF_METRICS, RunResult
from .stats import lower_is_better, mean_std
from .tables import LR_KEYS, Report, Row

__all__ = ["runs_markdown", "runs_csv", "lr_markdown", "lr_csv", "write_outputs"]


# --- rendering ----------------------------------------------------------------------------------------------------
def _fmt_value(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (tuple, list, dict)):
        return json.dumps(value, default=str)
    if isinstance(value, str) and _looks_typed(value):
        return json.dumps(value)  # the text "0.002" quoted, never shown as the number 0.002
    return str(value)


def _looks_typed(text: str) -> bool:
    """Whether ``text`` would read as a number, a boolean or null when shown bare."""
    try:
        json.loads(text)
    except ValueError:
        return text.strip().lower() in ("nan", "inf", "-inf", "none")
    return True


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
            lines += [f"### {md_text(_context_title(context))}", ""]
        header = [*row_key_cols, "n", *report.metrics, f"p ({report.primary})", "notes"]
        body = [[*(_fmt_value(row.keys[k]) for k in row_key_cols), str(row.n),
                 *(_cell(row, m, report.decimals) for m in report.metrics),
                 "best" if row.best else _fmt_p(row.p_value), row.notes()] for row in rows]
        lines += markdown_table(header, body) + [""]
    if report.unmatched:
        lines += ["Runs without summary.json that match no row (not counted):", ""]
        lines += [f"- {md_text(r.path)}" for r in report.unmatched] + [""]
    if report.left_out:
        lines += ["Runs left out (their files cannot be believed; not counted):", ""]
        lines += [f"- {md_text(why)}" for why in report.left_out] + [""]
    return "\n".join(lines)


def perf_markdown(report: Report) -> str:
    """Where each run's time went, beside its accuracy: images/s per device, data wait, peak memory and MFU (the
    means summary.json's ``perf`` holds; docs/training.md); "" when no run has them (runs before the telemetry)."""
    runs = [r for row in report.rows for r in (*row.runs, *row.excluded)
            if any(m in r.metrics for m in PERF_METRICS)]
    if not runs:
        return ""
    header = ["run", "attention", report.primary, "img/s per device", "data wait", "peak memory", "MFU"]
    fmt = {"perf/img_per_s_per_device": "{:.0f}", "perf/data_wait": "{:.0%}", "perf/peak_mem_gib": "{:.2f} GiB",
           "perf/mfu": "{:.0%}"}
    body = [[r.path.name, _fmt_value(r.value("attention")),
             _fmt_value(round(r.metrics[report.primary], report.decimals)) if report.primary in r.metrics else "—",
             *(fmt[m].format(r.metrics[m]) if m in r.metrics else "—" for m in PERF_METRICS)] for r in runs]
    return "\n".join(["## Where the time went, per run", "",
                      "Means over each run's log intervals (peak memory: the maximum); MFU only on a GPU of known "
                      "peak; `quest-plot perf RUN_DIR ... --out perf.png` draws them over training.", "",
                      *markdown_table(header, body), ""])


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
        lines += [f"### {md_text(_context_title(sweep.keys))}", ""]
        body = []
        for lr, runs in sweep.runs_at.items():
            top1, loss = _lr_point(runs, d)
            gap = "n/a" if s is None else f"{s.gap(lr):.{d + 1}f}"
            body.append([f"{lr:g}", str(len(runs)), top1, loss, gap])
        lines += markdown_table(["lr", "n", "val/top1", "val/loss", "min(loss, loss0) - loss*"], body) + [""]
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
    lines += markdown_table(["setting", *(f"lr {lr:g}" for lr in lrs), "LR sensitivity"], body) + [""]
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


def write_outputs(report: Report, out_dir: str | Path, overwrite: bool = False) -> list[Path]:
    """runs.md (the results and, per run, where the time went) / runs.csv, and lr_sensitivity.md / .csv when there
    is an lr sweep, in ``out_dir``. Tables already there are refused (OutputExists), or with ``overwrite`` kept in
    ``out_dir/.replaced/<UTC time>/``; ``out_dir`` is held while they are written (quest.store.output_folder)."""
    out_dir = Path(out_dir)
    perf = perf_markdown(report)
    texts = {"runs.md": runs_markdown(report) + ("\n" + perf if perf else ""), "runs.csv": runs_csv(report)}
    if report.sweeps:
        texts.update({"lr_sensitivity.md": lr_markdown(report), "lr_sensitivity.csv": lr_csv(report)})
    files = [out_dir / name for name in texts]
    # a second report into out_dir is refused, never interleaved; the lock file it made goes at the end and no record
    # is kept (it replaces nothing in place), so out_dir holds the tables alone (quest.store.output_folder)
    with holding(out_dir, "quest-report", transient=True) as folder:
        refuse_present(files, overwrite)
        folder.make_room(files)
        return [write_text_atomic(out_dir / name, text if text.endswith("\n") else text + "\n")
                for name, text in texts.items()]
