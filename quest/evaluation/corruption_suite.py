"""ImageNet-C corruptions applied on the fly to any data set, at the model's input resolution.

Each image goes through the eval resize/crop (PIL), is corrupted (uint8, as ImageNet-C stored its images), then
converted to a tensor and normalised. The corruption of sample i is seeded from (seed, corruption, severity, i),
so the numbers do not depend on batch size, workers or the number of processes.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any, Callable

from PIL import Image
from torch.utils.data import Dataset

from .corruption_fns import corrupt, sample_seed
from .dataset_eval import val_split
from .imagenet_c import corruption_summary
from .metrics import EvalRun, classify, error_fraction, fixed_subset
from .transforms import describe, split_eval_transform

__all__ = ["CorruptedDataset", "corruptions"]


class CorruptedDataset(Dataset):
    """``base`` (PIL images at the model's resolution) with one corruption at one severity, then ``finish``."""

    def __init__(self, base: Dataset, finish: Callable, corruption: str | None, severity: int, seed: int):
        self.base, self.finish = base, finish
        self.corruption, self.severity, self.seed = corruption, severity, seed

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int):
        image, target = self.base[index]
        if self.corruption is not None:
            seed = sample_seed(self.seed, self.corruption, self.severity, index)
            image = Image.fromarray(corrupt(image, self.corruption, self.severity, seed))
        return self.finish(image), target


def corruptions(run: EvalRun, section: Any) -> dict[str, Any]:
    geometric, finish = split_eval_transform(run.target)
    base, subset = fixed_subset(val_split(run, geometric, "corruptions"), section.max_samples)
    num_classes = run.target.num_classes
    clean = classify(run, CorruptedDataset(base, finish, None, 0, section.seed), num_classes, what="corruptions clean")
    clean_error = error_fraction(clean["correct"], clean["n"])
    names = list(section.corruptions) + list(section.extra_corruptions)
    errors: dict[str, dict[int, Fraction]] = {}
    grid = run.progress("corruptions", len(names) * len(section.severities), unit="corruption x severity")
    for name in names:
        for severity in section.severities:
            dataset = CorruptedDataset(base, finish, name, int(severity), section.seed)
            scored = classify(run, dataset, num_classes, what=f"corruptions {name}/{severity}", nested=True)
            errors.setdefault(name, {})[int(severity)] = error_fraction(scored["correct"], scored["n"])
            grid.update(extra=f"{name} severity {severity}: error {100 - scored['top1']:.2f}%")
    result = corruption_summary(errors, list(section.corruptions), list(section.extra_corruptions), clean_error)
    result.update({
        "clean": clean, "data": run.target.data.name, "subset": subset, "seed": section.seed,
        "resolution": run.target.img_size,
        "pipeline": f"{describe(geometric)} -> corruption (uint8, ImageNet-C strengths) -> {describe(finish)}",
        "note": "no AlexNet normaliser exists for this data set: mean_error is the unnormalised mean over the "
                "standard corruptions and severities; relative_mean_error is mean(E_cs - E_clean) with the clean "
                "error of this model on the same samples",
    })
    return result
