"""The update that ends every optimizer step (:class:`Update`: clipping, the divergence check, the optimizer's and the
EMA's updates), the check and the updates it skips on the device, without a host read.

The check (docs/training.md, "The training loop"): each step folds its checks (a non-finite or too large loss, a
non-finite gradient norm) into a small sticky record on the device, reduced across ranks under DDP together with the
stop request in the step's one collective. From the first bad step on, :meth:`StepGuard.step` returns 1.0, the flag
every optimizer skips its update on (:func:`skippable_step`). The record is read to the host only at the log
interval, before a checkpoint, at an epoch's end and before diagnostics: :meth:`StepGuard.read` raises
:class:`Diverged` with the step that went bad and the values it had, so no checkpoint, validation or diagnostics sees
weights from after it.

The updates (docs/training.md, "A skipped update"): a step is skipped when the check finds it bad and, under fp16,
when the GradScaler finds a gradient overflow. The decision is a 0-d float tensor on the device, 1.0 to skip, and
nothing here reads it on the host:

- torch's fused optimizers (Adam, AdamW, SGD: quest.train.builders builds them fused) take it as ``found_inf``:
  their kernel leaves the weights and the state as they were and undoes the step count itself.
- every other optimizer (timm's Lamb, NAdamW, Lion, ... and torch's unfused ones) steps, and then each tensor it
  changes (the weights and every state tensor on the device) is selected back with ``torch.where`` from a copy taken
  before the step. One copy and one select cost about five bytes moved per byte of weights and state: the price of
  the guarantee for an optimizer that cannot skip itself (a fused one moves nothing more).
- state an optimizer creates in its first step (SGD's momentum buffer, Adam's moments) has no value "before": a
  skipped step leaves it zero, which the optimizers without a host count read as "no history" (the next step is the
  first step of a run that never took the skipped one: tests/train/test_skipped_update.py; a momentum buffer of zeros
  continues as 0 x momentum + gradient, the buffer a first step starts with). Fused SGD would otherwise keep the
  uninitialised memory its skipped first step allocated.
- what an optimizer counts on the host (timm's Lamb keeps its step count in the param group, a CPU tensor; some
  timm optimizers count in Python ints) cannot follow a decision that stays on the device. Where a skipped step is
  part of training that goes on (fp16's overflows: the loss scaler's calibration skips a few steps at the start of
  every DeiT-III run, whose Lamb counts on the host), such an optimizer reads the decision on the host, as torch's
  GradScaler.step does, and steps only when it is 0 (:func:`decided_on_host`): one read per step, the price of its
  count being the authors' (a skipped step never counted), stated in docs/training.md. Elsewhere a skip is a
  divergence, which ends the run at the next read before anything is saved: the count one ahead is never seen.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Update", "StepGuard", "Diverged", "divergence_threshold", "chance_loss", "skippable_step",
           "skippable_ema_update", "host_counted", "decided_on_host"]


class Diverged(Exception):
    """The run went bad at optimizer step ``step``, counted from 1 as every step quest writes (docs/training.md,
    "Steps, epochs and images"): that step's update and every one after it were skipped, so the run's weights are
    those of step ``step - 1``."""

    def __init__(self, step: int, reason: str):
        super().__init__(f"diverged at step {step}: {reason}")
        self.step, self.reason = step, reason


def chance_loss(num_classes: int, bce: bool) -> float:
    """The training loss of a model that knows nothing: uniform predictions over ``num_classes`` under cross-entropy
    (label smoothing and mixup's soft targets included: their loss is ln C there too); zero logits under
    binary cross-entropy (timm's BinaryCrossEntropy averages over classes: ln 2)."""
    return math.log(2.0) if bce else math.log(num_classes)


def divergence_threshold(trainer: Any, recipe: Any, num_classes: int) -> float:
    """The loss above which a step counts as divergence: trainer.max_loss when set, else trainer.max_loss_factor x
    the chance loss (docs/training.md, "Divergence": the factor and the losses measured on healthy runs), else inf."""
    if trainer.get("max_loss") is not None:
        return float(trainer.max_loss)
    factor = trainer.get("max_loss_factor")
    if factor is None:
        return math.inf
    return factor * chance_loss(max(num_classes, 2), bool(recipe.get("bce_loss")))


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



class Update:
    """One optimizer update once the step's backward passes are done: the gradients unscaled (fp16) and clipped
    (``clip_grad``, when set), the step folded into the divergence check (``guard``), the optimizer's update and the
    EMA's, each skipped on the device from the first bad step on (and under fp16 on a gradient overflow), the loss
    scale updated and the gradients cleared. Nothing is read on the host but by an optimizer that counts its steps
    there under fp16 (:func:`decided_on_host`)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                 ema: Any, guard: StepGuard, clip_grad: float | None):
        self.model, self.optimizer, self.scaler, self.ema, self.guard = model, optimizer, scaler, ema, guard
        self.clip_grad = clip_grad

    def __call__(self, worst: torch.Tensor, stop: float, step: int,
                 log: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Update with this step's largest micro-batch loss ``worst`` (0-d) and this rank's stop request ``stop``
        (reduced with the check's flags under DDP); ``step``: the optimizer step this update makes, counted from 1
        (the EMA's decay). Returns the gradients' total norm (fp32, 0-d, before clipping) and, when ``log`` under
        fp16, the loss scale this step used (read with the log's one read: the scaler's update changes it)."""
        self.scaler.unscale_(self.optimizer)
        grads = [q.grad for q in self.model.parameters() if q.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads)
        if self.clip_grad is not None:  # without clipping, no pass over the gradients beyond the norm's
            torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.clip_grad, grad_norm)
        grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).float()
        skip = self.guard.step(worst, grad_norm, stop)  # on the device; under DDP the step's one collective
        scale = [self.scaler._get_scale_async().clone()] if log and self.scaler.is_enabled() else []
        if self.scaler.is_enabled():
            skip = torch.maximum(skip, (~grad_norm.isfinite()).float())  # the scaler's overflow
        # asked at every step: a checkpoint's param groups (their ``fused``) replace the built ones on resume
        skippable_step(self.optimizer, skip, decided_on_host(self.optimizer, self.scaler.is_enabled()))
        self.scaler.update()  # reads the found_inf that unscale_ left on the device
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:  # a skipped update leaves the EMA as it was too
            skippable_ema_update(self.ema, self.model, step, skip)
        return grad_norm, scale


def _is_fused(optimizer: torch.optim.Optimizer) -> bool:
    return all(group.get("fused") for group in optimizer.param_groups)


def _selectable(value: Any, device: torch.device) -> bool:
    """Whether a state value lives on the step's device, where a select can restore it: a tensor there, but not a
    0-d CPU tensor, the step count that torch's and timm's unfused optimizers keep on the host on any device (so the
    CPU, where the tests run, behaves as CUDA does)."""
    return (isinstance(value, torch.Tensor) and value.device == device
            and not (value.dim() == 0 and value.device.type == "cpu"))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's own memory: an FSDP parameter's or state's shard (a DTensor's local tensor), else itself. The
    select works on it in place, so a sharded tensor is never mixed with the plain skip flag."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def decided_on_host(optimizer: torch.optim.Optimizer, overflow_skips: bool) -> bool:
    """Whether ``optimizer``'s skip decision is read on the host (module docstring): where skipped steps are part of
    training (``overflow_skips``: fp16's loss scaler) and the optimizer cannot skip itself on the device (any but
    torch's fused ones), so that a count it keeps on the host never counts a skipped step."""
    return overflow_skips and not _is_fused(optimizer)


def skippable_step(optimizer: torch.optim.Optimizer, skip: torch.Tensor, on_host: bool = False) -> None:
    """``optimizer.step()``, or, where ``skip`` (0-d float on the device) is 1.0, weights and optimizer state left
    bit for bit as they were (new state zero), without reading ``skip`` on the host; ``on_host``
    (:func:`decided_on_host`): ``skip`` read, and the step taken only when it is 0, everything untouched otherwise."""
    if on_host:
        if not skip.item():  # the one read per step of an optimizer that counts on the host, under fp16
            optimizer.step()
        return
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    device, fused = skip.device, _is_fused(optimizer)
    had = [set(optimizer.state[p]) for p in params]  # host-side: the state that exists before the step
    before: list[dict[str, torch.Tensor]] = []
    if fused:
        optimizer.found_inf = skip  # read by the fused kernel on the device: it skips itself
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    else:  # the copy the select restores from: the weights ("") and the state's device tensors
        keys = [["", *(key for key, value in optimizer.state[p].items() if _selectable(value, device))]
                for p in params]
        tensors = [_local(p.detach() if key == "" else optimizer.state[p][key]) for p, names in zip(params, keys)
                   for key in names]
        copies = iter(torch._foreach_mul(tensors, 1))  # one multi-tensor kernel; x * 1 is x, bit for bit
        before = [{key: next(copies) for key in names} for names in keys]
        optimizer.step()
    keep = skip == 0
    zero = torch.zeros((), device=device)
    for i, p in enumerate(params):
        if before:
            weights = _local(p.detach())
            torch.where(keep, weights, before[i][""], out=weights)
        for key, value in optimizer.state[p].items():
            if not _selectable(value, device):
                continue  # counted on the host (host_counted): it cannot follow a decision on the device
            if key not in had[i]:  # created by this step: zero when the step is skipped
                restored = zero.to(value.dtype)
            elif before and key in before[i]:  # back to the copy, whether the step updated it in place or not
                restored = before[i][key]
            else:
                continue  # a fused optimizer's existing state: its kernel skipped it
            local = _local(value)
            torch.where(keep, local, restored, out=local)


def host_counted(optimizer: torch.optim.Optimizer, device: torch.device) -> list[str]:
    """Where ``optimizer`` keeps values on the host that its step changes (a param group's step count; a
    parameter's state as a Python number or a 0-d CPU tensor): those a skipped step advances anyway. None for a
    fused optimizer, whose kernel undoes its own count."""
    if _is_fused(optimizer):
        return []
    names = {f"param_groups[].{key}" for group in optimizer.param_groups for key in ("step", "k") if key in group}
    names |= {f"state[].{key}" for state in optimizer.state.values() for key, value in state.items()
              if isinstance(value, (int, float, torch.Tensor)) and not _selectable(value, device)}
    return sorted(names)


def skippable_ema_update(ema: Any, model: torch.nn.Module, step: int, skip: torch.Tensor) -> None:
    """timm's ModelEmaV3 update (its decay at ``step``; floating values interpolated, the others copied) with the
    interpolation weight times (1 - ``skip``) on the device: a skipped step leaves the EMA bit for bit as it was
    (ema + 0 x (model - ema), the model restored and finite). The weight is a tensor, so nothing is read."""
    weight = (1.0 - skip) * (1.0 - ema.get_decay(step))
    ema_values, model_values = [], []
    with torch.no_grad():
        pairs = (zip(ema.module.parameters(), model.parameters()) if ema.exclude_buffers else
                 zip(ema.module.state_dict().values(), model.state_dict().values()))
        for ema_v, model_v in pairs:
            if ema_v.is_floating_point():
                ema_values.append(ema_v)
                model_values.append(model_v)
            else:
                ema_v.copy_(model_v)
        if ema.exclude_buffers:
            for ema_b, model_b in zip(ema.module.buffers(), model.buffers()):
                ema_b.copy_(model_b)
        # the TensorList overload: a 0-d tensor as the Scalar weight would be read on the host
        weight = weight.to(ema_values[0].dtype) if ema_values else weight
        torch._foreach_lerp_(ema_values, model_values, [weight.expand_as(v) for v in ema_values])
