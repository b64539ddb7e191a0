"""A run's counters: :class:`TrainState`, the one object that says where a training run stands (steps, epochs, the
best validation, images seen and skipped, training time, and each attempt's share of them) and the only code that
changes those counters.

It is a stateful part like the model or the optimizer: the Checkpointer saves its ``state_dict()`` as the
checkpoint record's ``state`` field and restores it with ``load_state_dict()``. Everything else reads it.

An attempt (:class:`Attempt`) is one process's part of a run: a start, or a resume, to its end or, when it was killed,
to the last checkpoint it wrote (what it did after that is done again by the next attempt). The checkpoint carries
every earlier attempt's record, so that summary.json's ``perf`` and ``wall_time_s`` cover the whole run
(:func:`run_perf`: the whole run's figures first, then each attempt's own). A figure's mean over several attempts is
the time-weighted mean over all their log intervals (the sum of value x seconds over the sum of seconds), as within
one attempt; a maximum is the largest of any; counts and times add up.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from quest.store.records import bounded, check_fields
from quest.store.run_files import RECORDED_THREADS

__all__ = ["TrainState", "Attempt", "Figure", "figures", "run_perf"]


@dataclass
class Figure:
    """One telemetry figure (``perf/data_wait``, ...) over an attempt's log intervals (quest.train.telemetry): the
    sum of value x interval seconds, the seconds (the time-weighted mean is their ratio), the largest value."""

    weighted: float = field(default=0.0, metadata=bounded(0.0))
    seconds: float = field(default=0.0, metadata=bounded(0.0))
    largest: float = field(default=0.0, metadata=bounded(0.0))


@dataclass
class Attempt:
    """One attempt's counts and times (the run's are their sums) and its telemetry's totals."""

    first_step: int = field(default=0, metadata=bounded(0))  # the number of its first step (counted from 1)
    steps: int = field(default=0, metadata=bounded(0))  # optimizer steps it took
    images: int = field(default=0, metadata=bounded(0))  # images (all processes) it trained on
    train_s: float = field(default=0.0, metadata=bounded(0.0))  # its training time (TrainState.train_seconds' share)
    wall_s: float = field(default=0.0, metadata=bounded(0.0))  # from its process's start of the run to now / its save
    # the telemetry's time apart (quest.train.telemetry.Apart) and its figures, by name without "perf/"
    compile_s: float = field(default=0.0, metadata=bounded(0.0))
    compile_steps: int = field(default=0, metadata=bounded(0))
    loader_start_s: float = field(default=0.0, metadata=bounded(0.0))
    figures: dict[str, Figure] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> Attempt:
        """An attempt from its dict (a checkpoint's, its types and ranges checked); a key it does not know is
        refused by name."""
        figures = saved.get("figures", {})
        for keys, record, where in [(set(saved), cls, "an attempt"),
                                    *((set(f), Figure, f"figure {n!r}") for n, f in figures.items())]:
            unknown = sorted(keys - {f.name for f in fields(record)})
            if unknown:
                raise ValueError(f"a checkpoint's training state holds {unknown} in {where}, which this quest does "
                                 f"not know (it knows {sorted(f.name for f in fields(record))})")
        return cls(**{**saved, "figures": {name: Figure(**figure) for name, figure in figures.items()}})


@dataclass
class TrainState:
    # each counter's range is checked when a checkpoint's state is read back (quest.store.records)
    step: int = field(default=0, metadata=bounded(0))  # optimizer steps taken
    epoch: int = field(default=0, metadata=bounded(0))  # epochs completed
    micro_in_epoch: int = field(default=0, metadata=bounded(0))  # batches of the current epoch already consumed
    best_top1: float = field(default=-1.0, metadata=bounded(-1.0, 100.0))  # -1: not validated yet
    best_epoch: int = field(default=-1, metadata=bounded(-1))
    images_seen: int = field(default=0, metadata=bounded(0))
    train_seconds: float = field(default=0.0, metadata=bounded(0.0))
    wandb_id: str | None = None
    #: unreadable training images skipped (data.bad_images=skip), all ranks, whole run
    train_skipped: int = field(default=0, metadata=bounded(0))
    train_drawn: int = field(default=0, metadata=bounded(0))  # training images drawn, readable or not, all ranks
    #: a CPU run's intra-op threads from its first start (quest.train.compute.run_threads); None on a GPU
    torch_threads: int | None = field(default=None, metadata=RECORDED_THREADS)
    #: the run's attempts, this process's last (begun by its first count); each earlier one as of the last checkpoint
    #: it wrote. A state saved before attempts were recorded has none: the attempts are recorded from its resume on.
    attempts: list[Attempt] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._clock = time.perf_counter()  # this process's start of the run: its attempt's wall time runs from here

    # --- what changes it, in the order a run meets them -----------------------------------------------------------
    def drew_batch(self) -> None:
        """One micro-batch of the current epoch was taken from the loader (trained on or, all unreadable, not)."""
        self.micro_in_epoch += 1

    def add_drawn(self, skipped: int, drawn: int) -> None:
        """Images drawn and skipped as unreadable, summed over every process."""
        self.train_skipped += skipped
        self.train_drawn += drawn

    def _attempt(self) -> Attempt:
        """This process's attempt, begun at the current step when it has none yet."""
        if not self.attempts:
            self.attempts.append(Attempt(first_step=self.step + 1))
        return self.attempts[-1]

    def resumed(self) -> None:
        """This process continues the run from a checkpoint's state: a new attempt from the current step."""
        self.attempts.append(Attempt(first_step=self.step + 1))

    def took_step(self, images: int) -> None:
        """An optimizer step over ``images`` (all processes) was taken: counted where it is taken, before the host
        read that may find it bad, so that a run's steps and images agree however it ends."""
        attempt = self._attempt()  # begun at the step before this one
        self.step += 1
        attempt.steps += 1
        self.images_seen += images
        attempt.images += images

    def trained_for(self, seconds: float) -> None:
        """Wall time spent training (validation and checkpoints excluded), added at each log line and epoch end."""
        self.train_seconds += seconds
        self._attempt().train_s += seconds

    def measured(self, totals: dict[str, Any]) -> None:
        """The telemetry's totals of this attempt so far (quest.train.telemetry.Telemetry.totals)."""
        attempt = self._attempt()
        attempt.compile_s, attempt.compile_steps = totals["compile_s"], totals["compile_steps"]
        attempt.loader_start_s, attempt.figures = totals["loader_start_s"], dict(totals["figures"])

    def end_epoch(self) -> None:
        self.epoch += 1
        self.micro_in_epoch = 0

    def epochs_done(self, batches_per_epoch: int) -> float:
        """Epochs done, with the share of one under way: a metrics row's ``epoch``."""
        return self.epoch + self.micro_in_epoch / batches_per_epoch

    @property
    def epoch_number(self) -> int:
        """The number, counted from 1, of the epoch the last step belongs to: the log's "epoch N"."""
        return self.epoch + (self.micro_in_epoch > 0)

    def validated(self, top1: float) -> bool:
        """Record a validation's top-1; whether it is the best so far (then it and this epoch are kept)."""
        if top1 <= self.best_top1:
            return False
        self.best_top1, self.best_epoch = top1, self.epoch
        return True

    def logs_to(self, wandb_id: str | None) -> None:
        """The wandb run this training logs to (a resume continues it)."""
        self.wandb_id = wandb_id

    def timed_attempts(self) -> list[Attempt]:
        """The attempts, this one's wall time brought up to now."""
        self._attempt().wall_s = time.perf_counter() - self._clock
        return list(self.attempts)

    # --- a stateful part ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The counters as of now (this attempt's wall time too)."""
        self.timed_attempts()
        return asdict(self)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from ``saved`` (a checkpoint's ``state``); a key this state does not have is refused by name."""
        names = {f.name for f in fields(self)}
        unknown = sorted(set(saved) - names)
        if unknown:
            raise ValueError(f"a checkpoint's training state holds {unknown}, which this quest does not know "
                             f"(it knows {sorted(names)})")
        check_fields(TrainState, saved, "a checkpoint's training state")
        for name, value in {**asdict(TrainState()), **saved}.items():
            setattr(self, name, value)
        self.attempts = [Attempt.from_dict(a) for a in self.attempts]


#: the figures whose largest interval value is reported beside the mean (``<name>_max``)
MAXIMA = ("peak_mem_gib", "step_s", "data_wait")


def figures(attempts: Sequence[Attempt]) -> dict[str, Any]:
    """The time apart in all (compiling steps, the loaders' starts) and each figure's ``<name>_mean`` (None without
    a steady step) and, for :data:`MAXIMA`, ``<name>_max``, over ``attempts`` together."""
    out: dict[str, Any] = {"compile_s": sum(a.compile_s for a in attempts),
                           "compile_steps": sum(a.compile_steps for a in attempts),
                           "loader_start_s": sum(a.loader_start_s for a in attempts)}
    names = dict.fromkeys(name for a in attempts for name in a.figures)  # first seen first, as logged
    for name in names:
        parts = [a.figures[name] for a in attempts if name in a.figures]
        seconds = sum(p.seconds for p in parts)
        out[f"{name}_mean"] = sum(p.weighted for p in parts) / seconds if seconds else None
        if name in MAXIMA:
            out[f"{name}_max"] = max(p.largest for p in parts)
    return out


def _counts(attempts: Sequence[Attempt]) -> dict[str, Any]:
    train_s = sum(a.train_s for a in attempts)
    images = sum(a.images for a in attempts)
    return {"steps": sum(a.steps for a in attempts), "images": images, "train_s": train_s,
            "wall_s": sum(a.wall_s for a in attempts), "img_per_s": images / train_s if train_s else None}


def run_perf(attempts: Sequence[Attempt], flops: float | None, peak: float | None) -> dict[str, Any]:
    """summary.json's ``perf``: the run's FLOPs per image and device peak, its counts and times over every attempt
    (``steps``, ``images``, ``train_s``, ``wall_s``, ``img_per_s`` = images / training time) and the figures over
    all of them, then ``attempts``: each attempt's own (``first_step`` and the same counts and figures)."""
    return {"train_flops_per_image": flops, "device_peak_tflops": peak, **_counts(attempts), **figures(attempts),
            "attempts": [{"first_step": a.first_step, **_counts([a]), **figures([a])} for a in attempts]}
