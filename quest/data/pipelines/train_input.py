"""The training input pipelines ``data.pipeline=<name>`` can name: where each step of the training transform runs.

Every pipeline draws the same augmentation (the recipe's RandomResizedCrop, flip, RandAugment, random erasing) from
the same distributions; they differ in where the work is done and so in how many loader processes a GPU needs
(docs/data.md, "Training input pipelines"; docs/benchmarks.md):

- ``timm`` (the default, and the paper's): timm's ``create_transform`` on PIL images, everything in the loader's
  worker processes, float tensors out.
- ``split``: the workers decode (torchvision, libjpeg-turbo) and crop + flip to a uint8 tensor; RandAugment,
  normalisation and random erasing run on the device on whole batches.
- ``device``: the workers only read each file's bytes; the device decodes (nvJPEG on CUDA), crops, flips and does
  the rest. Needs a data set that reads image files.

A pipeline is registered with :func:`register_train_input` (quest/data/pipelines/kinds.py, importable from here
too): a builder ``(recipe, data, img_size) -> TrainInput`` and a check of the config it supports. One of your own is
one module calling it, named in ``QUEST_PIPELINE_MODULES`` (comma-separated) or installed as a ``quest.train_inputs``
entry point (docs/data.md, "Training input pipelines"). This module finds a pipeline by name: listing or getting one
imports the built-in ones first (quest/data/pipelines/tensor_input.py), which register in kinds.py and never import
this module back. It imports no torch; the built-in pipelines do.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from quest.runtime.plugins import import_plugins

from .kinds import TrainInput, TrainInputKind, jitter_active, register_train_input, registered

__all__ = ["TrainInput", "TrainInputKind", "register_train_input", "get_train_input", "list_train_inputs",
           "build_train_input", "jitter_active", "MODULES_ENV", "ENTRY_POINT_GROUP"]


MODULES_ENV = "QUEST_PIPELINE_MODULES"  # comma-separated modules that register pipelines of one's own
ENTRY_POINT_GROUP = "quest.train_inputs"  # or an installed package's entry points in this group


def _load() -> None:
    """Import the built-in pipelines (quest/data/pipelines/tensor_input.py registers them as it is imported, as a
    data set's module does; by name, so that this registry stays below the modules that fill it), the modules of
    ``QUEST_PIPELINE_MODULES`` and the ``quest.train_inputs`` entry points, once (quest.runtime.plugins), as the data
    sets and evaluations are."""
    import_plugins(f"{__package__}.tensor_input", MODULES_ENV, ENTRY_POINT_GROUP, "training input pipeline")


def list_train_inputs() -> list[str]:
    _load()
    return sorted(registered())


def get_train_input(name: str) -> TrainInputKind:
    _load()
    if name not in registered():
        raise ValueError(f"unknown data.pipeline {name!r}; registered: {', '.join(sorted(registered()))}")
    return registered()[name]


def build_train_input(recipe: Any, data: Any, img_size: int) -> TrainInput:
    """The training input of ``data.pipeline``; its label also names a resolution-capped copy of the data (quest-data
    cap) when ``data.root`` is one. ``data`` is today's config (the schema gives every data set ``pipeline``; a stored
    config that predates the key is upgraded where it is read: quest.store.compat.upgrade_data_config)."""
    from quest.store.tool_records import read_capped

    built = get_train_input(data.pipeline).build(recipe, data, img_size)
    capped = read_capped(data.get("root"))
    if capped is None:
        return built
    return dataclasses.replace(built, label=f"{built.label}; storage: {capped['layout']} capped at short side "
                               f"{capped['short_side']} (quest-data cap, {capped['resample']}, JPEG quality "
                               f"{capped['quality']}) from {capped['source']}")
