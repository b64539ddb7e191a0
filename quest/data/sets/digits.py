"""data=digits: scikit-learn's bundled handwritten digits (quest/data/digits.py), a fixed stratified split."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..config import DataConfig
from ..registry import register_dataset

__all__ = ["DigitsData", "check_split"]


@dataclass
class DigitsData(DataConfig):
    """data=digits: the held-out share and the seed of the fixed train/val split."""

    val_fraction: float = 0.2  # held-out stratified share
    split_seed: int = 0  # the fixed train/val split


def check_split(c: Any) -> None:
    c.fraction("data.val_fraction", low_open=True, high_open=True)


@register_dataset("digits", DigitsData, check=check_split, num_classes=10, reads_root=False)
def build(data: Any, split: str, transform: Callable | None) -> Any:
    from ..digits import DigitsDataset

    return DigitsDataset(split, data.val_fraction, data.split_seed, transform)
