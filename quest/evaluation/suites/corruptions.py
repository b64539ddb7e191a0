"""ImageNet-C's corruptions applied on the fly to any data set, at the model's input resolution.

Each image goes through the eval resize/crop (PIL), is corrupted (uint8, as ImageNet-C stored its images), then
converted to a tensor and normalised. The corruption of sample i is seeded from (seed, corruption, severity, i),
so the numbers do not depend on batch size, workers or the number of processes. The corruption grid's settings
(:class:`CorruptionGridConfig`) are ImageNet-C's too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

from PIL import Image
from torch.utils.data import Dataset

from quest.store.records import bounded, described, listed, one_of

from ..context import EvalRun, classify, error_fraction, error_grid, fixed_subset
from ..corruption_fns import corrupt, sample_seed
from ..inputs import data_input
from ..kinds import register_evaluation
from ..mce import IMAGENET_C_CORRUPTIONS, IMAGENET_C_EXTRA, corruption_summary
from ..settings import EVAL_SEED, SAMPLE_COUNT
from ..transforms import describe, split_eval_transform
from .classification import val_split

__all__ = ["CorruptionGridConfig", "CorruptionsConfig", "CorruptedDataset", "corruptions", "CORRUPTION_NEEDS"]


def _sublist(allowed: list[str], what: str) -> dict[str, Any]:
    return {**one_of(*allowed), **listed(distinct=True), **described(f"a list of distinct {what} from "
                                                                      f"{', '.join(allowed)}")}


@dataclass
class CorruptionGridConfig:
    # the standard corruptions run (the 15 enter the means, and ImageNet-C's mCE)
    corruptions: List[str] = field(default_factory=lambda: list(IMAGENET_C_CORRUPTIONS), metadata=_sublist(
        IMAGENET_C_CORRUPTIONS, "standard corruptions"))
    # the extra corruptions, reported apart
    extra_corruptions: List[str] = field(default_factory=lambda: list(IMAGENET_C_EXTRA), metadata=_sublist(
        IMAGENET_C_EXTRA, "extra corruptions"))
    severities: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 5], metadata={  # severities run, 1..5
        **bounded(1, 5), **listed(distinct=True), **described("a list of distinct severities from 1, 2, 3, 4, 5")})


@dataclass
class CorruptionsConfig(CorruptionGridConfig):
    """Corruptions computed on the fly (imagecorruptions) on the configured data set's val split."""

    # None: the whole val split; else an evenly spaced fixed subset
    max_samples: Optional[int] = field(default=None, metadata=SAMPLE_COUNT)
    # each sample's corruption randomness is seeded from (seed, corruption, severity, index), through numpy's
    # SeedSequence, which takes non-negative integers only
    seed: int = field(default=0, metadata=EVAL_SEED)


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


# what imagecorruptions and quest's ports of its functions import (the [eval] extra)
CORRUPTION_NEEDS = [(module, "eval", "the ImageNet-C corruptions") for module in ("imagecorruptions", "cv2", "scipy",
                                                                                   "skimage")]


@register_evaluation("corruptions", CorruptionsConfig, needs=CORRUPTION_NEEDS,
                     inputs=lambda run, section: data_input(run, "corruptions"))
def corruptions(run: EvalRun, section: Any) -> dict[str, Any]:
    geometric, finish = split_eval_transform(run.target)
    base, subset = fixed_subset(val_split(run, geometric, "corruptions"), section.max_samples)
    num_classes = run.target.num_classes
    clean = classify(run, CorruptedDataset(base, finish, None, 0, section.seed), num_classes, what="corruptions clean")
    errors = error_grid(run, "corruptions", list(section.corruptions) + list(section.extra_corruptions),
                        list(section.severities), lambda c, s: CorruptedDataset(base, finish, c, s, section.seed),
                        num_classes)
    result = corruption_summary(errors, list(section.corruptions), list(section.extra_corruptions),
                                error_fraction(clean["correct"], clean["n"]))
    result.update({
        "clean": clean, "data": run.target.data.name, "subset": subset, "seed": section.seed,
        "resolution": run.target.img_size,
        "pipeline": f"{describe(geometric)} -> corruption (uint8, ImageNet-C strengths) -> {describe(finish)}",
        "note": "no AlexNet normaliser exists for this data set: mean_error is the unnormalised mean over the "
                "standard corruptions and severities; relative_mean_error is mean(E_cs - E_clean) with the clean "
                "error of this model on the same samples",
    })
    return result
