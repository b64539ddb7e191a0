"""The estimator of Elliptical / Elliptical-QUEST layers during an adversarial evaluation.

The authors attacked their Elliptical models with ``--grad-median`` (``ImageAttack/Scripts/run_{fgm,pgd,spsa}.sh``
in KurtPask/Elliptical-Attention @ 5ae39ee): ``ImageAttack/main.py`` builds the evaluated model with
``median=args.grad_median``, so m is the median over tokens of |V_l - V_{l-1}| instead of the mean it was trained
with, for the attack and for scoring the attacked images alike. A layer's ``estimator`` attribute is what it uses;
its ``options`` (a class attribute of the generated subclass, shared by every layer of the model and by any other
model built with the same options, and what a checkpoint stores) say how it was trained and are left alone: the
attribute is set here on each layer and restored after.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn as nn

from quest.attention.elliptical import ESTIMATORS, EllipticalAttention, EllipticalQuestAttention

__all__ = ["ESTIMATORS", "elliptical_layers", "attack_time_estimator"]

def elliptical_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (EllipticalAttention, EllipticalQuestAttention))]


@contextmanager
def attack_time_estimator(model: nn.Module, estimator: str | None) -> Iterator[dict[str, Any]]:
    """Within the block, every elliptical layer of ``model`` uses ``estimator`` (None: as trained). Yields what was
    used, for the report."""
    if estimator is not None and estimator not in ESTIMATORS:
        raise ValueError(f"elliptical estimator must be null or one of {ESTIMATORS}, got {estimator!r}")
    layers = elliptical_layers(model)
    trained = sorted({layer.options["estimator"] for layer in layers})
    if not layers:
        yield {"used": None, "as_trained": None, "layers": 0,
               "note": "no elliptical layers: the setting does not apply"}
        return
    saved = [layer.estimator for layer in layers]
    if estimator is not None:
        for layer in layers:
            layer.estimator = estimator
    try:
        yield {"used": estimator or (trained[0] if len(trained) == 1 else trained), "as_trained": trained,
               "layers": len(layers), "overridden": estimator is not None}
    finally:
        for layer, used in zip(layers, saved):
            layer.estimator = used
