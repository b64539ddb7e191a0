"""ImageNet-C (Hendrycks & Dietterich 2019): per-corruption, per-severity errors on the stored corrupted images, the
AlexNet-normalised mCE and relative mCE (quest.evaluation.mce), the clean error from ImageNet val."""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from ..context import EvalRun, error_fraction, error_grid
from ..imagenet_data import LAYOUTS, ImageList, imagenet_wnids, require_dir, wnid_samples
from ..mce import IMAGENET_C_EXTRA, corruption_summary, mce
from ..registry import register_evaluation
from ..transforms import describe, imagenet_c_transform
from .classification import imagenet_val, require_imagenet_classifier
from .corruptions import CorruptionGridConfig, check_grid

__all__ = ["ImageNetCConfig", "imagenet_c"]


@dataclass
class ImageNetCConfig(CorruptionGridConfig):
    pass


def _clean_error(run: EvalRun) -> tuple[Fraction | None, str]:
    """The model's clean ImageNet val error: from imagenet_val of this run, else measured when roots.val is set."""
    if "imagenet_val" in run.results:
        val = run.results["imagenet_val"]
        return error_fraction(val["correct"], val["n"]), "imagenet_val of this run"
    if run.settings.roots.val is not None:
        val = imagenet_val(run, None)
        run.results.setdefault("imagenet_val", val)
        return error_fraction(val["correct"], val["n"]), "imagenet_val (measured for the relative mCE)"
    return None, "eval.roots.val not set: relative mCE not computed"


@register_evaluation("imagenet_c", ImageNetCConfig, check=check_grid)
def imagenet_c(run: EvalRun, section: Any) -> dict[str, Any]:
    require_imagenet_classifier(run, "imagenet_c")
    root = require_dir(run.settings.roots.c, "c", "imagenet_c")
    transform = imagenet_c_transform(run.target)
    corruptions = list(section.corruptions) + list(section.extra_corruptions)
    for c in corruptions:
        for s in section.severities:
            if not (root / c / str(s)).is_dir():
                hint = " (or eval.imagenet_c.extra_corruptions=[] without ImageNet-C's extra set)" \
                    if c in IMAGENET_C_EXTRA else ""
                raise FileNotFoundError(f"imagenet_c: {root / c / str(s)} does not exist; expected layout "
                                        f"{LAYOUTS['c']}{hint}")

    def cell(c: str, s: int) -> ImageList:
        return ImageList(wnid_samples(root / c / str(s), imagenet_wnids(), "c", f"imagenet_c {c}/{s}"), transform)

    errors = error_grid(run, "imagenet_c", corruptions, list(section.severities), cell, 1000)
    clean_error, clean_source = _clean_error(run)
    result = corruption_summary(errors, list(section.corruptions), list(section.extra_corruptions), clean_error)
    result.update(mce(errors, clean_error))
    result.update({"clean_error_source": clean_source, "root": str(root), "transform": describe(transform),
                   "normaliser": "AlexNet mean errors over severities (evaluation.md); AlexNet clean error 0.43478 "
                                 "(1 - 0.56522, torchvision's AlexNet top-1)"})
    return result
