"""A run directory and what it holds: the plan, checkpoints, counters, signals, outputs, attempts."""
