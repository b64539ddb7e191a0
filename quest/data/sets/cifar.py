"""data=cifar10 / data=cifar100: torchvision's CIFAR archives under data.root, downloaded only when asked."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import TRAINING_ONLY, DataConfig, need_root
from ..kinds import register_dataset

__all__ = ["CifarData"]


@dataclass
class CifarData(DataConfig):
    """data=cifar10 | cifar100: torchvision's archive under data.root."""

    download: bool = field(default=False, metadata=TRAINING_ONLY)  # download only when asked


def _build(data: Any, split: str, transform: Callable | None) -> Any:
    from torchvision import datasets as tvd

    cls = tvd.CIFAR10 if data.name == "cifar10" else tvd.CIFAR100
    root = need_root(data)
    try:
        return cls(str(root), train=split == "train", transform=transform, download=data.download)
    except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted"
        raise FileNotFoundError(
            f"data={data.name}: no {data.name} under {root} ({exc}); place the torchvision archive there "
            "(cifar-10-batches-py / cifar-100-python) or pass data.download=true"
        ) from exc


build_cifar10 = register_dataset("cifar10", CifarData, num_classes=10)(_build)
build_cifar100 = register_dataset("cifar100", CifarData, num_classes=100)(_build)
