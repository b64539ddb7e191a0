"""The keys every data set has (``data.*``); a data set's own options extend it (quest/data/sets/, docs/data.md).

Imports no torch: Hydra's schema (quest.schema) and ``--help`` read it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import MISSING

__all__ = ["DataConfig", "need_root"]


@dataclass
class DataConfig:
    """The data=<option> group: the data set, its splits and loaders. Each data set's own options are the fields of
    its settings dataclass, a subclass of this one (``quest.data.list_datasets()``; docs/data.md)."""

    name: str = MISSING  # the registered data set (configs/data/*.yaml; quest.data.list_datasets)
    root: Optional[str] = None  # where the data set lives (null: the built-in digits need none)
    batch_size: int = 64  # per process
    eval_batch_size: Optional[int] = None  # None: 2 x batch_size
    num_workers: int = 0  # DataLoader worker processes
    num_classes: int = MISSING  # classes of the data set (set by the data option)
    img_size: Optional[int] = None  # native resolution when the model does not set one
    mean: List[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])  # per-channel normalisation mean
    std: List[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])  # per-channel normalisation std
    train_split: str = "train"  # the split trained on (a folder, or a shard pattern for wds)
    val_split: str = "val"  # the split validated on
    subset_fraction: float = 1.0  # class-balanced subset of the training set (paper Table A2)
    subset_seed: int = 0  # seed of the subset_fraction draw
    bad_images: str = "error"  # error | skip: what to do with an unreadable image in an image folder
    # bad_images=skip: the run fails (status bad_data) when more than this share of a split's images is unreadable
    max_skipped_fraction: float = 0.01  # docs/data.md
    preflight: bool = True  # image folders: decode every file; shards: read every header (docs/data.md)
    pin_memory: bool = True  # DataLoader pin_memory (CUDA)


def need_root(data: Any) -> Path:
    """``data.root`` as a path; a ValueError naming the data set when it is unset."""
    if not data.root or data.root == "???":
        raise ValueError(f"data={data.name} needs data.root=<directory>")
    return Path(data.root).expanduser()
