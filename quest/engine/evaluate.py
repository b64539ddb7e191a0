"""Validation: micro top-1 / top-5 and mean cross-entropy with torchmetrics (reduced across ranks)."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from .distributed import DistContext, all_reduce_max

__all__ = ["evaluate"]


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    num_classes: int,
    autocast: Callable[[], ContextManager] = nullcontext,
    prefix: str = "val/",
    first_batch_hook: Callable[[torch.Tensor], None] | None = None,
    lockstep: DistContext | None = None,
) -> dict[str, float]:
    """Micro top-1/top-5 (percent) and mean NLL over ``loader``; ``first_batch_hook`` sees the first batch's images."""
    was_training = model.training
    model.eval()
    # average="micro": top-1 over images (torchmetrics' MulticlassAccuracy defaults to macro)
    top1 = MulticlassAccuracy(num_classes=num_classes, top_k=1, average="micro").to(device)
    top5 = MulticlassAccuracy(num_classes=num_classes, top_k=min(5, num_classes), average="micro").to(device)
    nll = MeanMetric().to(device)
    # A sharded (FSDP) forward is a collective: a rank whose shard of the data is shorter keeps stepping with a
    # repeated batch whose outputs are discarded, so no rank waits forever and nothing is counted twice.
    extra = int(all_reduce_max(len(loader), lockstep)) - len(loader) if lockstep is not None else 0
    last = None
    for images, targets, _ in loader:
        last = images
        if len(targets) == 0:
            continue
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if first_batch_hook is not None:
            first_batch_hook(images)
            first_batch_hook = None
        with autocast():
            logits = model(images)
        logits = logits.float()
        top1.update(logits, targets)
        top5.update(logits, targets)
        nll.update(F.cross_entropy(logits, targets, reduction="none"))
    for _ in range(extra):
        with autocast():
            model(last.to(device))
    model.train(was_training)
    return {f"{prefix}top1": 100.0 * top1.compute().item(), f"{prefix}top5": 100.0 * top5.compute().item(),
            f"{prefix}loss": nll.compute().item()}
