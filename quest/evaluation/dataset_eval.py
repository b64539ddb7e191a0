"""The configured data set's val split (the checkpoint's data, or data=<name>) and its clean evaluation."""
from __future__ import annotations

from typing import Any, Callable

from torch.utils.data import Dataset

from quest.data import build_dataset

from .metrics import EvalRun, classify, fixed_subset
from .transforms import describe, eval_transform

__all__ = ["val_split", "clean"]


def val_split(run: EvalRun, transform: Callable | None, what: str) -> Dataset:
    data = run.target.data
    if data is None:
        raise ValueError(f"{what} evaluates a data set: pass data=<name> (e.g. data=digits) with model=..., or "
                         "evaluate a checkpoint (its data config is stored in it)")
    return build_dataset(data, "val", transform)


def clean(run: EvalRun, section: Any) -> dict[str, Any]:
    """Top-1 / top-5 / NLL on the val split with the eval transform."""
    transform = eval_transform(run.target)
    dataset, subset = fixed_subset(val_split(run, transform, "clean"), section.max_samples)
    result = classify(run, dataset, run.target.num_classes, what="clean")
    result.update({"data": run.target.data.name, "subset": subset, "transform": describe(transform)})
    return result
