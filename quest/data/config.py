"""The keys every data set has (``data.*``); a data set's own options extend it (quest/data/sets/, docs/data.md).

Imports no torch: Hydra's schema (quest.config.schema) and ``--help`` read it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import MISSING

from quest.runtime.workers import process_count
from quest.store.records import SEED_RANGE, bounded, described, listed, one_of

__all__ = ["DataConfig", "need_root", "TRAINING_ONLY", "training_only_keys", "MAX_IMG_SIZE", "image_size", "CROP_FRACTION",
           "BAD_IMAGES"]

#: the largest input side accepted: at 4096 px a ViT with 16 px patches has 65,536 tokens, whose attention matrix
#: alone takes 16 GiB per head in fp32; a larger value is a typo, which would fail deep inside the model's
#: construction (an overflow) or the data (PIL's decompression-bomb guard) instead of with a message
MAX_IMG_SIZE = 4096


def image_size(**metadata: Any) -> dict[str, Any]:
    """Field metadata of an input side in pixels (data.img_size, model.img_size, recipe.img_size): 1..MAX_IMG_SIZE."""
    return bounded(1, MAX_IMG_SIZE, **described(f"an integer in 1..{MAX_IMG_SIZE} (pixels)"), **metadata)


#: the eval crop's share of the resized image (recipe.crop_pct, eval.crop_pct): timm's eval transform resizes the
#: shorter side to img_size / crop_pct before the center crop, so a small value is a resize without bound (at
#: 224 px, 0.002 made each image 112,000 px a side, 37 GB); from 0.1 the resize is at most 10x the crop
CROP_FRACTION = bounded(0.1, 1)


# the images are normalised after ToTensor, in [0, 1]: a mean or deviation outside that range (pixel values 0-255
# given by mistake) trains on inputs of another scale and ends as a divergence that names nothing
_MEAN = {**bounded(0, 1), **listed(3), **described(
    "three values in [0, 1] (R, G, B; pixels are in [0, 1] when normalised: 0.485, not 123.7)")}
_STD = {**bounded(0, 1, open_low=True), **listed(3), **described(
    "three values > 0 and at most 1 (R, G, B; pixels are in [0, 1] when normalised: 0.229, not 58.4)")}

#: field metadata of a data.* key that changes only how the training split is read or batched, never the val split
#: an evaluation scores (its results directory's fingerprint leaves such keys out)
TRAINING_ONLY = {"training_only": True}


#: what a data set does with an image that does not decode: refuse naming it, or leave it out and count it
BAD_IMAGES = ("error", "skip")


@dataclass
class DataConfig:
    """The data=<option> group: the data set, its splits and loaders. Each data set's own options are the fields of
    its settings dataclass, a subclass of this one (``quest.data.list_datasets()``; docs/data.md)."""

    # the registered data set (configs/data/*.yaml; quest.data.list_datasets): checked against that registry, which
    # plugins fill, so no choices here
    name: str = MISSING
    root: Optional[str] = None  # where the data set lives, a path (null: the built-in digits need none)
    batch_size: int = field(default=64, metadata={**TRAINING_ONLY, **bounded(1)})  # per process
    eval_batch_size: Optional[int] = field(default=None, metadata={**TRAINING_ONLY, **bounded(1)})  # None: 2 x batch_size
    # DataLoader worker processes, each with its own copy of the data set's index
    num_workers: int = field(default=0, metadata={**TRAINING_ONLY, **process_count(0)})
    num_classes: int = field(default=MISSING, metadata=bounded(1))  # classes of the data set (set by the data option)
    img_size: Optional[int] = field(default=None, metadata=image_size())  # native resolution when the model does not set one
    mean: List[float] = field(default_factory=lambda: [0.485, 0.456, 0.406], metadata=_MEAN)  # per-channel normalisation mean
    std: List[float] = field(default_factory=lambda: [0.229, 0.224, 0.225], metadata=_STD)  # per-channel normalisation std
    # the split trained on (a folder, or a shard pattern for wds: no range)
    train_split: str = field(default="train", metadata=TRAINING_ONLY)
    val_split: str = "val"  # the split validated on (a folder's name or a shard pattern: no range)
    # class-balanced subset of the training set (paper Table A2)
    subset_fraction: float = field(default=1.0, metadata={**TRAINING_ONLY, **bounded(0, 1, open_low=True)})
    subset_seed: int = field(default=0, metadata={**TRAINING_ONLY, **bounded(*SEED_RANGE)})  # seed of the subset_fraction draw
    # error | skip: what to do with an unreadable image in an image folder
    bad_images: str = field(default="error", metadata=one_of(*BAD_IMAGES))
    # bad_images=skip: the run fails (status bad_data) when more than this share of a split's images is unreadable
    max_skipped_fraction: float = field(default=0.01, metadata=bounded(0, 1))  # docs/data.md
    preflight: bool = True  # image folders: decode every file; shards: read every header (docs/data.md)
    pin_memory: bool = field(default=True, metadata=TRAINING_ONLY)  # DataLoader pin_memory (CUDA)
    # where the training transform runs: timm (workers, PIL; the paper's) | split (workers decode + crop to uint8,
    # the device augments) | device (workers read bytes, the device does the rest): docs/data.md
    # checked against the registry of training inputs, which plugins fill (quest.train.checks)
    pipeline: str = field(default="timm", metadata=TRAINING_ONLY)
    # pipelines that decode on the CPU (timm, split) with image files: decode each JPEG at 1/2, 1/4 or 1/8 where the
    # training crop stays >= the output size (the same crop draws, pixels within a measured tolerance; off: the
    # authors' full-decode pixels): docs/data.md, "Decoding at reduced size"
    draft_decode: bool = field(default=False, metadata=TRAINING_ONLY)


def need_root(data: Any) -> Path:
    """``data.root`` as a path; a ValueError naming the data set when it is unset."""
    if not data.root or data.root == "???":
        raise ValueError(f"data={data.name} needs data.root=<directory>")
    return Path(data.root).expanduser()


def training_only_keys(settings: type) -> set[str]:
    """The keys of a data set's settings dataclass marked :data:`TRAINING_ONLY`."""
    return {f.name for f in dataclasses.fields(settings) if f.metadata.get("training_only")}
