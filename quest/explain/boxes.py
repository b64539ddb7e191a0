"""Bounding boxes of ImageNet's validation images, in the layouts users have, and their mapping through the eval
transform (exactly as the image is resized and cropped).

- ILSVRC2012 validation bounding-box XML files, one per image, PASCAL VOC format (``ILSVRC2012_bbox_val_v3.tgz``:
  ``val/ILSVRC2012_val_00000001.xml``; Kaggle's ``Annotations/CLS-LOC/val/``): ``<size><width>/<height>`` and one
  ``<object><name>wnid</name><bndbox><xmin>..`` per object.
- ``LOC_val_solution.csv`` (Kaggle's ImageNet localization challenge): ``ImageId,PredictionString`` with
  ``wnid xmin ymin xmax ymax`` repeated per object; the image's size comes from the image itself.

Boxes are (xmin, ymin, xmax, ymax) in pixels of the original image, every object of the image (the AG-CAM authors
score against the union of all of them).
"""
from __future__ import annotations

import csv
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = ["ImageBoxes", "read_voc_xml", "read_loc_solution", "resize_boxes", "resize_crop_boxes", "BoxSource"]


@dataclass(frozen=True)
class ImageBoxes:
    boxes: np.ndarray  # (N, 4) int64, original pixels
    wnids: tuple[str, ...]
    size: tuple[int, int] | None  # (width, height) when the annotation states it


def read_voc_xml(path: str | Path) -> ImageBoxes:
    """One ILSVRC / PASCAL VOC annotation file."""
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as exc:
        raise ValueError(f"{path}: not a readable PASCAL VOC annotation ({exc})") from exc
    size = root.find("size")
    wh = (int(size.findtext("width")), int(size.findtext("height"))) if size is not None else None
    boxes, wnids = [], []
    for obj in root.iter("object"):
        box = obj.find("bndbox")
        if box is None:
            continue
        boxes.append([int(float(box.findtext(k))) for k in ("xmin", "ymin", "xmax", "ymax")])
        wnids.append(obj.findtext("name") or "")
    if not boxes:
        raise ValueError(f"{path}: no <object><bndbox> in this annotation")
    return ImageBoxes(np.asarray(boxes, dtype=np.int64), tuple(wnids), wh)


def read_loc_solution(path: str | Path) -> dict[str, ImageBoxes]:
    """Every image's boxes from a ``LOC_val_solution.csv``, by image id (the file name without extension)."""
    out: dict[str, ImageBoxes] = {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames is None or not {"ImageId", "PredictionString"} <= set(reader.fieldnames):
            raise ValueError(f"{path}: expected the columns ImageId,PredictionString of LOC_val_solution.csv")
        for row in reader:
            parts = row["PredictionString"].split()
            if len(parts) % 5:
                raise ValueError(f"{path}: {row['ImageId']}: PredictionString is not groups of 'wnid xmin ymin xmax ymax'")
            groups = [parts[i:i + 5] for i in range(0, len(parts), 5)]
            boxes = np.asarray([[int(float(v)) for v in g[1:]] for g in groups], dtype=np.int64).reshape(-1, 4)
            out[row["ImageId"]] = ImageBoxes(boxes, tuple(g[0] for g in groups), None)
    return out


def resize_boxes(boxes: np.ndarray, size: tuple[int, int], out: int | tuple[int, int]) -> np.ndarray:
    """Boxes of a ``size`` = (width, height) image resized to ``out`` (the AG-CAM authors' ``Resize((224, 224))``):
    each coordinate scaled and truncated to an int, as their data set does (``int(x / width * 224)``)."""
    w, h = size
    ow, oh = (out, out) if isinstance(out, int) else out
    b = np.asarray(boxes, dtype=np.float64)
    scaled = np.stack([b[:, 0] / w * ow, b[:, 1] / h * oh, b[:, 2] / w * ow, b[:, 3] / h * oh], axis=1)
    return np.trunc(scaled).astype(np.int64)


def resize_crop_boxes(boxes: np.ndarray, size: tuple[int, int], img_size: int, crop_pct: float) -> np.ndarray:
    """Boxes through timm's eval transform: the shorter side resized to int(img_size / crop_pct) (torchvision's
    Resize(int): the longer side int(r * long / short)), then a center crop of img_size (torchvision's offsets);
    clipped to the crop, and boxes left with no area dropped."""
    w, h = size
    short = int(img_size / crop_pct)
    ow, oh = (short, int(short * h / w)) if w <= h else (int(short * w / h), short)
    left, top = int(round((ow - img_size) / 2.0)), int(round((oh - img_size) / 2.0))
    b = np.asarray(boxes, dtype=np.float64)
    x = np.stack([b[:, 0] * ow / w, b[:, 2] * ow / w], axis=1) - left
    y = np.stack([b[:, 1] * oh / h, b[:, 3] * oh / h], axis=1) - top
    out = np.stack([x[:, 0], y[:, 0], x[:, 1], y[:, 1]], axis=1)
    out = np.clip(np.trunc(out), 0, img_size - 1).astype(np.int64)
    keep = (out[:, 2] > out[:, 0]) & (out[:, 3] > out[:, 1])
    return out[keep]


class BoxSource:
    """The boxes of ImageNet validation images by image id, from a folder of XML files or a LOC_val_solution.csv."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        if self.path.is_file():
            self._table: dict[str, ImageBoxes] | None = read_loc_solution(self.path)
        elif self.path.is_dir():
            self._table = None
            if not any(self.path.glob("*.xml")):
                raise FileNotFoundError(f"{self.path}: no <image id>.xml annotation files (ILSVRC2012 bbox val "
                                        "layout) in this folder")
        else:
            raise FileNotFoundError(f"{self.path} does not exist; expected a folder of ILSVRC2012_val_*.xml files or "
                                    "a LOC_val_solution.csv")

    def __call__(self, image_id: str) -> ImageBoxes:
        if self._table is not None:
            if image_id not in self._table:
                raise KeyError(f"{self.path} has no boxes for {image_id}")
            return self._table[image_id]
        xml = self.path / f"{image_id}.xml"
        if not xml.is_file():
            raise KeyError(f"no annotation {xml} for {image_id}")
        return read_voc_xml(xml)
