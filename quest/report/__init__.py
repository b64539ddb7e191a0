"""Reports from finished runs: figures from each run's ``metrics.jsonl`` and ``summary.json``
(``python -m quest.report.plot``), and paper-style tables over sweeps of runs (``python -m quest.report``: mean ± std
over seeds, Welch p-values against the best formulation, learning-rate sensitivity; see docs/report.md)."""
