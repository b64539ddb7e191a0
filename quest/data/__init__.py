"""Data sets, transforms and samplers.

Names are imported on first use (PEP 562): the config schema, the data set registry and the settings of each data
set (quest.data.config, quest.data.registry, quest.data.sets) import no torch, so ``--help`` and tab completion
stay fast; the rest loads torch when first asked for.
"""
from __future__ import annotations

import importlib
from typing import Any

from .config import DataConfig
from .registry import get_dataset, list_datasets, register_dataset

_LAZY = {
    "build_dataset": "datasets", "check_split_classes": "datasets", "class_balanced_subset": "datasets",
    "dataset_targets": "datasets", "known_num_classes": "datasets",
    "DigitsCanvasDataset": "sets.digits_canvas",
    "CorruptImageError": "folder", "SafeImageFolder": "folder", "check_image_folder": "folder",
    "collate_skipping_bad": "folder",
    "ResumableSampler": "sampling", "ShardSampler": "sampling", "build_train_sampler": "sampling",
    "ShardError": "shard_index", "WdsDataset": "shards", "shard_loaders": "shards",
    "build_transforms": "pipelines.transforms",
    **dict.fromkeys(["TrainInput", "build_train_input", "list_train_inputs", "get_train_input", "register_train_input"],
                    "pipelines.train_input"),
}

__all__ = ["DataConfig", "get_dataset", "list_datasets", "register_dataset", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
