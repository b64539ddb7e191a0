"""Explanations and their localization against bounding boxes (the QUEST paper's Table 6 and Figure 1).

For every image of the chosen set: the maps of each method (quest.explain: [CLS] attention, rollout, AG-CAM), the
localization metrics against the image's boxes under the AG-CAM authors' protocol (docs/explain.md), and for a few
images the maps themselves (``explain_maps.pt``) and a figure (``explain.png``) in the evaluation's directory.
Sources: the checkpoint's own data set when it has boxes (``data=digits_canvas``), or ImageNet val with its boxes
(``eval.roots.val`` + ``eval.explain.boxes``, an XML folder or a LOC_val_solution.csv).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional

import numpy as np
import torch
import torch.distributed as dist
import torchvision.transforms as T
from PIL import Image

from quest.config.checks import Checks
from quest.explain import AGCAM_GRADIENTS, METHODS, check_explainable
from quest.explain.boxes import BoxSource, resize_boxes, resize_crop_boxes
from quest.explain.localization import LocalizationScores
from quest.explain.scoring import normalised_maps, score_explanations
from quest.store.files import atomic_write
from quest.store.records import bounded, described, listed, one_of
from quest.store.tree import make_dirs

from ..context import EvalRun, evenly_spaced, shard_batches
from ..inputs import Input, data_input
from ..kinds import register_evaluation
from ..progress import Inner
from ..settings import BATCH_SIZE, SAMPLE_COUNT
from ..transforms import describe, eval_transform
from .classification import val_input, val_samples, val_split

__all__ = ["ExplainConfig", "explain"]

SOURCES, TRANSFORMS, CLASSES = ("data", "imagenet_val"), ("eval", "squash"), ("predicted", "label")
#: squash's resampling: torchvision Resize((S, S))'s default (the AG-CAM authors' localization.py) | bicubic
SQUASH_INTERPOLATIONS = {"bilinear": T.InterpolationMode.BILINEAR, "bicubic": T.InterpolationMode.BICUBIC}


@dataclass
class ExplainConfig:
    """Explanation maps (attention, rollout, AG-CAM) scored against true boxes (localization)."""

    # explanation methods: attention | rollout | agcam
    methods: List[str] = field(default_factory=lambda: ["attention", "rollout", "agcam"], metadata={
        **one_of(*METHODS), **listed(min_length=1), **described(f"a list of {list(METHODS)}")})
    # on the min-max normalised map (the authors' --threshold 0.5)
    threshold: float = field(default=0.5, metadata=bounded(0, 1, open_low=True, open_high=True))
    # predicted | label (the data set's): the class each map explains
    classes: str = field(default="predicted", metadata=one_of(*CLASSES))
    skip_wrong: bool = True  # leave misclassified images out of the metrics, as the authors do
    # eval (the model's resize + crop) | squash (the authors' Resize((S, S)))
    transform: str = field(default="eval", metadata=one_of(*TRANSFORMS))
    # squash's resampling: bilinear (the authors' Resize default) | bicubic
    squash_interpolation: str = field(default="bilinear", metadata=one_of(*SQUASH_INTERPOLATIONS))
    # detached (the authors' ViT: attention inputs detached) | full (whole graph)
    agcam_gradient: str = field(default="detached", metadata=one_of(*AGCAM_GRADIENTS))
    # data (the data set's own boxes: digits_canvas) | imagenet_val (roots.val + boxes)
    source: str = field(default="data", metadata=one_of(*SOURCES))
    # imagenet_val: a folder of ILSVRC2012_val_*.xml or a LOC_val_solution.csv (a path; required there, _check)
    boxes: Optional[str] = None
    # None: every image; else an evenly spaced fixed subset
    max_samples: Optional[int] = field(default=None, metadata=SAMPLE_COUNT)
    # None: eval.batch_size (AG-CAM keeps every layer's attention for backward)
    batch_size: Optional[int] = field(default=None, metadata=BATCH_SIZE)
    # the first N images of the subset in the figure and in explain_maps.pt
    figure_images: int = field(default=8, metadata=bounded(0, 256, **described("an integer in 0..256 (0: no figure)")))
    figure_indices: Optional[List[int]] = field(default=None, metadata=bounded(0, 2**31 - 1, **described(
        "a list of data-set indices, each in 0..2**31-1")))  # or these data-set indices


def _check(c: Checks, key: str) -> None:
    if c.value(f"{key}.source") == "imagenet_val" and not c.value(f"{key}.boxes"):
        c.fail(f"{key}.boxes", "must name the boxes of ImageNet val (an XML folder or LOC_val_solution.csv)")


SQUASH_PROTOCOL = {"bilinear": "bilinear (the authors': torchvision's default)", "bicubic": "bicubic"}
AGCAM_PROTOCOL = {
    "detached": "detached: every attention block's input detached, the gradient reaches a layer's attention through "
                "the residual stream and the later MLPs only (the AG-CAM authors' ViT_for_AGCAM)",
    "full": "full: the gradient through the whole graph, later attention layers included",
}


class _ImageNetBoxes(torch.utils.data.Dataset):
    """ImageNet val images under the chosen transform, and their boxes mapped exactly as the image."""

    def __init__(self, samples: list[tuple[str, int]], source: BoxSource, transform: Callable,
                 map_boxes: Callable[[np.ndarray, tuple[int, int]], np.ndarray]):
        self.samples, self.source, self.transform, self.map_boxes = samples, source, transform, map_boxes

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        path, label = self.samples[i]
        with Image.open(path) as img:
            return self.transform(img.convert("RGB")), label

    def boxes(self, i: int) -> np.ndarray:
        path = Path(self.samples[i][0])
        with Image.open(path) as img:
            size = img.size
        return self.map_boxes(self.source(path.stem).boxes, size)


def _geometry(run: EvalRun, section: Any) -> tuple[Callable, Callable[[np.ndarray, tuple[int, int]], np.ndarray]]:
    """The image transform and the same mapping for boxes."""
    t = run.target
    if section.transform == "squash":
        resample = SQUASH_INTERPOLATIONS[section.squash_interpolation]
        transform = T.Compose([T.Resize((t.img_size, t.img_size), interpolation=resample),
                               T.ToTensor(), T.Normalize(t.mean, t.std)])
        return transform, lambda b, size: resize_boxes(b, size, t.img_size)
    return eval_transform(t), lambda b, size: resize_crop_boxes(b, size, t.img_size, t.crop_pct)


def _require_boxes(run: EvalRun, dataset: Any) -> Any:
    """``dataset``, which must have bounding boxes (checked with the suite's inputs, before any evaluation runs)."""
    if not hasattr(dataset, "boxes"):
        raise ValueError(f"explain: data={run.target.data.name} has no bounding boxes; use data=digits_canvas (or "
                         "another data set with boxes), or eval.explain.source=imagenet_val with eval.roots.val and "
                         "eval.explain.boxes")
    return dataset


def _dataset(run: EvalRun, section: Any):
    transform, map_boxes = _geometry(run, section)
    if section.source == "imagenet_val":
        return _ImageNetBoxes(val_samples(run), BoxSource(section.boxes), transform, map_boxes), transform
    dataset = _require_boxes(run, val_split(run, transform, "explain"))
    size = dataset.boxes_frame  # (width, height) of the image its boxes' coordinates are in
    boxed = _Mapped(dataset, lambda i: map_boxes(dataset.boxes(i), size))
    return boxed, transform


class _Mapped(torch.utils.data.Dataset):
    def __init__(self, dataset, boxes: Callable[[int], np.ndarray]):
        self.dataset, self.boxes = dataset, boxes

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return self.dataset[i]


def _sum_counts(run: EvalRun, *counts: int) -> list[int]:
    t = torch.tensor(counts, dtype=torch.int64, device=run.device)
    if run.dist.distributed:
        dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


def _summed(scores: LocalizationScores, run: EvalRun) -> LocalizationScores:
    if not run.dist.distributed:
        return scores
    keys = ("pixel_acc", "iou", "dice", "precision", "recall", "n")
    t = torch.tensor([float(getattr(scores, k)) for k in keys], dtype=torch.float64, device=run.device)
    dist.all_reduce(t)
    values = t.tolist()
    return LocalizationScores(*values[:5], int(values[5]))


def _figure(run: EvalRun, section: Any, dataset, indices: list[int], model) -> dict[str, str]:
    """explain_maps.pt and explain.png for the figure images (the first process only)."""
    from quest.explain.figures import explanation_grid

    if not indices or run.out_dir is None or not run.dist.is_main:
        return {}
    images = torch.stack([dataset[i][0] for i in indices]).to(run.device)
    labels = [int(dataset[i][1]) for i in indices]
    with torch.no_grad():
        predicted = model(images).argmax(dim=1)
    target = predicted if section.classes == "predicted" else torch.tensor(labels, device=run.device)
    # the figure's maps, one method at a time: as long as a scored batch of its size, told as the batches are
    progress = run.progress("explain figure", len(section.methods), unit="method")
    maps: dict[str, torch.Tensor] = {}
    for method in section.methods:
        maps.update(normalised_maps(model, images, [method], target, section.agcam_gradient))
        progress.update(extra=f"{method} maps of {len(indices)} image(s)")
    mean = torch.tensor(run.target.mean).view(1, -1, 1, 1)
    std = torch.tensor(run.target.std).view(1, -1, 1, 1)
    pictures = (images.cpu() * std + mean).clamp(0, 1)
    boxes = [dataset.boxes(i) for i in indices]
    make_dirs(run.out_dir)
    maps_path = run.out_dir / "explain_maps.pt"
    atomic_write(maps_path, lambda f: torch.save({
        "indices": indices, "labels": labels, "predictions": predicted.tolist(),
        "images": (pictures * 255).round().to(torch.uint8), "boxes": [torch.from_numpy(b) for b in boxes],
        "maps": {m: v.half() for m, v in maps.items()}, "attention": run.target.info.get("attention"),
        "agcam_gradient": section.agcam_gradient,
    }, f))
    png = explanation_grid(pictures, [(m, maps[m]) for m in section.methods], run.out_dir / "explain.png", boxes,
                           [f"#{i} {lab}->{pred}" for i, lab, pred in zip(indices, labels, predicted.tolist())],
                           title=f"{run.target.info.get('attention')} ({run.target.info.get('evaluated', '')})",
                           row_key="row label: #sample index, true class -> predicted class")
    return {"maps_file": str(maps_path), "figure": str(png)}


def _inputs(run: EvalRun, section: Any) -> list[Input]:
    """The images explained and their boxes: ImageNet val with eval.explain.boxes, or the configured data set, which
    must have boxes; and a model the [CLS]-row methods apply to. Each checked before the suite's first evaluation."""
    def boxes() -> Any:
        check_explainable(run.model)  # the model's requirement, judged with the data's
        return BoxSource(section.boxes)

    if section.source == "imagenet_val":
        return [val_input(run), Input("eval.explain.boxes", str(section.boxes), boxes)]
    def with_boxes(read: Callable[[], Any]) -> Callable[[], Any]:
        def check() -> Any:
            dataset = _require_boxes(run, read())
            check_explainable(run.model)
            return dataset
        return check

    return [dataclasses.replace(item, check=with_boxes(item.check)) for item in data_input(run, "explain")]


def _needs(section: Any) -> list[tuple[str, str, str]]:
    needs = [("scipy", "eval", "the localization metrics of eval=explain")]
    if section.figure_images or section.figure_indices:
        needs.append(("matplotlib", "report", "the explanation figure (explain.png)"))
    return needs


@register_evaluation("explain", ExplainConfig, check=_check, needs=_needs, inputs=_inputs)
def explain(run: EvalRun, section: Any) -> dict[str, Any]:
    check_explainable(run.model)
    dataset, transform = _dataset(run, section)
    indices = evenly_spaced(len(dataset), section.max_samples)
    batch = section.batch_size or run.settings.batch_size
    inner = Inner(None, unit="method")  # each method's maps inside a batch, by time (eval.log_every_s)
    tally = score_explanations(run.model, shard_batches(run, dataset, indices, batch, "explain", inner=inner),
                               dataset.boxes, list(section.methods), section.threshold, section.classes,
                               section.skip_wrong, section.agcam_gradient, progress=inner)
    images, wrong = _sum_counts(run, tally.images, tally.wrong)
    result: dict[str, Any] = {m: _summed(tally.scores[m], run).means() for m in section.methods}
    shown = list(section.figure_indices) if section.figure_indices else indices[:section.figure_images]
    result.update(_figure(run, section, dataset, shown, run.model))
    result.update({
        "images": images, "misclassified": wrong, "scored": result[section.methods[0]]["n"],
        "transform": describe(transform),
        "protocol": {
            "classes": f"the {section.classes} class of each image",
            "misclassified": "left out (the AG-CAM authors' localization.py)" if section.skip_wrong else "scored",
            "threshold": f"{section.threshold} on the min-max normalised map, upsampled bilinearly to the input size",
            "boxes": "the bounding boxes of the 8-connected regions above the threshold (OpenCV's external contour "
                     "boxes), filled inclusive, against the union of every ground-truth box of the image",
            "geometry": (f"squash: Resize((S, S)), {SQUASH_PROTOCOL[section.squash_interpolation]}, box "
                         "coordinates scaled and truncated (the authors')"
                         if section.transform == "squash" else
                         "eval: the model's resize + center crop, boxes mapped and clipped the same way"),
            "agcam_gradient": (AGCAM_PROTOCOL[section.agcam_gradient] if "agcam" in section.methods
                               else "AG-CAM not run"),
            "metrics": "per image, eps 1e-5, averaged over the scored images (miou = mean IoU)",
            "source": section.source if section.source == "data" else f"imagenet_val, boxes {section.boxes}",
        },
    })
    return result
