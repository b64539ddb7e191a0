"""data=digits_canvas: each bundled digit pasted on a canvas with clutter, with its true box
(quest/data/digits_canvas.py): the localization data set of eval=explain."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..registry import register_dataset
from .digits import DigitsData, check_split

__all__ = ["CanvasConfig", "DigitsCanvasData"]


@dataclass
class CanvasConfig:
    """data=digits_canvas: each digit pasted on a canvas with clutter, with its true box (quest/data/digits_canvas.py)."""

    size: int = 32  # canvas side in pixels
    scale_min: int = 12  # the digit's side is uniform in [scale_min, scale_max] pixels
    scale_max: int = 22  # largest digit side in pixels
    clutter: int = 3  # fragments of other digits, away from the digit's box
    noise: float = 0.05  # Gaussian noise std as a fraction of 255
    copies: int = 2  # draws of every training digit (the validation split draws each once)
    seed: int = 0  # every sample's draws come from (seed, split, index)


@dataclass
class DigitsCanvasData(DigitsData):
    """data=digits_canvas: the digits' split (val_fraction, split_seed) and the canvas drawn around each digit."""

    canvas: CanvasConfig = field(default_factory=CanvasConfig)


def _check(c: Any) -> None:
    check_split(c)
    c.positive_int("data.canvas.size", "data.canvas.scale_min", "data.canvas.scale_max", "data.canvas.copies")
    c.check("data.canvas.clutter", lambda v: isinstance(v, int) and v >= 0, "an integer >= 0")
    c.non_negative("data.canvas.noise")
    size, lo, hi = (c.value(f"data.canvas.{k}") for k in ("size", "scale_min", "scale_max"))
    if isinstance(lo, int) and isinstance(hi, int) and isinstance(size, int) and not 8 <= lo <= hi <= size:
        c.fail("data.canvas.scale_max", f"must satisfy 8 <= scale_min ({lo}) <= scale_max <= size ({size})")


@register_dataset("digits_canvas", DigitsCanvasData, check=_check, num_classes=10, reads_root=False)
def build(data: Any, split: str, transform: Callable | None) -> Any:
    from ..digits_canvas import DigitsCanvasDataset

    c = data.canvas
    return DigitsCanvasDataset(split, size=c.size, scale_min=c.scale_min, scale_max=c.scale_max, clutter=c.clutter,
                               noise=c.noise, copies=c.copies if split == "train" else 1, seed=c.seed,
                               val_fraction=data.val_fraction, split_seed=data.split_seed, transform=transform)
