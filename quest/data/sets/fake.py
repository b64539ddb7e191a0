"""data=fake: torchvision FakeData, random images with random labels, for tests and smoke runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from quest.store.records import bounded

from ..config import TRAINING_ONLY, DataConfig
from ..kinds import register_dataset

__all__ = ["FakeData"]


@dataclass
class FakeData(DataConfig):
    """data=fake: how many random images each split has."""

    fake_train_size: int = field(default=256, metadata={**TRAINING_ONLY, **bounded(1)})  # training images
    fake_val_size: int = field(default=64, metadata=bounded(1))  # validation images


def _check(c: Any) -> None:
    if c.value("data.img_size") is None:  # the size of the generated images: this data set has no files to take it from
        c.fail("data.img_size", "must be set with data=fake (a positive integer: the generated images' side)")


@register_dataset("fake", FakeData, check=_check, reads_root=False)
def build(data: Any, split: str, transform: Callable | None) -> Any:
    from torchvision.datasets import FakeData as TorchvisionFakeData

    size = data.fake_train_size if split == "train" else data.fake_val_size
    image_size = (3, data.img_size, data.img_size)
    # different random_offset per split: train and val images differ, each reproducible
    offset = 0 if split == "train" else 10**6
    return TorchvisionFakeData(size, image_size, data.num_classes, transform=transform, random_offset=offset)
