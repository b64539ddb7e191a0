"""Reports from finished runs: figures from each run's ``metrics.jsonl`` and ``summary.json``
(``python -m quest.report.plot``), and paper-style tables over sweeps of runs (``python -m quest.report``: mean ± std
over seeds, Welch p-values against the best formulation, learning-rate sensitivity; see docs/report.md).

Loading runs: :mod:`quest.report.runs`; grouping and statistics: :mod:`quest.report.tables` and
:mod:`quest.report.stats`; markdown and CSV: :mod:`quest.report.render`.
"""
from .render import lr_csv, lr_markdown, perf_markdown, runs_csv, runs_markdown, write_outputs
from .runs import ReportInputError, RunResult, load_runs
from .tables import DEFAULT_PRIMARY, LRSweep, Report, Row, build_report, row_keys

__all__ = ["ReportInputError", "RunResult", "load_runs", "Row", "LRSweep", "Report", "row_keys", "build_report",
           "runs_markdown", "perf_markdown", "runs_csv", "lr_markdown", "lr_csv", "write_outputs", "DEFAULT_PRIMARY"]
