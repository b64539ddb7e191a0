"""scikit-learn's bundled handwritten digits as an image data set: real data that needs no download."""
from __future__ import annotations

from typing import Callable

import numpy as np
from PIL import Image
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import Dataset


class DigitsDataset(Dataset):
    """One side of a fixed, stratified train/val split of the 1,797 8x8 digits, as RGB PIL images.

    Pixel values (0..16) are scaled to 0..255 and the grey image is repeated over three channels so that every
    model, transform and corruption made for RGB images applies unchanged.
    """

    def __init__(self, split: str, val_fraction: float = 0.2, split_seed: int = 0, transform: Callable | None = None):
        if split not in ("train", "val"):
            raise ValueError(f"digits split must be 'train' or 'val', got {split!r}")
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in (0, 1), got {val_fraction}")
        digits = load_digits()
        images = (digits.images * (255.0 / 16.0)).round().astype(np.uint8)
        indices = np.arange(len(images))
        train_idx, val_idx = train_test_split(
            indices, test_size=val_fraction, random_state=split_seed, stratify=digits.target
        )
        keep = np.sort(train_idx if split == "train" else val_idx)
        self.images = images[keep]
        self.targets = [int(t) for t in digits.target[keep]]
        self.transform = transform
        self.classes = [str(i) for i in range(10)]

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int):
        img = Image.fromarray(self.images[index], mode="L").convert("RGB")
        if self.transform is not None:
            img = self.transform(img)
        return img, self.targets[index]
