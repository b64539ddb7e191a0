"""The divergence check of every optimizer step, kept on the device (docs/training.md, "The training loop").

Each step folds its checks (a non-finite or too large loss, a non-finite gradient norm) into a small sticky record on
the device, reduced across ranks under DDP together with the stop request in the step's one collective. From the
first bad step on, :meth:`StepGuard.step` returns 1.0, the flag every optimizer skips its update on (quest.train.update)
without a host read. The record is read to the host only at the log interval, before a checkpoint, at an epoch's end
and before diagnostics: :meth:`StepGuard.read` raises :class:`Diverged` with the step that went bad and the values it
had, so no checkpoint, validation or diagnostics sees weights from after it."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["StepGuard", "Diverged"]


class Diverged(Exception):
    """The run went bad at optimizer step ``step``, counted from 1 as every step quest writes (docs/training.md,
    "Steps, epochs and images"): that step's update and every one after it were skipped, so the run's weights are
    those of step ``step - 1``."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"diverged at step {step}: {reason}")
        self.step, self.reason = step, reason


class StepGuard:
    """``max_loss``: the loss above which a step is bad; ``scaler``: fp16's GradScaler owns a non-finite gradient
    (it skips the step and lowers the scale), so only the loss counts; ``distributed``: reduce the flags (MAX)."""

    def __init__(self, device: torch.device, max_loss: float, scaler: bool, distributed: bool):
        self.max_loss, self.scaler, self.distributed = max_loss, scaler, distributed
        # the first bad step's [loss bad, gradient bad, its largest loss, its gradient norm, steps since it (itself
        # counted)]; all zero while every step was good
        self.record = torch.zeros(5, device=device)
        self._one_more = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0], device=device)
        # DDP: the reduced stop requests on their way to the host (device value, pinned copy, its CUDA event)
        self._stops: list[tuple[torch.Tensor, torch.Tensor, Any]] = []

    def step(self, worst: torch.Tensor, grad_norm: torch.Tensor, stop: float) -> torch.Tensor:
        """Fold one step's largest micro-batch loss and gradient norm (0-d float tensors) into the record; under DDP
        reduce the flags and this rank's stop request ``stop`` in one collective. Returns the skip flag, 1.0 from
        the first bad step on (the fused optimizers' ``found_inf``). No host read."""
        flags = torch.stack([~worst.isfinite() | (worst > self.max_loss),
                             ~grad_norm.isfinite() & (not self.scaler)]).float()
        if self.distributed:
            flags = torch.cat([flags, torch.full((1,), float(stop), device=flags.device)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # the step's one collective
            self._send_stop(flags[2])
            flags = flags[:2]
        bad_before = self.record[:2].amax() > 0
        now = torch.cat([flags, worst.reshape(1), grad_norm.reshape(1), flags.amax().reshape(1)])
        self.record = torch.where(bad_before, self.record + self._one_more, now)
        return self.record[:2].amax()

    def _send_stop(self, reduced: torch.Tensor) -> None:
        """Start copying the reduced stop request to the host without waiting for it (pinned memory on CUDA)."""
        event = None
        if reduced.device.type == "cuda":
            host = torch.empty((), pin_memory=True).copy_(reduced, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = reduced
        self._stops = [*self._stops[-1:], (reduced, host, event)]

    def previous_stop(self) -> float:
        """DDP, between log intervals: the stop request the step before the last one reduced, 0.0 when none. Asked
        once the last step's work is queued, it waits for the previous step only: the device keeps a step of work
        queued, and every rank reads the same value at the same step."""
        if len(self._stops) < 2:
            return 0.0
        _, host, event = self._stops.pop(0)
        if event is not None:
            event.synchronize()
        return float(host)  # host memory: the copy has landed

    def read(self, steps: int, *values: torch.Tensor, stop: bool = False) -> list[float]:
        """One device-to-host read of the record, ``values`` (0-d tensors: the log's) and, with ``stop`` under DDP,
        the largest reduced stop request not read yet (appended). ``steps``: optimizer steps taken, the last guarded
        one included. Raises :class:`Diverged` naming the first bad step (counted from 1, as the log and the
        metrics rows number steps)."""
        stops = [torch.stack([value for value, _, _ in self._stops]).amax().reshape(1)] if stop and self._stops else []
        out = torch.cat([self.record, *(v.detach().float().reshape(1) for v in values), *stops]).tolist()
        if stops:
            self._stops = []
        loss_bad, grad_bad, worst, norm, since = out[:5]
        at = steps - int(since) + 1  # since counts the bad step itself
        if loss_bad:
            raise Diverged(at, f"loss {worst:.4g}" + (f" above {self.max_loss:.4g}" if math.isfinite(worst) else
                                                      " is not finite"))
        if grad_bad:
            raise Diverged(at, f"gradient norm {norm}")
        return out[5:]
