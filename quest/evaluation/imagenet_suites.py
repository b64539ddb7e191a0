"""ImageNet val, v2, ReaL, A and R, each exactly per docs/evaluation.md (the protocol of the published numbers)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from timm.data import RealLabelsImagenet

from .imagenet_data import (
    LAYOUTS,
    V2_DIR,
    ImageList,
    imagenet_wnids,
    real_files,
    require_dir,
    subset_classes,
    v2_samples,
    wnid_samples,
)
from .metrics import EvalRun, SubsetLogits, classify, ordered_topk, percent
from .transforms import describe, eval_transform

__all__ = ["imagenet_val", "imagenet_v2", "imagenet_real", "imagenet_a", "imagenet_r", "val_samples",
           "require_imagenet_classifier"]


def require_imagenet_classifier(run: EvalRun, what: str) -> None:
    if run.target.num_classes != 1000:
        raise ValueError(f"{what} needs a 1000-class ImageNet classifier; this model has "
                         f"{run.target.num_classes} classes")


def val_samples(run: EvalRun) -> list[tuple[str, int]]:
    root = require_dir(run.settings.roots.val, "val", "imagenet_val")
    return wnid_samples(root, imagenet_wnids(), "val", "imagenet_val")


def imagenet_val(run: EvalRun, section: Any) -> dict[str, Any]:
    """Top-1 (micro), top-5 and NLL on ImageNet val; labels from the 1000 sorted wnids."""
    require_imagenet_classifier(run, "imagenet_val")
    samples = val_samples(run)
    transform = eval_transform(run.target)
    result = classify(run, ImageList(samples, transform), 1000, what="imagenet_val")
    classes = len({t for _, t in samples})
    result.update({"classes_present": classes, "root": str(run.settings.roots.val), "transform": describe(transform)})
    if classes != 1000:
        result["note"] = f"only {classes} of the 1000 class folders are present"
    return result


def imagenet_v2(run: EvalRun, section: Any) -> dict[str, Any]:
    """Each variant's top-1 / top-5 / NLL, label = int(folder name)."""
    require_imagenet_classifier(run, "imagenet_v2")
    root = require_dir(run.settings.roots.v2, "v2", "imagenet_v2")
    transform = eval_transform(run.target)
    result: dict[str, Any] = {"root": str(root), "transform": describe(transform), "label": "int(folder name)"}
    for variant in section.variants:
        folder = root / V2_DIR.format(variant=variant)
        if not folder.is_dir():
            raise FileNotFoundError(f"imagenet_v2: {folder} does not exist; expected layout {LAYOUTS['v2']} "
                                    f"(or drop the variant: eval.imagenet_v2.variants=[...])")
        result[variant] = classify(run, ImageList(v2_samples(folder, f"imagenet_v2 {variant}"), transform), 1000,
                                   what=f"imagenet_v2 {variant}")
    return result


def _real_labels(section: Any) -> list[list[int]]:
    if section.real_json is None:
        import pkgutil

        return json.loads(pkgutil.get_data("timm.data", "_info/imagenet_real_labels.json"))
    path = Path(section.real_json).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"imagenet_real: real_json {path} does not exist (a JSON list of label lists, "
                                "entry i for ILSVRC2012_val_{i+1:08d}.JPEG)")
    return json.loads(path.read_text())


def _ranking_logits(topk: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Logits whose top-k is exactly ``topk`` in order: what RealLabelsImagenet.add_result reads."""
    k = topk.shape[1]
    logits = torch.zeros(topk.shape[0], num_classes)
    logits.scatter_(1, topk, torch.arange(k, 0, -1, dtype=torch.float32).expand(topk.shape[0], k).contiguous())
    return logits


def imagenet_real(run: EvalRun, section: Any) -> dict[str, Any]:
    """ReaL top-1 / top-5 with timm's RealLabelsImagenet, fed in file order; empty label lists are excluded."""
    require_imagenet_classifier(run, "imagenet_real")
    key_root = run.settings.roots.real or run.settings.roots.val
    root = require_dir(key_root, "real", "imagenet_real")
    files = real_files(root, "imagenet_real")
    labels = _real_labels(section)
    names = [os.path.basename(f) for f in files]
    known = {f"ILSVRC2012_val_{i + 1:08d}.JPEG" for i in range(len(labels))}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"imagenet_real: {len(unknown)} files under {root} are not ILSVRC2012 val names covered by "
                         f"real.json (e.g. {unknown[0]}); expected layout {LAYOUTS['real']}")
    if len(names) != len(labels):
        raise ValueError(f"imagenet_real: real.json lists {len(labels)} images but {root} holds {len(names)}; ReaL "
                         "scores the whole val set (every file once)")
    transform = eval_transform(run.target)
    # targets are unused by ReaL; 0 keeps the loader's collation uniform
    topk = ordered_topk(run, ImageList([(f, 0) for f in files], transform), k=5, what="imagenet_real")
    scorer = RealLabelsImagenet(names, real_json=None if section.real_json is None else str(section.real_json),
                                topk=(1, 5))
    batch = 1024
    for start in range(0, len(names), batch):
        scorer.add_result(_ranking_logits(topk[start:start + batch], 1000))
    if scorer.sample_idx != len(names):
        raise RuntimeError(f"ReaL scored {scorer.sample_idx} of {len(names)} images")
    scored = len(scorer.is_correct[1])
    # from the integer counts (timm's get_accuracy rounds twice: a float64 mean, then x 100)
    correct = {k: sum(bool(c) for c in scorer.is_correct[k]) for k in (1, 5)}
    return {"top1": percent(correct[1], scored) if scored else None,
            "top5": percent(correct[5], scored) if scored else None,
            "correct": correct[1], "top5_correct": correct[5],
            "n": scored, "excluded_empty": len(names) - scored, "root": str(root),
            "real_json": section.real_json or "timm/data/_info/imagenet_real_labels.json",
            "transform": describe(transform)}


def _imagenet_subset(run: EvalRun, section: Any, which: str) -> dict[str, Any]:
    name = f"imagenet_{which}"
    require_imagenet_classifier(run, name)
    indices, wnids = subset_classes(which)
    root = require_dir(run.settings.roots[which], which, name)
    transform = eval_transform(run.target)
    masked = SubsetLogits(run.model, indices)  # argmax over the 200 subset columns only
    result: dict[str, Any] = classify(run, ImageList(wnid_samples(root, wnids, which, name), transform), 200, masked,
                                      what=name)
    result.update({"root": str(root), "transform": describe(transform),
                   "masking": f"1000-way logits restricted to timm's imagenet_{which}_indices (200 columns, "
                              "ascending) before argmax; targets in sorted-wnid order"})
    if section.clean_subset:
        if run.settings.roots.val is None:
            result["imagenet200_clean"] = None
            result["note"] = "set eval.roots.val for the ImageNet-200 clean number"
        else:
            position = {w: i for i, w in enumerate(wnids)}
            all_wnids = imagenet_wnids()
            clean = [(p, position[all_wnids[t]]) for p, t in val_samples(run) if all_wnids[t] in position]
            if clean:
                result["imagenet200_clean"] = classify(run, ImageList(clean, transform), 200, masked,
                                                       what=f"{name} imagenet200_clean")
            else:
                result["imagenet200_clean"] = None
                result["note"] = f"{run.settings.roots.val} has none of the 200 classes"
    return result


def imagenet_a(run: EvalRun, section: Any) -> dict[str, Any]:
    return _imagenet_subset(run, section, "a")


def imagenet_r(run: EvalRun, section: Any) -> dict[str, Any]:
    return _imagenet_subset(run, section, "r")
