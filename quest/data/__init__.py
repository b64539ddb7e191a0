"""Data sets, transforms and samplers."""
from .datasets import (
    DATASETS,
    build_dataset,
    check_split_classes,
    class_balanced_subset,
    dataset_targets,
    known_num_classes,
)
from .digits_canvas import DigitsCanvasDataset
from .folder import CorruptImageError, SafeImageFolder, check_image_folder, collate_skipping_bad
from .sampling import ResumableSampler, ShardSampler, build_train_sampler
from .shards import SHARD_DATASETS, ShardError, WdsDataset, shard_loaders
from .transforms import build_transforms

__all__ = [
    "DigitsCanvasDataset",
    "DATASETS",
    "build_dataset",
    "class_balanced_subset",
    "dataset_targets",
    "known_num_classes",
    "check_split_classes",
    "CorruptImageError",
    "SafeImageFolder",
    "check_image_folder",
    "collate_skipping_bad",
    "ResumableSampler",
    "ShardSampler",
    "build_train_sampler",
    "build_transforms",
    "SHARD_DATASETS",
    "ShardError",
    "WdsDataset",
    "shard_loaders",
]
