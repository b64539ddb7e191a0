"""Data sets by config name, through the registry (quest/data/registry.py; the built-in ones in quest/data/sets/),
and what every data set shares: class labels and the class-balanced subset."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
from torch.utils.data import Dataset, Subset

from .registry import get_dataset

__all__ = ["build_dataset", "class_balanced_subset", "dataset_targets", "known_num_classes", "check_split_classes"]


def known_num_classes(data: Any) -> int | None:
    """The class count a data set has (for image folders: its training split's class folders), or None (fake)."""
    count = get_dataset(data.name).num_classes
    return None if count is None else count(data)


def check_split_classes(data: Any) -> None:
    """The data set's own checks of its files that list directories only (image folders: the validation split must
    have exactly the training split's classes)."""
    check = get_dataset(data.name).check_data
    if check is not None:
        check(data)


def build_dataset(data: Any, split: str, transform: Callable | None,
                  read_file: Callable[[str], Any] | None = None) -> Dataset:
    """The ``split`` ('train' or 'val') of the data set registered as ``data.name`` (quest.data.registry).

    ``read_file(path)``: how each image file is to be read (a training input pipeline's choice: torchvision's decoder,
    or the bytes untouched), passed on to a data set that reads image files (``reads_files=True``), whose builder
    takes it as the keyword ``read_file``; other data sets, and None, keep their own reader (PIL)."""
    dataset = get_dataset(data.name)
    if read_file is None or not dataset.reads_files:  # in-memory data sets hand over what they hold
        return dataset.build(data, split, transform)
    return dataset.build(data, split, transform, read_file=read_file)


def dataset_targets(ds: Dataset) -> np.ndarray:
    """Integer class of every sample, without decoding images where the data set records them."""
    for attr in ("targets", "labels"):
        values = getattr(ds, attr, None)  # read once: data=fake draws its labels when asked
        if values is not None:
            return np.asarray(values)
    raise TypeError(f"cannot read the class labels of {type(ds).__name__}")


def class_balanced_subset(ds: Dataset, fraction: float, seed: int) -> Dataset:
    """The same ``fraction`` of every class (at least one image each), drawn with ``seed`` (paper Table A2)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"data.subset_fraction must be in (0, 1], got {fraction}")
    if fraction == 1.0:
        return ds
    targets = dataset_targets(ds)
    rng = np.random.default_rng(seed)
    keep = []
    for c in np.unique(targets):
        idx = np.flatnonzero(targets == c)
        keep.append(rng.choice(idx, size=max(1, round(fraction * len(idx))), replace=False))
    subset = Subset(ds, np.sort(np.concatenate(keep)).tolist())
    subset.targets = targets[subset.indices].tolist()  # type: ignore[attr-defined]
    return subset
