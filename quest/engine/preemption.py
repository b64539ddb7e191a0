"""Pre-timeout / preemption signal (SLURM ``--signal=USR1@<s>``): save at the next step boundary, then requeue.

The handler only raises a flag; the training loop checks it between optimizer steps (agreed across ranks), writes
``last.pt`` and calls :meth:`Preemption.requeue`. Under Hydra's submitit launcher, submitit has installed its own
USR1 handler before our code runs: we chain to it, and it resubmits the job (``checkpoint()`` of the launcher).
In a plain sbatch job we run ``scontrol requeue`` ourselves. Either way the requeued job runs the same command in the
same run directory, and ``trainer.resume=auto`` continues from ``last.pt``.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from types import FrameType
from typing import Any, Callable

from .distributed import DistContext, all_reduce_max

log = logging.getLogger("quest.train")

__all__ = ["Preemption", "EXIT_REQUEUED"]

#: Exit code after a checkpoint-and-requeue (the job is back in the queue).
EXIT_REQUEUED = 0


class Preemption:
    def __init__(self, signum: int = signal.SIGUSR1):
        self.signum = signum
        self.requested = False
        self._previous: Callable[..., Any] | int | None = None
        self._installed = False

    def install(self) -> "Preemption":
        try:
            self._previous = signal.signal(self.signum, self._handle)
            self._installed = True
        except ValueError:  # not the main thread: no signal handling
            log.warning("signal handlers can only be installed from the main thread; preemption is not handled")
        return self

    def uninstall(self) -> None:
        if self._installed:
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self._installed = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def due(self, ctx: DistContext) -> bool:
        """True on every rank as soon as any rank was signalled."""
        if not ctx.distributed:
            return self.requested
        return all_reduce_max(float(self.requested), ctx) > 0

    def requeue(self, ctx: DistContext) -> None:
        """Put the job back in the queue and end this process (the caller has saved the checkpoint)."""
        previous = self._previous
        self.uninstall()
        if callable(previous):  # submitit's handler: resubmits the callable, then exits
            log.info("preempted: checkpoint saved; handing over to submitit to requeue")
            previous(self.signum, None)
        job_id = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
        if job_id and ctx.is_main:
            if os.environ.get("SLURM_ARRAY_TASK_ID"):
                job_id = f"{job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}"
            log.info("preempted: checkpoint saved; requeueing SLURM job %s", job_id)
            subprocess.run(["scontrol", "requeue", job_id], check=False)
        elif not job_id:
            log.info("signal %d received outside SLURM: checkpoint saved, exiting", self.signum)
        sys.exit(EXIT_REQUEUED)
