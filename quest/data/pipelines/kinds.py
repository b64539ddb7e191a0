"""What a training input pipeline is and how one registers (``data.pipeline=<name>``): :class:`TrainInput`, what a
pipeline builds, :func:`register_train_input`, the decorator a pipeline's module applies to its builder, and the
registry it fills. The built-in pipelines (quest/data/pipelines/tensor_input.py) and a user's own import this module;
finding a pipeline by name, which imports them first, is quest.data.pipelines.train_input, above them. No torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["TrainInput", "TrainInputKind", "register_train_input", "registered", "jitter_active"]


@dataclass(frozen=True)
class TrainInput:
    """What a pipeline builds for the training split.

    ``transform`` runs per sample in the loader's workers; ``collate`` makes a batch of its outputs (``(images,
    targets, n_skipped)``); ``finish(images, device)``, when set, turns a collated batch into the model's float input
    on the device; ``read_file(path)``, when set, is how a data set that reads image files reads one for this
    pipeline (quest.data.datasets.build_dataset passes it on).
    """

    transform: Callable[[Any], Any]
    collate: Callable[[list], tuple[Any, Any, int]]
    finish: Callable[[Any, Any], Any] | None
    label: str  # what the run's summary and log record as its training input
    read_file: Callable[[str], Any] | None = None


@dataclass(frozen=True)
class TrainInputKind:
    name: str
    build: Callable[[Any, Any, int], TrainInput]  # (recipe, data, img_size) -> TrainInput
    check: Callable[[Any], None] | None  # given quest.config.checks.Checks: the recipe keys it cannot follow
    reads_files: bool  # True: needs a data set that reads image files (quest.data.registry DataSet.reads_files)
    description: str
    # True: decodes on the CPU and can follow data.draft_decode (decode at reduced size; quest.data.pipelines.draft)
    draft_decode: bool = False


_REGISTRY: dict[str, TrainInputKind] = {}


def register_train_input(name: str, description: str, *, check: Callable[[Any], None] | None = None,
                         reads_files: bool = False, draft_decode: bool = False) -> Callable:
    """Decorator: ``build(recipe, data, img_size) -> TrainInput`` becomes ``data.pipeline=<name>``. ``draft_decode``:
    the builder follows ``data.draft_decode`` (otherwise that setting is refused with this pipeline)."""
    def decorate(build: Callable[[Any, Any, int], TrainInput]) -> Callable[[Any, Any, int], TrainInput]:
        _REGISTRY[name] = TrainInputKind(name, build, check, reads_files, description, draft_decode)
        return build

    return decorate


def registered() -> dict[str, TrainInputKind]:
    """Every pipeline registered so far, by name (what their modules have registered as they were imported)."""
    return _REGISTRY


def jitter_active(recipe: Any) -> bool:
    """timm's rule (create_transform): colour jitter applies unless an auto-augment policy other than 3-Augment is
    on. quest passes ``color_jitter=null`` as 0.0, which timm still builds as a ColorJitter of strength 0."""
    policy = recipe.get("auto_augment")
    return bool(recipe.get("color_jitter")) and (not policy or "3a" in policy)
