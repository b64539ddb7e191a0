"""Data sets by config name: digits (default, built in), imagenet / imagefolder, cifar10 / cifar100, fake,
imagenet_wds / wds (tar shards)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import numpy as np
from torch.utils.data import Dataset, Subset
from torchvision import datasets as tvd

from .digits import DigitsDataset
from .digits_canvas import DigitsCanvasDataset
from .folder import SafeImageFolder, check_image_folder
from .preflight import apply_preflight
from .shard_preflight import apply_shard_preflight
from .shards import SHARD_DATASETS, build_shards, shard_num_classes

__all__ = ["build_dataset", "class_balanced_subset", "dataset_targets", "known_num_classes", "check_split_classes",
           "DATASETS"]

DATASETS = ("digits", "digits_canvas", "imagenet", "imagefolder", "cifar10", "cifar100", "fake", *SHARD_DATASETS)
_FIXED_NUM_CLASSES = {"digits": 10, "digits_canvas": 10, "cifar10": 10, "cifar100": 100}


def _need_root(data: Any) -> Path:
    if not data.root or data.root == "???":
        raise ValueError(f"data={data.name} needs data.root=<directory>")
    return Path(data.root).expanduser()


def _folder_classes(data: Any, split: str) -> tuple[Path, list[str]]:
    folder = data.train_split if split == "train" else data.val_split
    root = check_image_folder(_need_root(data) / folder, f"data={data.name} {split} split")
    return root, sorted(p.name for p in root.iterdir() if p.is_dir())  # torchvision's ImageFolder class order


def known_num_classes(data: Any) -> int | None:
    """The class count a data set has (for image folders: its training split's class folders), or None (fake)."""
    if data.name in _FIXED_NUM_CLASSES:
        return _FIXED_NUM_CLASSES[data.name]
    if data.name in ("imagenet", "imagefolder"):
        return len(_folder_classes(data, "train")[1])
    if data.name in SHARD_DATASETS:  # what _info.json states, if it does
        return shard_num_classes(_need_root(data))
    return None


def check_split_classes(data: Any) -> None:
    """Image folders: the validation split must have exactly the training split's classes, since a class index is
    its folder's position in the sorted list; otherwise validation images would be scored as another class."""
    if data.name not in ("imagenet", "imagefolder"):
        return
    (train_root, train), (val_root, val) = _folder_classes(data, "train"), _folder_classes(data, "val")
    if train != val:
        only_train, only_val = sorted(set(train) - set(val)), sorted(set(val) - set(train))
        raise ValueError(
            f"data={data.name}: the class folders of {val_root} differ from those of {train_root} "
            f"(only in train: {only_train[:20]}{' ...' if len(only_train) > 20 else ''}; only in val: "
            f"{only_val[:20]}{' ...' if len(only_val) > 20 else ''}); both splits need the same <class> folders, "
            "since a class index is the folder's position in the sorted list")


def build_dataset(data: Any, split: str, transform: Callable | None) -> Dataset:
    """The ``split`` ('train' or 'val') of the data set named by ``data.name`` (a DataConfig)."""
    name = data.name
    if name == "digits":
        return DigitsDataset(split, data.val_fraction, data.split_seed, transform)
    if name == "digits_canvas":
        c = data.canvas
        return DigitsCanvasDataset(split, size=c.size, scale_min=c.scale_min, scale_max=c.scale_max, clutter=c.clutter,
                                   noise=c.noise, copies=c.copies if split == "train" else 1, seed=c.seed,
                                   val_fraction=data.val_fraction, split_seed=data.split_seed, transform=transform)
    if name in ("imagenet", "imagefolder"):
        root, _ = _folder_classes(data, split)
        ds = SafeImageFolder(root, transform=transform, bad_images=data.bad_images)
        # every file checked before the first step (docs/data.md)
        if data.get("preflight", True):
            apply_preflight(ds, root, data.bad_images, data.get("max_skipped_fraction", 0.01), split)
        if len(ds.classes) != data.num_classes:
            raise ValueError(
                f"{root} has {len(ds.classes)} class folders but data.num_classes={data.num_classes}; "
                f"expected {data.num_classes} sub-directories <class>/<image>"
            )
        return ds
    if name in ("cifar10", "cifar100"):
        cls = tvd.CIFAR10 if name == "cifar10" else tvd.CIFAR100
        root = _need_root(data)
        try:
            return cls(str(root), train=split == "train", transform=transform, download=data.download)
        except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted"
            raise FileNotFoundError(
                f"data={name}: no {name} under {root} ({exc}); place the torchvision archive there "
                "(cifar-10-batches-py / cifar-100-python) or pass data.download=true"
            ) from exc
    if name in SHARD_DATASETS:  # an IterableDataset that splits itself by rank and worker (quest/data/shards.py)
        if data.get("preflight", True):  # every shard header and label checked before the first step
            apply_shard_preflight(data, split)
        return build_shards(data, split, transform)
    if name == "fake":
        size = data.fake_train_size if split == "train" else data.fake_val_size
        image_size = (3, data.img_size, data.img_size)
        # different random_offset per split: train and val images differ, each reproducible
        offset = 0 if split == "train" else 10**6
        return tvd.FakeData(size, image_size, data.num_classes, transform=transform, random_offset=offset)
    raise ValueError(f"unknown data set {name!r}; known: {', '.join(DATASETS)}")


def dataset_targets(ds: Dataset) -> np.ndarray:
    """Integer class of every sample, without decoding images where the data set records them."""
    for attr in ("targets", "labels"):
        if hasattr(ds, attr):
            return np.asarray(getattr(ds, attr))
    if isinstance(ds, tvd.FakeData):
        transform, ds.transform = ds.transform, None
        try:
            return np.asarray([ds[i][1] for i in range(len(ds))])
        finally:
            ds.transform = transform
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
