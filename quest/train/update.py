"""An optimizer update and an EMA update that a step decided on the device can skip, as if never taken, without a
host read (docs/training.md, "A skipped update").

A step is skipped when the divergence check finds it bad (quest.train.guard: a non-finite or too large loss, a
non-finite gradient) and, under fp16, when the GradScaler finds a gradient overflow. The decision is a 0-d float
tensor on the device, 1.0 to skip, and nothing here reads it on the host:

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

from typing import Any

import torch

__all__ = ["skippable_step", "skippable_ema_update", "host_counted", "decided_on_host"]


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
