"""A run's counters: :class:`TrainState`, the one object that says where a training run stands (steps, epochs, the
best validation, images seen and skipped, training time) and the only code that changes those counters.

It is a stateful part like the model or the optimizer: the Checkpointer saves its ``state_dict()`` as the
checkpoint record's ``state`` field and restores it with ``load_state_dict()``. Everything else reads it.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from quest.records import bounded, check_fields

__all__ = ["TrainState"]


@dataclass
class TrainState:
    # each counter's range is checked when a checkpoint's state is read back (quest.records)
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

    # --- what changes it, in the order a run meets them -----------------------------------------------------------
    def drew_batch(self) -> None:
        """One micro-batch of the current epoch was taken from the loader (trained on or, all unreadable, not)."""
        self.micro_in_epoch += 1

    def add_drawn(self, skipped: int, drawn: int) -> None:
        """Images drawn and skipped as unreadable, summed over every process."""
        self.train_skipped += skipped
        self.train_drawn += drawn

    def took_step(self) -> None:
        self.step += 1

    def saw_images(self, images: int) -> None:
        """``images`` (all processes) went through a training step."""
        self.images_seen += images

    def trained_for(self, seconds: float) -> None:
        """Wall time spent training (validation and checkpoints excluded), added at each log line and epoch end."""
        self.train_seconds += seconds

    def end_epoch(self) -> None:
        self.epoch += 1
        self.micro_in_epoch = 0

    def validated(self, top1: float) -> bool:
        """Record a validation's top-1; whether it is the best so far (then it and this epoch are kept)."""
        if top1 <= self.best_top1:
            return False
        self.best_top1, self.best_epoch = top1, self.epoch
        return True

    def logs_to(self, wandb_id: str | None) -> None:
        """The wandb run this training logs to (a resume continues it)."""
        self.wandb_id = wandb_id

    # --- a stateful part ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
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
