"""A run's ``explain_maps.pt`` (written by eval=explain, quest.evaluation.suites.explain) as a declared record: read
back only through :func:`read_maps` (quest.explain.figures.load_maps, for ``quest-plot explain``), every field checked
before anything is drawn.

The file's fields (:class:`ExplainMaps`) are checked for their types (quest.store.records), then for what the types
cannot say: the images are K uint8 pictures (K, 3, H, W); indices, labels, predictions and boxes hold one entry per
image; every method's maps are K finite (K, H, W) maps in [0, 1]; each box is (n, 4) finite pixel corners
x0 <= x1, y0 <= y1 inside the image. A file that breaks any is refused, in one line naming the file and the field.
"""
from __future__ import annotations

import pickle
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from quest.store.damage import DamagedFile
from quest.store.records import bounded, check_record

__all__ = ["ExplainMaps", "check_maps", "read_maps"]


@dataclass
class ExplainMaps:
    """explain_maps.pt's fields, as quest.evaluation.suites.explain writes them."""

    indices: list[int] = field(metadata=bounded(0))  # the images' indices in the evaluated data set
    labels: list[int] = field(metadata=bounded(0))  # their true classes
    images: torch.Tensor  # (K, 3, H, W) uint8
    boxes: list[torch.Tensor]  # per image, (n, 4) pixel corners x0, y0, x1, y1
    maps: dict[str, torch.Tensor]  # per method, (K, H, W) in [0, 1]
    predictions: list[int] | None = field(default=None, metadata=bounded(0))
    attention: str | None = None
    agcam_gradient: Any = None


def _fail(path: Path, where: str, problem: str) -> DamagedFile:
    return DamagedFile(path, f"{where} {problem}", joined=": ")


def check_maps(data: Any, path: Path) -> dict[str, Any]:
    """``data`` (a loaded explain_maps.pt) when every field holds what :class:`ExplainMaps` says, else
    :class:`DamagedFile` naming ``path`` and the first field that does not."""
    check_record(ExplainMaps, data, path, "the fields eval=explain writes (indices, labels, images, boxes, maps)")
    images = data["images"]
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3 or 0 in images.shape:
        raise _fail(path, "images", f"is a {images.dtype} tensor of shape {tuple(images.shape)}, expected uint8 "
                                    "(K, 3, H, W) with K, H, W >= 1")
    k, _, h, w = images.shape
    for name in ("indices", "labels", "predictions", "boxes"):
        if data.get(name) is not None and len(data[name]) != k:
            raise _fail(path, name, f"has {len(data[name])} entries for {k} images, expected one per image")
    if not data["maps"]:
        raise _fail(path, "maps", "is empty, expected one method's maps at least")
    for method, maps in data["maps"].items():
        where = f"maps[{method!r}]"
        if not maps.is_floating_point() or tuple(maps.shape) != (k, h, w):
            raise _fail(path, where, f"is a {maps.dtype} tensor of shape {tuple(maps.shape)}, expected floating "
                                     f"point ({k}, {h}, {w}): one map per image, of the image's size")
        values = maps.float()
        if not torch.isfinite(values).all():
            raise _fail(path, where, "holds nan or inf, expected finite values in [0, 1]")
        if values.numel() and (values.min() < 0 or values.max() > 1):
            raise _fail(path, where, f"holds values in [{values.min():g}, {values.max():g}], expected [0, 1]")
    for i, box in enumerate(data["boxes"]):
        where = f"boxes[{i}]"
        if box.dim() != 2 or box.shape[1] != 4 or box.dtype == torch.bool or box.is_complex():
            raise _fail(path, where, f"is a {box.dtype} tensor of shape {tuple(box.shape)}, expected (n, 4) "
                                     "pixel corners x0, y0, x1, y1")
        corners = box.double()
        if not torch.isfinite(corners).all():
            raise _fail(path, where, "holds nan or inf, expected finite pixel corners")
        for x0, y0, x1, y1 in corners.tolist():
            if not (0 <= x0 <= x1 <= w - 1 and 0 <= y0 <= y1 <= h - 1):
                raise _fail(path, where, f"holds the box {[x0, y0, x1, y1]}, expected 0 <= x0 <= x1 <= {w - 1} and "
                                         f"0 <= y0 <= y1 <= {h - 1} (inside the {w}x{h} image)")
    return data


def read_maps(path: Path) -> dict[str, Any]:
    """explain_maps.pt at ``path``, loaded safely (tensors and plain values only) and checked (:func:`check_maps`)."""
    if not path.is_file():
        raise DamagedFile(path, "is not a file, expected the maps eval=explain writes", joined=": ")
    try:
        data = torch.load(path, weights_only=True, map_location="cpu")
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DamagedFile(path, f"cannot be read as explain_maps.pt ({first})", joined=": ") from None
    return check_maps(data, path)
