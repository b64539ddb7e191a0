"""Data sets, transforms and samplers."""
from .datasets import DATASETS, build_dataset, class_balanced_subset, dataset_targets
from .folder import CorruptImageError, SafeImageFolder, check_image_folder, collate_skipping_bad
from .sampling import ResumableSampler, ShardSampler, build_train_sampler
from .transforms import build_transforms

__all__ = [
    "DATASETS",
    "build_dataset",
    "class_balanced_subset",
    "dataset_targets",
    "CorruptImageError",
    "SafeImageFolder",
    "check_image_folder",
    "collate_skipping_bad",
    "ResumableSampler",
    "ShardSampler",
    "build_train_sampler",
    "build_transforms",
]
