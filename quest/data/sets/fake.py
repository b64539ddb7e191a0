"""data=fake: torchvision FakeData, random images with random labels, for tests and smoke runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import TRAINING_ONLY, DataConfig
from ..kinds import register_dataset

__all__ = ["FakeData"]


@dataclass
class FakeData(DataConfig):
    """data=fake: how many random images each split has."""

    fake_train_size: int = field(default=256, metadata=TRAINING_ONLY)  # training images
    fake_val_size: int = 64  # validation images


def _check(c: Any) -> None:
    c.positive_int("data.fake_train_size", "data.fake_val_size")
    c.positive_int("data.img_size")  # the size of the generated images: this data set has no files to take it from


@register_dataset("fake", FakeData, check=_check, reads_root=False)
def build(data: Any, split: str, transform: Callable | None) -> Any:
    from torchvision.datasets import FakeData as TorchvisionFakeData

    size = data.fake_train_size if split == "train" else data.fake_val_size
    image_size = (3, data.img_size, data.img_size)
    # different random_offset per split: train and val images differ, each reproducible
    offset = 0 if split == "train" else 10**6
    return TorchvisionFakeData(size, image_size, data.num_classes, transform=transform, random_offset=offset)
