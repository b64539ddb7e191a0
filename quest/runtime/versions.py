"""The torch release quest runs on, and the features that need a newer one than the floor pyproject.toml declares.

quest installs beside the torch a container already has (docs/getting-started.md, "Tested versions"), so a feature
that needs a newer torch than the floor is found here at run time: :func:`require` refuses it in one line naming the
feature and the release it needs, before any change, rather than letting an ``AttributeError`` or ``ImportError``
from inside torch surface mid-run.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from quest.runtime.errors import UserError

__all__ = ["TORCH_VERSION", "FSDP", "ONNX_EXPORT", "TOY_COMPILED", "FEATURES", "NewerTorchNeeded", "parse_version", "torch_has",
           "missing", "require", "is_exporting", "total_norm", "clip_grads_with_norm_"]


def parse_version(text: str) -> tuple[int, int, int]:
    """``"2.4.1+cu121"`` -> ``(2, 4, 1)``: the release, without local or pre-release tags."""
    parts = [int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


TORCH_VERSION = parse_version(torch.__version__)

FSDP = "trainer.strategy=fsdp (FSDP2's torch.distributed.fsdp.fully_shard)"
ONNX_EXPORT = "quest-export --onnx (torch.onnx.export(dynamo=True))"
#: feature -> the first torch release that has what quest uses for it
#: the toy study's compiled engine: on torch 2.8 and 2.11 its runs ended beyond 1e-8 (float64) of the same runs
#: trained eagerly, on 2.14 within it (tests/toy/test_toy.py); older releases train with the eager engine instead
TOY_COMPILED = "the toy study's compiled engine (compile=true)"
FEATURES: dict[str, tuple[int, int, int]] = {FSDP: (2, 6, 0), ONNX_EXPORT: (2, 6, 0), TOY_COMPILED: (2, 14, 0)}


class NewerTorchNeeded(UserError, RuntimeError):
    """A feature the installed torch is too old for (one line, no traceback)."""


def torch_has(feature: str) -> bool:
    """Whether the installed torch is at least the release :data:`FEATURES` names for ``feature``."""
    return TORCH_VERSION >= FEATURES[feature]


def missing(feature: str) -> str | None:
    """One line naming ``feature`` and the torch release it needs when the installed one is older; None otherwise."""
    if torch_has(feature):
        return None
    needs = ".".join(map(str, FEATURES[feature]))
    return f"{feature} needs torch>={needs}; this environment has torch {torch.__version__}"


def require(feature: str) -> None:
    """Refuse ``feature`` (:class:`NewerTorchNeeded`, one line) when the installed torch is older than it needs."""
    problem = missing(feature)
    if problem is not None:
        raise NewerTorchNeeded(problem)


def is_exporting() -> bool:
    """``torch.compiler.is_exporting()`` where torch has it (2.5 on); before it, torch.export traced through dynamo,
    which :func:`torch.compiler.is_compiling` reports."""
    probe = getattr(torch.compiler, "is_exporting", None)
    return bool(probe()) if probe is not None else False


def total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``grads`` together: ``torch.nn.utils.get_total_norm`` (2.6 on), else the same two foreach
    passes it makes (norm of each, then norm of the norms)."""
    fn = getattr(torch.nn.utils, "get_total_norm", None)
    if fn is not None:
        return fn(grads)
    if not grads:
        return torch.tensor(0.0)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in torch._foreach_norm(grads)]))


def clip_grads_with_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients by ``min(1, max_norm / (norm + 1e-6))`` given their total ``norm``:
    ``torch.nn.utils.clip_grads_with_norm_`` (2.6 on), else the same scaling with foreach ops."""
    fn = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
    if fn is not None:
        fn(parameters, max_norm, norm)
        return
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].device))
