"""ImageNet-C (Hendrycks & Dietterich 2019): per-corruption, per-severity errors on the stored corrupted images, the
AlexNet-normalised mCE and relative mCE (quest.evaluation.mce), the clean error from ImageNet val."""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from ..context import EvalRun, error_fraction, error_grid
from ..imagenet_data import LAYOUTS, ImageList, imagenet_wnids, require_dir, wnid_samples
from ..inputs import Input
from ..kinds import register_evaluation
from ..mce import IMAGENET_C_EXTRA, corruption_summary, mce
from ..transforms import describe, imagenet_c_transform
from .classification import imagenet_val, require_imagenet_classifier, val_input
from .corruptions import CorruptionGridConfig

__all__ = ["ImageNetCConfig", "imagenet_c"]


@dataclass
class ImageNetCConfig(CorruptionGridConfig):
    """ImageNet-C from its files (eval.roots.c): error per corruption and severity, and mCE."""


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


def _cell_folders(run: EvalRun, section: Any) -> dict[tuple[str, int], Path]:
    """Every corruption x severity folder, which must exist."""
    root = require_dir(run.settings.roots.c, "c", "imagenet_c")
    folders = {}
    for c in list(section.corruptions) + list(section.extra_corruptions):
        for s in section.severities:
            folder = root / c / str(s)
            if not folder.is_dir():
                hint = " (or eval.imagenet_c.extra_corruptions=[] without ImageNet-C's extra set)" \
                    if c in IMAGENET_C_EXTRA else ""
                raise FileNotFoundError(f"imagenet_c: {folder} does not exist; expected layout {LAYOUTS['c']}{hint}")
            folders[c, int(s)] = folder
    return folders


def _cell_samples(folder: Path, c: str, s: int) -> list[tuple[str, int]]:
    return wnid_samples(folder, imagenet_wnids(), "c", f"imagenet_c {c}/{s}")


def _inputs(run: EvalRun, section: Any) -> list[Input]:
    def check() -> None:
        require_imagenet_classifier(run, "imagenet_c")
        # every cell listed (layout, readable, not empty) before the first is evaluated; not kept: ImageNet-C's
        # 95 cells hold 4.75 million images, listed again one cell at a time as they are evaluated
        for (c, s), folder in _cell_folders(run, section).items():
            _cell_samples(folder, c, s)

    found = [Input("eval.roots.c", str(run.settings.roots.c), check)]
    if run.settings.roots.val is not None and "imagenet_val" not in run.results:  # the clean error, measured here
        found.append(val_input(run))
    return found


@register_evaluation("imagenet_c", ImageNetCConfig, inputs=_inputs)
def imagenet_c(run: EvalRun, section: Any) -> dict[str, Any]:
    require_imagenet_classifier(run, "imagenet_c")
    root = require_dir(run.settings.roots.c, "c", "imagenet_c")
    transform = imagenet_c_transform(run.target)
    corruptions = list(section.corruptions) + list(section.extra_corruptions)
    folders = _cell_folders(run, section)

    def cell(c: str, s: int) -> ImageList:
        return ImageList(_cell_samples(folders[c, s], c, s), transform)

    errors = error_grid(run, "imagenet_c", corruptions, list(section.severities), cell, 1000)
    clean_error, clean_source = _clean_error(run)
    result = corruption_summary(errors, list(section.corruptions), list(section.extra_corruptions), clean_error)
    result.update(mce(errors, clean_error))
    result.update({"clean_error_source": clean_source, "root": str(root), "transform": describe(transform),
                   "normaliser": "AlexNet mean errors over severities (docs/evaluation.md); AlexNet clean error 0.43478 "
                                 "(1 - 0.56522, torchvision's AlexNet top-1)"})
    return result
