"""Stop requests by signal: save at the next step boundary, write the summary, then exit or requeue.

- SIGUSR1 (SLURM's pre-timeout signal of launch/train.sbatch, ``--signal=USR1@<s>``) and, under Hydra's submitit
  launcher, submitit's own preemption signal (SIGUSR2 unless ``SUBMITIT_PREEMPT_SIGNAL`` says otherwise): requeue.
  After saving and writing the summary we chain to submitit's handler where it owns the signal (it resubmits the job
  and ends the process); otherwise we run ``scontrol requeue`` and end the process (exit 0) without returning, so
  that a job runner does not record the job as finished. Either way the requeued job runs the same command in the
  same run directory and resumes from ``last.pt``.
- SIGINT (Ctrl-C) and SIGTERM (``kill``, ``scancel``): interrupt. A second one stops at once (KeyboardInterrupt),
  keeping the last checkpoint written. Where another handler owns SIGTERM (submitit bypasses it on purpose, because
  SLURM sends it with the requeue signal), we leave it alone.

The handlers only raise flags. Every optimizer step carries this rank's request (:meth:`StopSignals.request`) in the
flags it already reduces across ranks, and the loop reads the agreed answer (:meth:`StopSignals.decide`) after it, so
every process saves the same step without a collective of its own; at an epoch's end (after validation and the save)
:meth:`StopSignals.due` asks once more. Under DDP the reduced request is read at the end of the next step (or with a
logged step's values; quest.train.update), so a signal that arrives after a step's reduction is acted on at the end
of the second step after it.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from types import FrameType
from typing import Any, Callable

from quest.runtime.distributed import DistContext, all_reduce_max

log = logging.getLogger("quest.train")

__all__ = ["StopSignals", "StopRequested", "ignore_stop_signals", "REQUEUED", "INTERRUPTED", "EXIT_REQUEUED"]

REQUEUED, INTERRUPTED = "requeued", "interrupted"
#: Exit code of a job that requeued itself (it is back in the queue).
EXIT_REQUEUED = 0
_CODES = {REQUEUED: 1.0, INTERRUPTED: 2.0}  # an interrupt wins over a requeue when both arrive


class StopRequested(Exception):
    """Raised by the loop at a step boundary after a stop signal, once the checkpoint is written."""

    def __init__(self, reason: str, signal_name: str):
        super().__init__(f"{reason} by {signal_name}")
        self.reason, self.signal_name = reason, signal_name


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: Ctrl-C reaches the whole foreground process group, but only the main process
    decides; a worker killed by it would break the batch the main process still needs for a clean stop. SIGTERM
    keeps its default: it is how the main process (and multiprocessing at exit) ends its workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _foreign(handler: Any) -> bool:
    """A handler somebody else installed (not Python's or the OS default)."""
    return callable(handler) and handler is not signal.default_int_handler


class StopSignals:
    def __init__(self) -> None:
        self.reason: str | None = None
        self.signal_name: str | None = None
        self._previous: dict[int, Callable[..., Any] | int | None] = {}
        self._requeue_signum: int | None = None

    def install(self) -> "StopSignals":
        try:
            for signum in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGTERM):
                current = signal.getsignal(signum)
                if signum == signal.SIGTERM and _foreign(current):
                    continue  # e.g. submitit's bypass: the requeue signal follows
                if signum == signal.SIGUSR2 and not _foreign(current):
                    continue  # USR2 is ours only where submitit uses it as its preemption signal
                self._previous[signum] = signal.signal(signum, self._handle)
        except ValueError:  # not the main thread: no signal handling
            log.warning("signal handlers can only be installed from the main thread; stop signals are not handled")
            self.uninstall()
        return self

    def uninstall(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if signum in (signal.SIGUSR1, signal.SIGUSR2):
            self.reason = self.reason or REQUEUED
            self.signal_name = self.signal_name or name
            self._requeue_signum = self._requeue_signum or signum
            log.warning("%s received: saving at the next step, then requeueing", name)
            return
        if self.reason == INTERRUPTED:
            log.warning("second %s: stopping now; the last checkpoint written stays", name)
            raise KeyboardInterrupt(name)
        self.reason, self.signal_name = INTERRUPTED, name
        log.warning("%s received: saving at the next step, then exiting (send it again to stop at once)", name)

    def request(self) -> float:
        """This rank's pending stop request as a number for a MAX reduction: 0 none, 1 requeue, 2 interrupt."""
        return _CODES.get(self.reason, 0.0) if self.reason else 0.0

    def decide(self, agreed: float, ctx: DistContext) -> str | None:
        """The stop reason from ``agreed``, the maximum of every rank's :meth:`request` (reduced by the step), else
        None. One process needs no agreement: a signal that came after the step's flags were read counts too."""
        return self._reason(agreed if ctx.distributed else max(agreed, self.request()))

    def due(self, ctx: DistContext) -> str | None:
        """The stop reason as soon as any rank was signalled (the same answer on every rank), else None: one
        collective of its own under DDP (the loop uses it once per epoch; inside an epoch the step carries it)."""
        code = self.request()
        if ctx.distributed:
            code = all_reduce_max(code, ctx)
        return self._reason(code)

    def _reason(self, code: float) -> str | None:
        if code == 0:
            return None
        reason = INTERRUPTED if code == _CODES[INTERRUPTED] else REQUEUED
        if self.reason != reason:  # signalled on another rank only
            self.reason, self.signal_name = reason, self.signal_name or "a signal on another rank"
        return reason

    def _slurm_job(self) -> str | None:
        job_id = os.environ.get("SLURM_ARRAY_JOB_ID") or os.environ.get("SLURM_JOB_ID")
        if job_id and os.environ.get("SLURM_ARRAY_TASK_ID"):
            job_id = f"{job_id}_{os.environ['SLURM_ARRAY_TASK_ID']}"
        return job_id

    def _chained(self) -> Callable[..., Any] | None:
        """The handler we replaced for the signal that asked for the requeue, when somebody else (submitit) owns it."""
        previous = self._previous.get(self._requeue_signum or signal.SIGUSR1)
        return previous if _foreign(previous) else None

    def requeue_plan(self) -> str:
        """What :meth:`requeue` will do, for the summary written before it."""
        if self._chained() is not None:
            return "submitit resubmits the job"
        job_id = self._slurm_job()
        return f"scontrol requeue {job_id}" if job_id else "none: not a SLURM job (run the same command to resume)"

    def requeue(self, ctx: DistContext) -> None:
        """Put the job back in the queue (the caller has saved and written the summary). Under submitit its handler
        resubmits the job and ends this process."""
        previous, signum = self._chained(), self._requeue_signum or signal.SIGUSR1
        self.uninstall()
        if previous is not None:
            log.info("requeue: checkpoint saved; handing over to submitit")
            previous(signum, None)
            return
        job_id = self._slurm_job()
        if not job_id:
            log.info("%s outside SLURM: checkpoint saved; run the same command to resume", signal.Signals(signum).name)
            return
        if ctx.is_main:
            log.info("requeue: checkpoint saved; requeueing SLURM job %s", job_id)
            subprocess.run(["scontrol", "requeue", job_id], check=False)
        sys.exit(EXIT_REQUEUED)  # ended here: a job runner must not record this attempt as the job's result
