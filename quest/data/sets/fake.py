"""data=fake: random images with random labels (torchvision's FakeData, drawn apart from torch's global random
state), for tests and smoke runs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from quest.store.records import bounded

from ..config import TRAINING_ONLY, DataConfig
from ..kinds import register_dataset

if TYPE_CHECKING:
    import torch

__all__ = ["FakeData", "FakeImages"]


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
    size = data.fake_train_size if split == "train" else data.fake_val_size
    image_size = (3, data.img_size, data.img_size)
    # different random_offset per split: train and val images differ, each reproducible
    offset = 0 if split == "train" else 10**6
    return FakeImages(size, image_size, data.num_classes, transform=transform, random_offset=offset)


class FakeImages:
    """``size`` images of ``image_size`` (C, H, W) as PIL images, each with a label of ``num_classes``: image ``i``
    and its label are drawn from a generator seeded with ``i + random_offset``, which makes them torchvision's
    FakeData's, bit for bit.

    Each is drawn from a generator of its own, never from torch's global one: torchvision's FakeData seeds the global
    generator for every image (``torch.manual_seed``) and puts back the CPU's state only. In a process where CUDA has
    started, that reseeds CUDA's generators at every image the training process reads, the ones dropout and drop
    path draw from on the GPU; where CUDA has not started, torch queues each seed with the caller's stack, formatted
    (about 0.5 ms an image inside a run)."""

    def __init__(self, size: int, image_size: tuple[int, int, int], num_classes: int,
                 transform: Callable | None = None, random_offset: int = 0):
        self.size, self.image_size, self.num_classes = size, tuple(image_size), num_classes
        self.transform, self.random_offset = transform, random_offset

    def __len__(self) -> int:
        return self.size

    def _drawn(self, index: int) -> tuple[torch.Tensor, int]:
        import torch  # here, as torchvision below: a TAB's completion registers the data sets and imports no torch

        generator = torch.Generator().manual_seed(index + self.random_offset)
        image = torch.randn(*self.image_size, generator=generator)
        return image, int(torch.randint(0, self.num_classes, size=(1,), generator=generator))

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if not 0 <= index < self.size:
            raise IndexError(f"{type(self).__name__} index {index} out of range (it has {self.size} images)")
        from torchvision.transforms.functional import to_pil_image

        image, target = self._drawn(index)
        image = to_pil_image(image)
        return (self.transform(image) if self.transform is not None else image), target

    @property
    def targets(self) -> list[int]:
        """Every image's label, without making its PIL image."""
        return [self._drawn(i)[1] for i in range(self.size)]
