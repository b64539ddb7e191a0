"""Evaluation transforms, split where the protocols need to act between the steps.

The eval transform is timm's (resize to img_size / crop_pct, center crop, to tensor, normalise), built from the
same values training used. Corruptions act on the PIL image after the resize/crop and before normalisation; attacks
act on the [0, 1] tensor before normalisation (which then happens inside the model); ImageNet-C images are already
224 px and get no second resize.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn as nn
from timm.data import create_transform
from torchvision import transforms as T

from .target import EvalTarget

__all__ = ["eval_transform", "split_eval_transform", "pixel_transform", "imagenet_c_transform", "Normalized",
           "describe"]


def eval_transform(target: EvalTarget) -> T.Compose:
    return create_transform(target.img_size, is_training=False, interpolation=target.interpolation,
                            crop_pct=target.crop_pct, mean=target.mean, std=target.std)


def split_eval_transform(target: EvalTarget) -> tuple[T.Compose, T.Compose]:
    """(resize/crop on PIL images, to-tensor + normalise): the eval transform cut before its to-tensor step."""
    steps = list(eval_transform(target).transforms)
    cut = next((i for i, t in enumerate(steps) if type(t).__name__ in ("ToTensor", "MaybeToTensor")), None)
    if cut is None:
        raise RuntimeError(f"the eval transform has no ToTensor step to split at: {steps}")
    return T.Compose(steps[:cut]), T.Compose(steps[cut:])


def pixel_transform(target: EvalTarget) -> T.Compose:
    """The eval transform without Normalize: [0, 1] tensors at the model's input resolution."""
    geometric, to_tensor = split_eval_transform(target)
    kept = [t for t in to_tensor.transforms if not isinstance(t, T.Normalize)]
    return T.Compose([*geometric.transforms, *kept])


def imagenet_c_transform(target: EvalTarget) -> T.Compose:
    """ImageNet-C images were made by Resize(256) + CenterCrop(224) before corrupting: CenterCrop + Normalize only."""
    if target.img_size > 224:
        raise ValueError(f"ImageNet-C images are 224 px; this model takes {target.img_size} px and the protocol "
                         "forbids a second resize")
    return T.Compose([T.CenterCrop(target.img_size), T.ToTensor(), T.Normalize(target.mean, target.std)])


class Normalized(nn.Module):
    """``model((x - mean) / std)``: lets attacks work on [0, 1] pixels while the model sees what it was trained on."""

    def __init__(self, model: nn.Module, mean: Sequence[float], std: Sequence[float]):
        super().__init__()
        self.model = model
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model((x - self.mean.to(x.device)) / self.std.to(x.device))


def describe(transform: Callable) -> str:
    """One line per step, for the report."""
    steps = getattr(transform, "transforms", [transform])
    return " -> ".join(repr(t).replace("\n", " ") for t in steps)
