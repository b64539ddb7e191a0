"""Top-1 / top-5 / NLL on a classification test set: one evaluator, parameterised by data.

ImageNet val, ImageNet-v2, ImageNet-A, ImageNet-R and the configured data set's val split (``clean``) differ only
in what a :class:`ClassificationSet` states: the root and its layout (how a label is read from the folders), the
class list labels index into, the logit columns scored (A/R: 200 of the 1000), the variants (v2's three test sets)
and the clean-subset comparison (A/R: ImageNet val restricted to the same 200 classes). Each protocol is that of
the published numbers (docs/evaluation.md).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from torch.utils.data import Dataset

from quest.data import build_dataset
from quest.store import records

from ..context import EvalRun, SubsetLogits, classify, fixed_subset
from ..imagenet_data import LAYOUTS, V2_DIR, ImageList, imagenet_wnids, require_dir, subset_classes, v2_samples, wnid_samples
from ..inputs import Input, data_input, listed
from ..kinds import register_evaluation
from ..settings import SAMPLE_COUNT
from ..transforms import describe, eval_transform

__all__ = ["ClassificationSet", "imagenet_val", "imagenet_v2", "imagenet_a", "imagenet_r", "clean", "val_samples",
           "val_input", "val_split", "require_imagenet_classifier", "V2_VARIANTS"]

V2_VARIANTS = ("matched-frequency", "threshold0.7", "top-images")


@dataclass
class ImageNetValConfig:
    """ImageNet val top-1 / top-5 (eval.roots.val)."""


@dataclass
class ImageNetV2Config:
    """ImageNetV2 top-1 / top-5, each variant on its own (eval.roots.v2)."""

    # ImageNetV2 variants scored, each on its own
    variants: List[str] = field(default_factory=lambda: list(V2_VARIANTS), metadata={
        **records.one_of(*V2_VARIANTS), **records.listed(distinct=True),
        **records.described(f"a list of distinct variants from {', '.join(V2_VARIANTS)}")})


@dataclass
class ImageNetSubsetConfig:
    """ImageNet-A / ImageNet-R: top-1 on their 200 classes (eval.roots.a / eval.roots.r)."""

    # also report the "ImageNet-200" clean number: val restricted to the same 200 classes (needs eval.roots.val)
    clean_subset: bool = True


@dataclass
class CleanConfig:
    """Top-1 / top-5 on the configured data set's val split."""

    # None: the whole val split; else an evenly spaced fixed subset
    max_samples: Optional[int] = field(default=None, metadata=SAMPLE_COUNT)


def require_imagenet_classifier(run: EvalRun, what: str) -> None:
    if run.target.num_classes != 1000:
        raise ValueError(f"{what} needs a 1000-class ImageNet classifier; this model has "
                         f"{run.target.num_classes} classes")


def val_samples(run: EvalRun) -> list[tuple[str, int]]:
    """ImageNet val (eval.roots.val) as (path, label), labels from the 1000 sorted wnids (listed once per run)."""
    root = require_dir(run.settings.roots.val, "val", "imagenet_val")
    return listed(run, ("val", str(root)), lambda: wnid_samples(root, imagenet_wnids(), "val", "imagenet_val"))


def val_input(run: EvalRun) -> Input:
    """ImageNet val (eval.roots.val) as an input: every wnid folder listed and readable."""
    return Input("eval.roots.val", str(run.settings.roots.val), lambda: val_samples(run))


def val_split(run: EvalRun, transform: Any, what: str) -> Dataset:
    """The configured data set's val split (the checkpoint's data, or data=<name>)."""
    data = run.target.data
    if data is None:
        raise ValueError(f"{what} evaluates a data set: pass data=<name> (e.g. data=digits) with model=..., or "
                         "evaluate a checkpoint (its data config is stored in it)")
    return build_dataset(data, "val", transform)


@dataclass(frozen=True)
class ClassificationSet:
    """One classification test set, as data; calling it with (run, section) evaluates it."""

    name: str
    # eval.roots.<root> (its layout: imagenet_data.LAYOUTS[root]); None: the configured data set's val split, an
    # evenly spaced subset of section.max_samples
    root: Optional[str] = None
    # "wnid": <root>/<wnid>/<image>, label = the wnid's position in the class list; "index": <root>/<int>/<image>,
    # label = int(folder name) (never a string sort)
    layout: str = "wnid"
    # None: every class of the model; "a" | "r": timm's 200 ImageNet-A/-R classes, the logits restricted to their
    # columns before the argmax, top-5 and NLL, labels = positions among their sorted wnids
    classes: Optional[str] = None
    # a folder under the root per entry of section.variants ("{variant}" in it), each scored on its own (v2)
    variants: Optional[str] = None
    # report how many of the 1000 classes have a folder (a partial copy keeps right labels, but says so)
    count_classes: bool = False

    def __call__(self, run: EvalRun, section: Any) -> dict[str, Any]:
        if self.root is not None:
            require_imagenet_classifier(run, self.name)
        transform = eval_transform(run.target)
        if self.root is None:
            dataset, subset = fixed_subset(val_split(run, transform, self.name), _get(section, "max_samples"))
            result = classify(run, dataset, run.target.num_classes, what=self.name)
            result.update({"data": run.target.data.name, "subset": subset, "transform": describe(transform)})
            return result
        root = require_dir(run.settings.roots[self.root], self.root, self.name)
        if self.variants is not None:
            result: dict[str, Any] = {"root": str(root), "transform": describe(transform), "label": "int(folder name)"}
            for variant in section.variants:
                what = f"{self.name} {variant}"
                result[variant] = classify(run, ImageList(self._variant(run, root, variant), transform), 1000,
                                           what=what)
            return result
        samples = self._samples(run, root, self.name)
        model, width = self._scored(run)
        result = classify(run, ImageList(samples, transform), width, model, what=self.name)
        if self.count_classes:
            result["classes_present"] = len({t for _, t in samples})
        result.update({"root": str(root), "transform": describe(transform)})
        if self.count_classes and result["classes_present"] != 1000:
            result["note"] = f"only {result['classes_present']} of the 1000 class folders are present"
        if self.classes is not None:
            result["masking"] = (f"1000-way logits restricted to timm's imagenet_{self.classes}_indices (200 "
                                 "columns, ascending) before argmax; targets in sorted-wnid order")
            if _get(section, "clean_subset"):
                result.update(self._clean_subset(run, model, transform))
        return result

    def _wnids(self) -> tuple[str, ...]:
        return imagenet_wnids() if self.classes is None else subset_classes(self.classes)[1]

    def _samples(self, run: EvalRun, folder: Any, what: str) -> list[tuple[str, int]]:
        """Every (image, label) under ``folder``, listed once per run (inputs.listed)."""
        if self.layout == "index":
            return listed(run, (self.root, str(folder)), lambda: v2_samples(folder, what))
        return listed(run, (self.root, str(folder)), lambda: wnid_samples(folder, self._wnids(), self.root, what))

    def _variant(self, run: EvalRun, root: Any, variant: str) -> list[tuple[str, int]]:
        folder = root / self.variants.format(variant=variant)
        if not folder.is_dir():
            raise FileNotFoundError(f"{self.name}: {folder} does not exist; expected layout {LAYOUTS[self.root]} "
                                    f"(or drop the variant: eval.{self.name}.variants=[...])")
        return self._samples(run, folder, f"{self.name} {variant}")

    def inputs(self, run: EvalRun, section: Any) -> list[Input]:
        """The data this set reads: the configured data set, or its root (each variant folder, each class folder
        listed) and, for the ImageNet-200 clean numbers, ImageNet val."""
        if self.root is None:
            return data_input(run, self.name)

        def check() -> None:
            require_imagenet_classifier(run, self.name)
            root = require_dir(run.settings.roots[self.root], self.root, self.name)
            if self.variants is not None:
                for variant in section.variants:
                    self._variant(run, root, variant)
            else:
                self._samples(run, root, self.name)

        found = [Input(f"eval.roots.{self.root}", str(run.settings.roots[self.root]), check)]
        if self.classes is not None and _get(section, "clean_subset") and run.settings.roots.val is not None:
            found.append(val_input(run))
        return found

    def _scored(self, run: EvalRun) -> tuple[Any, int]:
        """The model whose logits are scored and their width."""
        if self.classes is None:
            return run.model, 1000
        return SubsetLogits(run.model, subset_classes(self.classes)[0]), 200  # argmax over the subset columns only

    def _clean_subset(self, run: EvalRun, model: Any, transform: Any) -> dict[str, Any]:
        """ImageNet val restricted to this set's classes and scored the same way ("ImageNet-200")."""
        if run.settings.roots.val is None:
            return {"imagenet200_clean": None, "note": "set eval.roots.val for the ImageNet-200 clean number"}
        position = {w: i for i, w in enumerate(self._wnids())}
        all_wnids = imagenet_wnids()
        clean = [(p, position[all_wnids[t]]) for p, t in val_samples(run) if all_wnids[t] in position]
        if not clean:
            return {"imagenet200_clean": None, "note": f"{run.settings.roots.val} has none of the 200 classes"}
        return {"imagenet200_clean": classify(run, ImageList(clean, transform), 200, model,
                                              what=f"{self.name} imagenet200_clean")}


def _get(section: Any, key: str) -> Any:
    """A section's setting; None without a section (imagenet_val run for another evaluation's clean error)."""
    return None if section is None else section.get(key)


imagenet_val = ClassificationSet("imagenet_val", root="val", count_classes=True)
imagenet_v2 = ClassificationSet("imagenet_v2", root="v2", layout="index", variants=V2_DIR)
imagenet_a = ClassificationSet("imagenet_a", root="a", classes="a")
imagenet_r = ClassificationSet("imagenet_r", root="r", classes="r")
clean = ClassificationSet("clean")

register_evaluation("imagenet_val", ImageNetValConfig, inputs=imagenet_val.inputs)(imagenet_val)
register_evaluation("imagenet_v2", ImageNetV2Config, inputs=imagenet_v2.inputs)(imagenet_v2)
register_evaluation("imagenet_a", ImageNetSubsetConfig, inputs=imagenet_a.inputs)(imagenet_a)
register_evaluation("imagenet_r", ImageNetSubsetConfig, inputs=imagenet_r.inputs)(imagenet_r)
register_evaluation("clean", CleanConfig, inputs=clean.inputs)(clean)
