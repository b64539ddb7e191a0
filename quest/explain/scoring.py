"""Scoring explanations over a data set with boxes: per method the localization metrics of Table 6.

Protocol (the AG-CAM authors' ``localization.py``, the default; each choice is an argument and is recorded): the
map of the predicted class (``classes="predicted"``), images the model gets wrong left out (``skip_wrong``), AG-CAM
with every attention block's input detached (``agcam_gradient="detached"``, the authors' ViT),
threshold 0.5 on the min-max normalised map upsampled bilinearly to the input size, every ground-truth box of the
image (their union), boxes mapped through the same resize / crop as the image.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch
import torch.nn as nn

from .localization import LocalizationScores, localization_scores
from .methods import explain, to_image

__all__ = ["ExplainTally", "score_explanations", "normalised_maps"]


@dataclass
class ExplainTally:
    scores: dict[str, LocalizationScores]  # per method: sums over the scored images
    images: int = 0  # images seen
    wrong: int = 0  # of them misclassified (left out when skip_wrong)


def normalised_maps(model: nn.Module, images: torch.Tensor, methods: Iterable[str],
                    target: torch.Tensor | None = None, agcam_gradient: str = "detached") -> dict[str, torch.Tensor]:
    """Per method the (B, H, W) maps at the input size, min-max normalised per image, on the CPU."""
    size = tuple(images.shape[-2:])
    return {m: to_image(explain(m, model, images, target, agcam_gradient)[0].detach(), size).cpu() for m in methods}


def score_explanations(model: nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor, list[int]]],
                       boxes_of: Callable[[int], np.ndarray], methods: list[str], threshold: float = 0.5,
                       classes: str = "predicted", skip_wrong: bool = True, agcam_gradient: str = "detached",
                       progress: Callable[[int, int, str], None] | None = None) -> ExplainTally:
    """``batches`` yields (model inputs, labels, data-set indices); ``boxes_of(index)`` gives that image's boxes in
    input pixels (N, 4). ``progress(done, total, detail)``, when given, is told after each method's maps of a batch
    (``2, 3, "rollout maps"``): one batch of AG-CAM on a large model takes a while, and the caller's progress line
    (quest.evaluation.progress.Inner) shows the work inside it."""
    if classes not in ("predicted", "label"):
        raise ValueError(f"explain classes must be 'predicted' or 'label', got {classes!r}")
    tally = ExplainTally({m: LocalizationScores() for m in methods})
    for images, labels, indices in batches:
        with torch.no_grad():
            predicted = model(images).argmax(dim=1)
        right = (predicted == labels).tolist()
        tally.images += len(right)
        tally.wrong += right.count(False)
        target = predicted if classes == "predicted" else labels
        maps: dict[str, torch.Tensor] = {}
        for done, method in enumerate(methods, start=1):  # one method at a time, so that each can be told
            maps.update(normalised_maps(model, images, [method], target, agcam_gradient))
            if progress is not None:
                progress(done, len(methods), f"{method} maps")
        for row, index in enumerate(indices):
            if right[row] or not skip_wrong:
                boxes = boxes_of(index)
                for m in methods:
                    tally.scores[m] = tally.scores[m].add(localization_scores(maps[m][row], boxes, threshold))
    return tally
