"""data=digits: scikit-learn's bundled handwritten digits as an image data set (real data that needs no download), a
fixed stratified split."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from PIL import Image

from quest.store.records import SEED_RANGE, bounded

from ..config import DataConfig
from ..kinds import register_dataset

__all__ = ["DigitsData", "DigitsDataset", "digits_split"]


@dataclass
class DigitsData(DataConfig):
    """data=digits: the held-out share and the seed of the fixed train/val split."""

    val_fraction: float = field(default=0.2, metadata=bounded(0, 1, open_low=True, open_high=True))  # held-out share
    split_seed: int = field(default=0, metadata=bounded(*SEED_RANGE))  # the fixed train/val split


@register_dataset("digits", DigitsData, num_classes=10, reads_root=False)
def build(data: Any, split: str, transform: Callable | None) -> Any:
    return DigitsDataset(split, data.val_fraction, data.split_seed, transform)


def digits_split(split: str, val_fraction: float, split_seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All 1,797 digits as uint8 images (0..16 scaled to 0..255), their labels, and the sorted indices of ``split``'s
    side of the fixed stratified split: the one split data=digits and data=digits_canvas share."""
    from sklearn.datasets import load_digits  # here, not at the top: registering the data set imports no sklearn
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)
    train_idx, val_idx = train_test_split(np.arange(len(images)), test_size=val_fraction, random_state=split_seed,
                                          stratify=digits.target)
    return images, digits.target, np.sort(train_idx if split == "train" else val_idx)


class DigitsDataset:
    """One side of a fixed, stratified train/val split of the 1,797 8x8 digits, as RGB PIL images.

    Pixel values (0..16) are scaled to 0..255 and the grey image is repeated over three channels so that every
    model, transform and corruption made for RGB images applies unchanged.
    """

    def __init__(self, split: str, val_fraction: float = 0.2, split_seed: int = 0, transform: Callable | None = None):
        if split not in ("train", "val"):
            raise ValueError(f"digits split must be 'train' or 'val', got {split!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
        images, targets, keep = digits_split(split, val_fraction, split_seed)
        self.images = images[keep]
        self.targets = [int(t) for t in targets[keep]]
        self.transform = transform
        self.classes = [str(i) for i in range(10)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        img = Image.fromarray(self.images[index], mode="L").convert("RGB")
        if self.transform is not None:
            img = self.transform(img)
        return img, self.targets[index]
