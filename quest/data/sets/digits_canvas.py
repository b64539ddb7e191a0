"""data=digits_canvas, the localization data set of eval=explain: each bundled digit pasted at a random scale and
place on a larger canvas with clutter (fragments of other digits and noise), with the digit's true bounding box. Real
data, no download; deterministic per seed. The CPU twin of the QUEST paper's Table 6 (ImageNet boxes), docs/explain.md.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from PIL import Image

from quest.data.config import image_size
from quest.store.records import bounded, described

from ..kinds import register_dataset
from .digits import DigitsData, digits_split

__all__ = ["CanvasConfig", "DigitsCanvasData", "DigitsCanvasDataset"]


@dataclass
class CanvasConfig:
    """data=digits_canvas: each digit pasted on a canvas with clutter, with its true box (:class:`DigitsCanvasDataset`)."""

    # 8 <= scale_min <= scale_max <= size: a relation between the three, checked by _check
    size: int = field(default=32, metadata=image_size())  # canvas side in pixels
    # the digit's side is uniform in [scale_min, scale_max] pixels
    scale_min: int = field(default=12, metadata=bounded(1))
    scale_max: int = field(default=22, metadata=bounded(1))  # largest digit side in pixels
    # fragments of other digits, away from the digit's box, pasted one by one into every image (a typo's 10**12 hangs)
    clutter: int = field(default=3, metadata=bounded(0, 64, **described("an integer in 0..64")))
    noise: float = field(default=0.05, metadata=bounded(0))  # Gaussian noise std as a fraction of 255
    # draws of every training digit (the validation split draws each once)
    copies: int = field(default=2, metadata=bounded(1))
    seed: int = field(default=0, metadata=bounded(0))  # every sample's draws come from (seed, split, index)


@dataclass
class DigitsCanvasData(DigitsData):
    """data=digits_canvas: the digits' split (val_fraction, split_seed) and the canvas drawn around each digit."""

    canvas: CanvasConfig = field(default_factory=CanvasConfig)


def _check(c: Any) -> None:
    size, lo, hi = (c.value(f"data.canvas.{k}") for k in ("size", "scale_min", "scale_max"))
    if isinstance(lo, int) and isinstance(hi, int) and isinstance(size, int) and not 8 <= lo <= hi <= size:
        c.fail("data.canvas.scale_max", f"must satisfy 8 <= scale_min ({lo}) <= scale_max <= size ({size})")


@register_dataset("digits_canvas", DigitsCanvasData, check=_check, num_classes=10, reads_root=False)
def build(data: Any, split: str, transform: Callable | None) -> Any:
    c = data.canvas
    return DigitsCanvasDataset(split, size=c.size, scale_min=c.scale_min, scale_max=c.scale_max, clutter=c.clutter,
                               noise=c.noise, copies=c.copies if split == "train" else 1, seed=c.seed,
                               val_fraction=data.val_fraction, split_seed=data.split_seed, transform=transform)


class DigitsCanvasDataset:
    """One side of the digits' fixed stratified split (as :class:`DigitsDataset`), each digit
    drawn ``copies`` times, every time at its own place and scale on a ``size`` x ``size`` canvas.

    Sample i: the digit (8x8, 0..16 scaled to 0..255) resized to s x s, s uniform in [scale_min, scale_max], at a
    uniform position; ``clutter`` fragments (a 3x3 to 4x4 piece of another digit, resized like the digit) at places
    that do not touch the digit's box; Gaussian noise of standard deviation ``noise`` x 255; grey, repeated over
    three channels. The box is the tight (xmin, ymin, xmax, ymax) box, inclusive, of the digit's ink on the canvas.
    Every draw comes from a generator seeded by (seed, split, i): the same sample whatever the order or the process.
    """

    def __init__(self, split: str, size: int = 32, scale_min: int = 12, scale_max: int = 22, clutter: int = 3,
                 noise: float = 0.05, copies: int = 1, seed: int = 0, val_fraction: float = 0.2, split_seed: int = 0,
                 transform: Callable | None = None):
        if split not in ("train", "val"):
            raise ValueError(f"digits_canvas split must be 'train' or 'val', got {split!r}")
        if not 8 <= scale_min <= scale_max <= size:
            raise ValueError(f"data.canvas needs 8 <= scale_min <= scale_max <= size, got {scale_min}, {scale_max}, "
                             f"{size}")
        images, targets, self.sources = digits_split(split, val_fraction, split_seed)
        self.all_images = images
        self.copies = int(copies)
        self.targets = [int(targets[i]) for i in self.sources for _ in range(self.copies)]
        self.classes = [str(i) for i in range(10)]
        self.size, self.scale, self.clutter, self.noise = size, (scale_min, scale_max), clutter, noise
        self.seed, self.split_id = seed, 0 if split == "train" else 1
        self.transform = transform

    def __len__(self) -> int:
        return len(self.targets)

    def _draw(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng([self.seed, self.split_id, index])
        source = self.all_images[self.sources[index // self.copies]]
        canvas = np.zeros((self.size, self.size), dtype=np.float64)
        s = int(rng.integers(self.scale[0], self.scale[1] + 1))
        digit = np.asarray(Image.fromarray(source).resize((s, s), Image.BILINEAR), dtype=np.float64)
        x, y = (int(v) for v in rng.integers(0, self.size - s + 1, size=2))
        canvas[y:y + s, x:x + s] = digit
        ink_rows, ink_cols = np.nonzero(digit > 0)
        box = np.array([[x + ink_cols.min(), y + ink_rows.min(), x + ink_cols.max(), y + ink_rows.max()]])
        for _ in range(self.clutter):
            self._paste_fragment(canvas, rng, s / 8.0, box[0])
        canvas += rng.normal(0.0, self.noise * 255.0, size=canvas.shape)
        return np.clip(canvas, 0, 255).round().astype(np.uint8), box.astype(np.int64)

    def _paste_fragment(self, canvas: np.ndarray, rng: np.random.Generator, zoom: float, box: np.ndarray) -> None:
        other = self.all_images[int(rng.integers(len(self.all_images)))]
        k = int(rng.integers(3, 5))
        r, c = (int(v) for v in rng.integers(0, 8 - k + 1, size=2))
        side = max(2, int(round(k * zoom)))
        piece = np.asarray(Image.fromarray(other[r:r + k, c:c + k]).resize((side, side), Image.BILINEAR), np.float64)
        for _ in range(20):  # a place that leaves the digit's box (and a one-pixel margin) untouched
            px, py = (int(v) for v in rng.integers(0, self.size - side + 1, size=2))
            if px + side < box[0] - 1 or px > box[2] + 1 or py + side < box[1] - 1 or py > box[3] + 1:
                canvas[py:py + side, px:px + side] = np.maximum(canvas[py:py + side, px:px + side], piece)
                return

    @property
    def boxes_frame(self) -> tuple[int, int]:
        """(width, height) of the image the boxes' coordinates are in: the canvas (eval=explain maps them)."""
        return (self.size, self.size)

    def boxes(self, index: int) -> np.ndarray:
        """(1, 4) true box of sample ``index`` on the canvas, (xmin, ymin, xmax, ymax) inclusive."""
        return self._draw(index)[1]

    def __getitem__(self, index: int):
        canvas, _ = self._draw(index)
        img = Image.fromarray(canvas, mode="L").convert("RGB")
        if self.transform is not None:
            img = self.transform(img)
        return img, self.targets[index]
