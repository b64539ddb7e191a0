"""The training loop (epochs, batches, optimizer steps) and the parts that own their cadence: :class:`StepLog` (the
log rows and lines), :class:`Evaluator` (validation and the best epoch), the Checkpointer (``due``: every
trainer.checkpoint_every_n_steps steps) and StopSignals (a stop request, agreed across ranks inside the step's one
collective). ``fit`` (quest.engine.lifecycle) builds them and calls :func:`train_loop`."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .checkpoint import Checkpointer
from .logger import RunLogger
from .signals import INTERRUPTED, StopRequested, StopSignals
from .trainer import BadData, Diverged, Run, hms

log = logging.getLogger("quest.train")

__all__ = ["train_loop", "Outcome", "StepLog", "Evaluator"]


@dataclass
class Outcome:
    status: str = "completed"  # completed, stopped (trainer.max_steps), diverged, bad_data, interrupted, requeued
    val: dict[str, float] = field(default_factory=dict)  # the last validation
    ending: dict[str, Any] = field(default_factory=dict)  # for the summary: the divergence, the signal, ...


def train_loop(run: Run, steps: StepLog, signals: StopSignals, checkpointer: Checkpointer,
               evaluator: Evaluator) -> Outcome:
    """Train until the run is done, diverges, fails on its data or is stopped by a signal."""
    st, tr, out = run.state, run.cfg.trainer, Outcome()

    def save_or_stop(stop: str | None, save: bool, best: bool = False) -> None:  # the one place for both
        if stop or save:
            checkpointer.save(run.stateful, run.record(steps.logger), best=best)
        if stop:
            raise StopRequested(stop, signals.signal_name or "?")

    try:
        while st.epoch < tr.epochs and (tr.max_steps is None or st.step < tr.max_steps):
            steps.start_epoch()
            for batches in run.step_batches():  # the micro-batches of one optimizer step each
                if run.diagnostics is not None and run.diagnostics.due(st.step):
                    steps.logger.log(run.diagnose(batches), st.step)
                # this rank's stop request rides in the step's one collective; every rank gets the same answer
                metrics = run.train_step(batches, log=steps.due(st.step + 1), stop=signals.request())
                stop = signals.decide(metrics.pop("stop"), run.ctx)
                run.add_skip_counts()
                steps.record(metrics, batches)
                at_max = tr.max_steps is not None and st.step >= tr.max_steps
                save_or_stop(stop, save=checkpointer.due(st.step) or at_max)
                if at_max:
                    break
            else:  # the epoch ran to its end
                steps.end_epoch()
                run.end_epoch(steps.logger)
                best = False
                if evaluator.due(st.epoch):
                    out.val, best = evaluator(run, steps.logger)
                # a signal during validation or the save: the state just written is the stop point
                save_or_stop(signals.due(run.ctx), save=True, best=best)
                continue
            steps.end_epoch()  # trainer.max_steps reached
        if st.epoch < tr.epochs:
            out.status = "stopped"  # trainer.max_steps reached first
    except Diverged as exc:
        out.status, out.ending = "diverged", {"diverged_at_step": exc.step, "divergence_reason": exc.reason}
        log.error("run diverged at step %d (%s); %s", exc.step, exc.reason,
                  f"the last good checkpoint is {checkpointer.saved()}" if checkpointer.saved() else
                  "no checkpoint was written before it")
    except BadData as exc:
        out.status, out.ending = "bad_data", {"data_failure": exc.reason}
        log.error("run failed on its data: %s", exc.reason)
    except StopRequested as exc:
        out.status, out.ending = exc.reason, {"signal": exc.signal_name, "saved": True}
    except KeyboardInterrupt as exc:  # a second Ctrl-C / SIGTERM: stopped at once, the last checkpoint stays
        out.status, out.ending = INTERRUPTED, {"signal": str(exc) or "SIGINT", "saved": False}
    return out


class StepLog:
    """The training log's cadence: a metrics row and a log line every trainer.log_every_n_steps optimizer steps and
    at the last one; images seen, throughput and training time in the run's state."""

    def __init__(self, logger: RunLogger, run: Run):
        tr = run.cfg.trainer
        self.logger, self.run, self.every = logger, run, tr.log_every_n_steps
        self.total = min(tr.epochs * run.parts.steps_per_epoch, tr.max_steps or math.inf)
        self.tic, self.images = time.perf_counter(), 0

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (counted from 1) is logged."""
        return step % self.every == 0 or step == self.total

    def start_epoch(self) -> None:
        self.tic, self.images = time.perf_counter(), 0

    def end_epoch(self) -> None:
        self.run.state.train_seconds += time.perf_counter() - self.tic

    def record(self, metrics: dict[str, Any], batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        run, st = self.run, self.run.state
        n_images = sum(len(t) for _, t in batches) * run.ctx.world_size
        st.images_seen += n_images
        self.images += n_images
        if not self.due(st.step):
            return
        elapsed = time.perf_counter() - self.tic
        st.train_seconds += elapsed
        rate = self.images / max(elapsed, 1e-9)
        row = dict(metrics)
        row.update({"train/lr": run.parts.optimizer.param_groups[0]["lr"], "train/img_per_s": rate,
                    "epoch": st.epoch + st.micro_in_epoch / run.batches_per_epoch})
        if st.train_skipped:
            row["data/train_skipped"] = st.train_skipped
        self.logger.log(row, st.step)
        eta = (self.total - st.step) * run.parts.global_batch / max(rate, 1e-9)
        log.info("epoch %d/%d step %d/%d loss %.4f lr %.3g grad %.3g %.0f img/s ETA %s", st.epoch + 1,
                 run.cfg.trainer.epochs, st.step, self.total, row["train/loss"], row["train/lr"],
                 row["train/grad_norm"], rate, hms(eta))
        self.tic, self.images = time.perf_counter(), 0


class Evaluator:
    """Validation every trainer.eval_every_n_epochs epochs and after the last, tracking the best epoch."""

    def __init__(self, every_n_epochs: int, epochs: int):
        self.every, self.epochs = every_n_epochs, epochs

    def due(self, epoch: int) -> bool:
        """Whether the run validates once ``epoch`` epochs are done."""
        return epoch % self.every == 0 or epoch == self.epochs

    def __call__(self, run: Run, logger: RunLogger) -> tuple[dict[str, float], bool]:
        """The validation metrics, and whether they are the best so far (recorded in the run's state)."""
        st = run.state
        val = run.validate(logger)
        best = val["val/top1"] > st.best_top1
        if best:
            st.best_top1, st.best_epoch = val["val/top1"], st.epoch
        return val, best
