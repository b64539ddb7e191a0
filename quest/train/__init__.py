"""Training: the config's checks, the parts built from it (builders), one optimizer step (trainer, update, guard),
the loop, and :func:`fit`, one run from its start or resume to its summary."""
from .lifecycle import EXIT_DIVERGED, EXIT_INTERRUPTED, exit_code, fit, summary_line

__all__ = ["fit", "exit_code", "summary_line", "EXIT_DIVERGED", "EXIT_INTERRUPTED"]
