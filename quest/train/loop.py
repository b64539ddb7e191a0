"""The training loop (epochs, batches, optimizer steps) and the parts that own their cadence: :class:`StepLog` (the
log rows and lines), :class:`Evaluator` (validation and the best epoch), the Checkpointer (``due``: every
trainer.checkpoint_every_n_steps steps) and StopSignals (a stop request, agreed across ranks inside the step's one
collective). ``fit`` (quest.train.lifecycle) builds them and calls :func:`train_loop`."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from quest.run.outputs import RunLogger
from quest.run.signals import INTERRUPTED, StopRequested, StopSignals

from .telemetry import IntervalTimes, Levers, Telemetry, compilations, perf_text
from .trainer import BadData, Diverged, Run, check_skipped, hms

log = logging.getLogger("quest.train")

__all__ = ["train_loop", "Outcome", "StepLog", "Evaluator"]


@dataclass
class Outcome:
    status: str = "completed"  # completed, stopped (trainer.max_steps), diverged, bad_data, interrupted, requeued
    val: dict[str, float] = field(default_factory=dict)  # the last validation
    ema_val: dict[str, float] = field(default_factory=dict)  # the EMA model's, once the run is done
    ending: dict[str, Any] = field(default_factory=dict)  # for the summary: the divergence, the signal, ...


def train_loop(run: Run, steps: StepLog, signals: StopSignals, evaluator: Evaluator) -> Outcome:
    """Train until the run is done, diverges, fails on its data or is stopped by a signal. The story of a run, top
    to bottom: each optimizer step (diagnostics when due, the step, its log row, a checkpoint when due or a stop
    requested), each epoch's end (its counts, validation when due, a checkpoint), and the final validation."""
    st, tr, checkpointer, out = run.state, run.cfg.trainer, run.checkpointer, Outcome()

    def save(stop: str | None = None, best: bool = False) -> None:  # a stop request always saves first
        run.check_diverged()  # no checkpoint holds weights from after a bad step (the check stays on the device)
        run.sync_counts()  # the image counts a step keeps on the host under DDP, into the state saved
        checkpointer.save(run.stateful, {**run.record(), **steps.logger.position()}, best=best)
        if stop:
            raise StopRequested(stop, signals.signal_name or "?")

    try:
        while st.epoch < tr.epochs and not run.at_max_steps():
            steps.start_epoch()
            for batches in run.step_batches():  # the micro-batches of one optimizer step each
                if run.diagnostics is not None and run.diagnostics.due(st.step):
                    steps.logger.log(run.diagnose(batches), st.step)
                # this rank's stop request rides in the step's one collective; every rank gets the same answer
                # (docs/training.md, "The training loop": one process acts at once, DDP one step later)
                metrics = run.train_step(batches, log=steps.due(st.step + 1), stop=signals.request())
                stop = signals.decide(metrics.pop("stop"), run.ctx)
                steps.record(metrics, batches)
                if stop or checkpointer.due(st.step) or run.at_max_steps():
                    save(stop)
                if run.at_max_steps():
                    break
            else:  # the epoch ran to its end
                steps.end_epoch(run.end_epoch())  # its training time and data counts
                run.check_skipped()
                best = False
                if evaluator.due(st.epoch):
                    out.val, best = evaluator(run)
                # a signal during validation or the save: the state just written is the stop point
                save(signals.due(run.ctx), best=best)
                continue
            steps.end_epoch(None)  # trainer.max_steps reached
        if st.epoch < tr.epochs:
            out.status = "stopped"  # trainer.max_steps reached first
        out.val, out.ema_val = evaluator.final(run, out.val)
    except Diverged as exc:
        # the bad step's update and those after it were skipped: the run holds the weights of the step before it
        out.status, out.ending = "diverged", {"diverged_at_step": exc.step, "divergence_reason": exc.reason,
                                              "step": exc.step - 1}
        log.error("run diverged at step %d (%s); its weights are those of step %d; %s", exc.step, exc.reason,
                  exc.step - 1,
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
    at the last one; images seen, throughput and training time in the run's state. The attempt's first step also
    gets a line when it is not due (a first step can take minutes and the first due one an epoch): its time and the
    step of the next line, with no row and nothing read from the device. Each step's host time goes to
    the telemetry split three ways (quest.train.telemetry.IntervalTimes): steps that compiled and the wait for an
    epoch's first batches apart, the steady steps in the figures and the advice."""

    def __init__(self, logger: RunLogger, run: Run, telemetry: Telemetry):
        tr = run.cfg.trainer
        self.logger, self.run, self.every, self.telemetry = logger, run, tr.log_every_n_steps, telemetry
        self.total = min(tr.epochs * run.parts.steps_per_epoch, tr.max_steps or math.inf)
        telemetry.levers = Levers.of(run.cfg, run.ctx.device, run.precision)  # advice names no setting that is on
        self.attempt_started = False  # whether this attempt has made a step
        self.start_epoch()

    def due(self, step: int) -> bool:
        """Whether optimizer step ``step`` (counted from 1) is logged."""
        return step % self.every == 0 or step == self.total

    def start_epoch(self) -> None:
        self.tic, self.images, self.times = time.perf_counter(), 0, IntervalTimes()
        self.last, self.first, self.compiles = self.tic, True, compilations()  # a compile in validation is not a step's
        self.run.take_data_wait()  # waiting between epochs (validation, the save) is not the loader's

    def end_epoch(self, row: dict[str, Any] | None) -> None:
        """The epoch's training time into the run's state; ``row`` (Run.end_epoch's data counts) into the log; the
        telemetry's advice for the epoch (once per epoch) into train.log."""
        elapsed = time.perf_counter() - self.tic
        self.run.state.trained_for(elapsed)
        if row:
            self.logger.log(row, self.run.state.step)
        rest = self.times  # the steady steps since the last log line, and the time apart among them
        for advice in self.telemetry.end_epoch(self.run.state.epoch_number, rest.seconds, rest.data_wait, rest.apart):
            log.warning(advice)
        self.run.state.measured(self.telemetry.totals())  # the attempt's record, for the checkpoint after this

    def record(self, metrics: dict[str, Any], batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        run, st = self.run, self.run.state
        n_images = sum(len(t) for _, t in batches) * run.ctx.world_size  # the state counted them at the step
        self.images += n_images
        now, compiles = time.perf_counter(), compilations()  # host counters: no device synchronisation
        self.times.add_step(now - self.last, run.take_data_wait(), n_images, compiles != self.compiles, self.first)
        self.last, self.compiles, self.first = now, compiles, False
        if not self.due(st.step):
            if not self.attempt_started:
                self._first_step(now)
            return
        self.attempt_started = True
        elapsed = now - self.tic
        st.trained_for(elapsed)
        t = self.times
        rate = t.images / max(t.seconds, 1e-9) if t.steps else self.images / max(elapsed, 1e-9)  # the steady rate
        perf = self.telemetry.interval(t.seconds, t.data_wait, t.images, t.steps, t.apart)
        st.measured(self.telemetry.totals())  # the attempt's record, for a checkpoint and the summary
        row = dict(metrics)
        row.update({"train/lr": run.parts.optimizer.param_groups[0]["lr"], "train/img_per_s": rate,
                    "epoch": st.epochs_done(run.batches_per_epoch), **perf})
        if st.train_skipped:
            row["data/train_skipped"] = st.train_skipped
        self.logger.log(row, st.step)
        eta = (self.total - st.step) * run.parts.global_batch / max(rate, 1e-9)
        log.info("epoch %d/%d step %d/%d loss %.4f lr %.3g grad %.3g %.0f img/s ETA %s | %s", st.epoch + 1,
                 run.cfg.trainer.epochs, st.step, self.total, row["train/loss"], row["train/lr"],
                 row["train/grad_norm"], rate, hms(eta), perf_text(perf))
        self.tic = self.last = time.perf_counter()  # the logging's own time is in no interval
        self.images, self.times = 0, IntervalTimes()

    def _first_step(self, now: float) -> None:
        """The line after the attempt's first step when that step is not logged: its time from the epoch's start
        (the loader's start and any compilation in it) and where the next line comes."""
        self.attempt_started = True
        st, tr = self.run.state, self.run.cfg.trainer
        following = min((st.step // self.every + 1) * self.every, self.total)
        log.info("epoch %d/%d step %d/%d: first step %.2f s (loader start and compilation included); next line at "
                 "step %d", st.epoch + 1, tr.epochs, st.step, self.total, now - self.tic, following)


class Evaluator:
    """Validation every trainer.eval_every_n_epochs epochs and after the last, tracking the best epoch in the run's
    state and logging each pass; once the run is done, the model (unless just validated) and its EMA."""

    def __init__(self, logger: RunLogger, every_n_epochs: int, epochs: int):
        self.logger, self.every, self.epochs = logger, every_n_epochs, epochs

    def due(self, epoch: int) -> bool:
        """Whether the run validates once ``epoch`` epochs are done."""
        return epoch % self.every == 0 or epoch == self.epochs

    def __call__(self, run: Run) -> tuple[dict[str, float], bool]:
        """The validation metrics, and whether they are the best so far (recorded in the run's state)."""
        val = self._validate(run)
        return val, run.state.validated(val["val/top1"])

    def final(self, run: Run, val: dict[str, float]) -> tuple[dict[str, float], dict[str, float]]:
        """The run ended normally: its last validation (validated now when the last step was not an epoch's end
        that validated; not a candidate for best.pt, which is written at epoch ends) and the EMA model's."""
        val = val or self._validate(run)
        ema = run.parts.ema
        return val, run.validate(ema.module, prefix="val_ema/")[0] if ema is not None else {}

    def _validate(self, run: Run) -> dict[str, float]:
        st = run.state
        val, diag = run.validate()
        self.logger.log({**val, **diag, "epoch": st.epochs_done(run.batches_per_epoch)}, st.step)
        check_skipped("validation", int(val["val/skipped"]), int(val["val/skipped"] + val["val/images"]),
                      run.cfg.data.get("max_skipped_fraction", 0.01))
        within = f" at step {st.step}" if st.micro_in_epoch else ""  # stopped inside an epoch (trainer.max_steps)
        log.info("epoch %d%s: val top-1 %.2f top-5 %.2f loss %.4f", st.epoch_number, within, val["val/top1"],
                 val["val/top5"], val["val/loss"])
        return val
