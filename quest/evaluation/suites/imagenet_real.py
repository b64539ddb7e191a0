"""ImageNet-ReaL (Beyer et al. 2020): top-1 / top-5 against the reassessed label sets, with timm's
RealLabelsImagenet fed in file order (docs/evaluation.md)."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
from timm.data import RealLabelsImagenet

from quest.store.files import parse_json

from ..context import EvalRun, ordered_topk, percent
from ..imagenet_data import LAYOUTS, ImageList, real_files, require_dir
from ..inputs import Input, listed, permission_message
from ..kinds import register_evaluation
from ..transforms import describe, eval_transform
from .classification import require_imagenet_classifier

__all__ = ["ImageNetRealConfig", "imagenet_real"]


@dataclass
class ImageNetRealConfig:
    """ImageNet ReaL top-1 / top-5 (eval.roots.real)."""

    real_json: Optional[str] = None  # None: the real.json timm ships (timm/data/_info/imagenet_real_labels.json)


def _real_labels(section: Any) -> list[list[int]]:
    if section.real_json is None:
        import pkgutil

        return json.loads(pkgutil.get_data("timm.data", "_info/imagenet_real_labels.json"))
    path = Path(section.real_json).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"imagenet_real: real_json {path} does not exist (a JSON list of label lists, "
                                "entry i for ILSVRC2012_val_{i+1:08d}.JPEG)")
    try:
        labels = parse_json(path.read_bytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"imagenet_real: real_json {path} is not valid JSON ({exc}); expected a JSON list of label "
                         "lists, entry i for ILSVRC2012_val_{i+1:08d}.JPEG") from None
    except PermissionError:
        raise PermissionError(permission_message(path, "imagenet_real: real_json")) from None
    if not isinstance(labels, list) or not all(isinstance(x, list) for x in labels):
        raise ValueError(f"imagenet_real: real_json {path} holds a JSON {type(labels).__name__}, not a list of label "
                         "lists (entry i for ILSVRC2012_val_{i+1:08d}.JPEG)")
    return labels


def _ranking_logits(topk: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Logits whose top-k is exactly ``topk`` in order: what RealLabelsImagenet.add_result reads."""
    k = topk.shape[1]
    logits = torch.zeros(topk.shape[0], num_classes)
    logits.scatter_(1, topk, torch.arange(k, 0, -1, dtype=torch.float32).expand(topk.shape[0], k).contiguous())
    return logits


def _files_and_labels(run: EvalRun, section: Any) -> tuple[Path, list[str], list[list[int]]]:
    """The ReaL root, its image files in real.json's order and the label lists, checked against each other."""
    require_imagenet_classifier(run, "imagenet_real")
    key_root = run.settings.roots.real or run.settings.roots.val
    root = require_dir(key_root, "real", "imagenet_real")
    files = listed(run, ("real", str(root)), lambda: real_files(root, "imagenet_real"))
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
    return root, files, labels


def _inputs(run: EvalRun, section: Any) -> list[Input]:
    key = "eval.roots.real" if run.settings.roots.real else "eval.roots.val"
    return [Input(key, str(run.settings.roots.real or run.settings.roots.val), lambda: _files_and_labels(run, section))]


@register_evaluation("imagenet_real", ImageNetRealConfig, inputs=_inputs)
def imagenet_real(run: EvalRun, section: Any) -> dict[str, Any]:
    """ReaL top-1 / top-5 with timm's RealLabelsImagenet, fed in file order; empty label lists are excluded."""
    root, files, labels = _files_and_labels(run, section)
    names = [os.path.basename(f) for f in files]
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
