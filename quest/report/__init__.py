"""Reports from finished runs: figures from each run's ``metrics.jsonl`` and ``summary.json``."""
