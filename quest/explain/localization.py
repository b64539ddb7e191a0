"""Localization of an explanation against bounding boxes, as the AG-CAM authors' ``localization.py`` measures it
(the QUEST paper's Table 6).

Per image: the normalised map is thresholded (> threshold), each 8-connected region of the result becomes its
bounding box (the authors take the bounding rectangles of OpenCV's external contours, which are the regions'
boxes), the boxes are filled into a mask, and that mask is compared with the mask of the union of the image's
ground-truth boxes. Boxes are (xmin, ymin, xmax, ymax) pixel coordinates, filled inclusive of xmax / ymax as the
authors' ``box_to_seg`` does. Pixel accuracy, IoU, Dice, precision and recall are taken per image with the authors'
eps = 1e-5 and averaged over images (mIoU is the mean IoU).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["boxes_to_mask", "map_to_boxes", "LocalizationScores", "localization_scores", "EPS"]

EPS = 1e-5  # the authors' smoothing of every ratio


def boxes_to_mask(boxes: np.ndarray | torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """(H, W) 0/1 float mask of the union of ``boxes`` (N, 4) = (xmin, ymin, xmax, ymax), inclusive ends, clipped to
    the image."""
    h, w = size
    mask = torch.zeros(h, w)
    for xmin, ymin, xmax, ymax in np.asarray(boxes, dtype=np.int64).reshape(-1, 4):
        x0, y0 = max(int(xmin), 0), max(int(ymin), 0)
        mask[y0:max(int(ymax) + 1, y0), x0:max(int(xmax) + 1, x0)] = 1.0
    return mask


def _regions(binary: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Bounding boxes (xmin, ymin, xmax, ymax) of the 8-connected regions of a boolean image."""
    from quest.runtime.extras import require

    ndimage = require("scipy.ndimage", "eval", "the localization metrics of eval=explain")
    labels, count = ndimage.label(binary, structure=np.ones((3, 3), dtype=bool))
    boxes = []
    for rows, cols in ndimage.find_objects(labels)[:count]:
        # OpenCV's boundingRect gives (x, y, w, h) and the authors use (x, y, x + w, y + h): one past the last pixel
        boxes.append((cols.start, rows.start, cols.stop, rows.stop))
    return boxes


def map_to_boxes(saliency: torch.Tensor, threshold: float = 0.5) -> np.ndarray:
    """(N, 4) boxes of the regions where the (H, W) normalised map exceeds ``threshold``."""
    boxes = _regions(saliency.detach().cpu().numpy() > threshold)
    return np.asarray(boxes, dtype=np.int64).reshape(-1, 4)


@dataclass
class LocalizationScores:
    """Sums over images of the per-image scores, and how many images they sum (a mean is sum / n)."""

    pixel_acc: float = 0.0
    iou: float = 0.0
    dice: float = 0.0
    precision: float = 0.0
    recall: float = 0.0
    n: int = 0

    def add(self, other: "LocalizationScores") -> "LocalizationScores":
        return LocalizationScores(*(getattr(self, k) + getattr(other, k) for k in
                                    ("pixel_acc", "iou", "dice", "precision", "recall", "n")))

    def means(self) -> dict[str, float | int]:
        if self.n == 0:
            raise ValueError("no image was scored")
        return {"pixel_acc": self.pixel_acc / self.n, "miou": self.iou / self.n, "dice": self.dice / self.n,
                "precision": self.precision / self.n, "recall": self.recall / self.n, "n": self.n}


def localization_scores(saliency: torch.Tensor, true_boxes: np.ndarray, threshold: float = 0.5) -> LocalizationScores:
    """The scores of one image: its (H, W) normalised map against its ground-truth boxes."""
    size = tuple(saliency.shape[-2:])
    predicted = boxes_to_mask(map_to_boxes(saliency, threshold), size).flatten().double()
    target = boxes_to_mask(true_boxes, size).flatten().double()
    tp = float((predicted * target).sum())
    fp = float((predicted * (1 - target)).sum())
    fn = float(((1 - predicted) * target).sum())
    tn = float(((1 - predicted) * (1 - target)).sum())
    return LocalizationScores(
        pixel_acc=(tp + tn + EPS) / (tp + tn + fp + fn + EPS), iou=(tp + EPS) / (tp + fp + fn + EPS),
        dice=(2 * tp + EPS) / (2 * tp + fp + fn + EPS), precision=(tp + EPS) / (tp + fp + EPS),
        recall=(tp + EPS) / (tp + fn + EPS), n=1)
