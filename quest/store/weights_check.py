"""The one check of a state dict that quest is about to load, whichever command loads it.

Resume (``trainer.resume``), ``trainer.init_from=``, ``model.pretrained=``, eval.py's ``checkpoint=`` / ``weights=``
and quest-export all call :func:`check_weights` on every state dict before any ``load_state_dict`` and before the run
or results directory changes. A NaN or inf in a weight (a flipped bit, a hand edit) would otherwise be trained on and
recorded as the run's divergence, or scored as a model; a tensor of another shape or an integer tensor for a floating
weight is a file of another model (load_state_dict would stop with a size-mismatch traceback, or cast the integers
without a word). Each is refused as one line naming the file and the tensor.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import torch

from quest.runtime.errors import UserError

__all__ = ["WeightsError", "check_weights", "DAMAGED_ADVICE"]

#: what to do about a file whose values are damaged, unless the caller knows better
DAMAGED_ADVICE = "copy it again from where it was written, or use another file"
_SHOWN = 4  # problems named in the one line; the rest are counted


class WeightsError(UserError, ValueError):
    """Weights that cannot be loaded as they are; the message names the file and the tensor."""


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _listed(problems: list[str]) -> str:
    more = f" (and {len(problems) - _SHOWN} more)" if len(problems) > _SHOWN else ""
    return "; ".join(problems[:_SHOWN]) + more


def _fit_problems(state: Mapping[str, Any], expected: Mapping[str, torch.Tensor] | None,
                  optional: Collection[str]) -> list[str]:
    """What keeps ``state`` from being loaded into a model whose state_dict is ``expected``, one phrase each."""
    problems = [f"{key!r} is a {type(value).__name__}, not a tensor" for key, value in state.items()
                if not isinstance(value, torch.Tensor)]
    if expected is None:
        return problems
    missing = [key for key in expected if key not in state and key not in optional]
    unexpected = [key for key in state if key not in expected]
    if missing:
        problems.append(f"{len(missing)} tensors of the model are missing, e.g. {missing[:3]}")
    if unexpected:
        problems.append(f"{len(unexpected)} tensors are not the model's, e.g. {unexpected[:3]}")
    for key, value in state.items():
        mine = expected.get(key)
        if mine is None or not isinstance(value, torch.Tensor):
            continue
        if value.shape != mine.shape:
            problems.append(f"{key!r} has shape {tuple(value.shape)}, the model's {tuple(mine.shape)}")
        elif mine.is_floating_point() and not value.is_floating_point():
            # load_state_dict would cast them silently: a model that scores at chance
            problems.append(f"{key!r} holds {_dtype(value)} values where the model's are {_dtype(mine)} "
                            "(weights are floating point)")
    return problems


def _non_finite(state: Mapping[str, Any]) -> list[tuple[str, torch.Tensor]]:
    """The floating tensors of ``state`` holding a NaN or inf: one isfinite().all() per tensor on its own device, and
    one host read per device (the flags stacked), so a large model on the GPU is not read tensor by tensor."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
            by_device.setdefault(value.device, []).append((key, value))
    bad = []
    for tensors in by_device.values():
        finite = torch.stack([torch.isfinite(value).all() for _, value in tensors])
        if not bool(finite.all()):
            bad += [tensors[i] for i in (~finite).nonzero().flatten().tolist()]
    return bad


def check_weights(state: Mapping[str, Any], path: Any, what: str = "weights",
                  expected: Mapping[str, torch.Tensor] | None = None, optional: Collection[str] = (),
                  advice: str = DAMAGED_ADVICE) -> None:
    """Refuse ``state`` (a state dict read from ``path``) with one :class:`WeightsError` line when a value is not a
    tensor, a floating tensor holds a NaN or inf, or, with ``expected`` (the target model's state_dict), when the
    keys differ (every one of ``expected`` but those in ``optional`` must be there, and nothing else), a shape
    differs, or integer values stand for a floating weight. ``what``: the weights' name in the message ("weights",
    "EMA weights"); ``advice``: what to do about damaged values."""
    problems = _fit_problems(state, expected, optional)
    if problems:
        raise WeightsError(f"{path}: {what} do not fit the model: {_listed(problems)}; is it a file of another model "
                           "(width, depth, patch size, class count, attention)?")
    bad = _non_finite(state)
    if bad:
        key, value = bad[0]
        count = int((~torch.isfinite(value)).sum())
        more = f" (and {len(bad) - 1} more tensors: {[k for k, _ in bad[1:4]]})" if len(bad) > 1 else ""
        raise WeightsError(f"{path}: {what} {key!r} hold {count} non-finite values (NaN/inf) of {value.numel()}"
                           f"{more}; the file is damaged (a flipped bit, an edit) and is not loaded: {advice}")
