"""AG-CAM with the authors' detached attention inputs against the full-graph gradient, on one Table-6 twin model
(docs/explain.md, "AG-CAM's gradient"). Per correctly classified validation canvas, as eval=explain scores them: the
Pearson correlation of the two min-max normalised maps at the input size, and the IoU of each against the digit's
box at threshold 0.5; printed as JSON.

    python train.py experiment=table6_localization_cpu attention=standard trainer.seed=0 trainer.torch_threads=1 \
        hydra.run.dir=/tmp/t6_standard_s0
    python docs/results/table6_localization_cpu/agcam_detached_vs_full.py /tmp/t6_standard_s0/checkpoints/last.pt \
        > docs/results/table6_localization_cpu/agcam_detached_vs_full.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from quest.data import build_dataset  # noqa: E402
from quest.train.builders import build_model, resolve_img_size  # noqa: E402
from quest.run.checkpoint import load_checkpoint  # noqa: E402
from quest.evaluation.target import EvalTarget  # noqa: E402
from quest.evaluation.transforms import eval_transform  # noqa: E402
from quest.explain import agcam, to_image  # noqa: E402
from quest.explain.boxes import resize_crop_boxes  # noqa: E402
from quest.explain.localization import localization_scores  # noqa: E402


def _pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.flatten().double(), b.flatten().double()
    a, b = a - a.mean(), b - b.mean()
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


def main(checkpoint: str, batch: int = 60) -> dict:
    torch.set_num_threads(1)
    ckpt = load_checkpoint(checkpoint)
    cfg = OmegaConf.create(ckpt["config"])
    net = build_model(cfg)
    net.load_state_dict(ckpt["model"])
    net.eval()
    size = resolve_img_size(cfg)
    target = EvalTarget(net, int(cfg.data.num_classes), size, tuple(cfg.data.mean), tuple(cfg.data.std),
                        float(cfg.recipe.crop_pct), str(cfg.recipe.eval_interpolation), cfg.data)
    dataset = build_dataset(cfg.data, "val", eval_transform(target))
    canvas = (int(cfg.data.canvas.size),) * 2
    corr, iou_detached, iou_full = [], [], []
    for start in range(0, len(dataset), batch):
        indices = range(start, min(start + batch, len(dataset)))
        images = torch.stack([dataset[i][0] for i in indices])
        labels = torch.tensor([dataset[i][1] for i in indices])
        detached, predicted = agcam(net, images, gradient="detached")
        full, _ = agcam(net, images, gradient="full")
        detached, full = to_image(detached.detach(), size), to_image(full.detach(), size)
        for row, index in enumerate(indices):
            if predicted[row] != labels[row]:
                continue  # left out, as eval=explain (the authors' localization.py)
            boxes = resize_crop_boxes(dataset.boxes(index), canvas, size, target.crop_pct)
            corr.append(_pearson(detached[row], full[row]))
            iou_detached.append(localization_scores(detached[row], boxes, 0.5).means()["miou"])
            iou_full.append(localization_scores(full[row], boxes, 0.5).means()["miou"])
    diff = [abs(a - b) for a, b in zip(iou_detached, iou_full)]
    n = len(corr)
    return {"checkpoint": checkpoint, "scored": n, "images": len(dataset),
            "map_correlation": {"mean": sum(corr) / n, "min": min(corr)},
            "iou_abs_difference": {"mean": sum(diff) / n, "max": max(diff)},
            "miou": {"detached": sum(iou_detached) / n, "full": sum(iou_full) / n}}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1]), indent=2))
