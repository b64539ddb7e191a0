"""Where the adversarial perturbation lives: ``pixel`` ([0, 1] images, normalisation inside the attacked model, the
sound convention) or ``normalized`` (the tensor after mean/std, the convention of the Elliptical-attention code that
QUEST Tables 3/4 were measured with).

In the authors' code (KurtPask/Elliptical-Attention @ 5ae39ee, ``ImageAttack/datasets.py`` build_transform ends in
``Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)``, ``ImageAttack/engine.py`` attacks the loader's images)
the attacks see normalised tensors: eps is in normalised units, i.e. ``eps * std_c`` in pixels for channel c (1/255
normalised is 0.23/255 in pixels with ImageNet's std), and FGSM, PGD and SPSA are called without image bounds.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn

from .transforms import Normalized

__all__ = ["SPACES", "AttackSpace", "PIXEL_RANGE"]

SPACES = ("pixel", "normalized")
PIXEL_RANGE = (0.0, 1.0)


def _channels(values: Sequence[float]) -> dict[str, float]:
    """Per channel, keyed by channel index (the CSV flattens dicts, not lists)."""
    return {str(c): float(v) for c, v in enumerate(values)}


@dataclass(frozen=True)
class AttackSpace:
    """The attack space of one adversarial evaluation, with the normalisation of the evaluated model."""

    name: str
    mean: tuple[float, ...]
    std: tuple[float, ...]

    def __post_init__(self) -> None:
        if self.name not in SPACES:
            raise ValueError(f"attack space must be one of {SPACES}, got {self.name!r}")

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, -1, *([1] * (like.dim() - 2)))
        mean = torch.tensor(self.mean, dtype=like.dtype, device=like.device).view(shape)
        std = torch.tensor(self.std, dtype=like.dtype, device=like.device).view(shape)
        return mean, std

    def model(self, net: nn.Module) -> nn.Module:
        """The function the attacks differentiate: space tensor -> logits."""
        return Normalized(net, self.mean, self.std) if self.name == "pixel" else net

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[0, 1] images -> tensors of this space ((x - mean) / std, as torchvision's Normalize computes it)."""
        if self.name == "pixel":
            return pixels
        mean, std = self._stats(pixels)
        return (pixels - mean) / std

    def to_pixels(self, z: torch.Tensor) -> torch.Tensor:
        if self.name == "pixel":
            return z
        mean, std = self._stats(z)
        return z * std + mean

    @property
    def clip(self) -> tuple[float, float] | None:
        """Bounds of FGSM, PGD and SPSA: [0, 1] in pixel space; none in normalised space, where the authors' code
        called cleverhans' FGSM / PGD with clip_min = clip_max = None and their SPSA with -inf / inf."""
        return PIXEL_RANGE if self.name == "pixel" else None

    def eps_units(self, eps: float) -> dict[str, Any]:
        """eps in both units, per channel (they differ per channel when std does)."""
        if self.name == "pixel":
            pixel = [eps] * len(self.std)
            normalized = [eps / s for s in self.std]
        else:
            pixel = [eps * s for s in self.std]
            normalized = [eps] * len(self.std)
        return {"eps_units": "pixels ([0, 1] image)" if self.name == "pixel" else "normalised ((x - mean) / std)",
                "eps_pixel": _channels(pixel), "eps_pixel_x255": _channels([255 * p for p in pixel]),
                "eps_normalized": _channels(normalized)}

    def describe(self) -> str:
        stats = f"mean={list(self.mean)}, std={list(self.std)}"
        if self.name == "pixel":
            return (f"[0, 1] pixels after the eval resize/crop; normalisation ({stats}) inside the attacked model, so "
                    "eps is in pixel units (1/255 = one grey level); FGSM, PGD and SPSA stay in [0, 1]")
        return (f"the normalised tensor ((x - mean) / std, {stats}) as the Elliptical-attention code attacked it: eps "
                "in normalised units (eps * std_c in pixels), FGSM / PGD / SPSA not clipped to any image range, "
                "AutoAttack clamps the normalised tensor to [0, 1] (pyautoattack, as the authors' bundled copy)")
