"""Training and evaluation loops, checkpoints and distributed set-up."""
from .checkpoint import load_checkpoint, save_checkpoint
from .distributed import DistContext, init_distributed
from .evaluate import evaluate
from .trainer import EXIT_DIVERGED, TrainState, fit

__all__ = ["fit", "evaluate", "EXIT_DIVERGED", "TrainState", "save_checkpoint", "load_checkpoint",
           "DistContext", "init_distributed"]
