"""Training and evaluation loops, checkpoints, run directories and distributed set-up."""
from .checkpoint import load_checkpoint, save_checkpoint
from .distributed import DistContext, init_distributed
from .lifecycle import EXIT_DIVERGED, EXIT_INTERRUPTED, exit_code, fit, summary_line
from .progress import TrainState
from .validation_pass import evaluate

__all__ = ["fit", "exit_code", "summary_line", "evaluate", "EXIT_DIVERGED", "EXIT_INTERRUPTED", "TrainState",
           "save_checkpoint", "load_checkpoint", "DistContext", "init_distributed"]
