"""Validation: top-1 / top-5 (percent, from integer counts in float64) and mean cross-entropy, summed over ranks."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, ContextManager

import torch
import torch.nn as nn
from torch.utils.data import DataLoader

from quest.runtime.distributed import DistContext, all_reduce_max

from .counts import Counts

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
    """Top-1/top-5 over images (percent) and mean NLL over ``loader``, summed over every process of the group;
    ``first_batch_hook`` sees the first batch's images."""
    was_training = model.training
    model.eval()
    counts = Counts()
    # A sharded (FSDP) forward is a collective: a rank whose shard of the data is shorter keeps stepping with a
    # repeated batch whose outputs are discarded, so no rank waits forever and nothing is counted twice.
    extra = int(all_reduce_max(len(loader), lockstep)) - len(loader) if lockstep is not None else 0
    last = None
    skipped = 0
    for images, targets, n_bad in loader:
        skipped += n_bad
        last = images
        if len(targets) == 0:
            continue
        images, targets = images.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        if first_batch_hook is not None:
            first_batch_hook(images)
            first_batch_hook = None
        with autocast():
            logits = model(images)
        counts.update(logits, targets)
    for _ in range(extra):
        with autocast():
            model(last.to(device))
    model.train(was_training)
    group = _group()
    total = counts.reduced(group).summary()
    if group.world_size > 1:  # every rank's unreadable images (data.bad_images=skip)
        skipped_t = torch.tensor([float(skipped)], device=group.device)
        import torch.distributed as dist

        dist.all_reduce(skipped_t)
        skipped = int(skipped_t.item())
    # images: those scored; skipped: unreadable ones left out (data.bad_images=skip)
    return {f"{prefix}top1": total["top1"], f"{prefix}top5": total["top5"], f"{prefix}loss": total["nll"],
            f"{prefix}images": total["n"], f"{prefix}skipped": skipped}


def _group() -> DistContext:
    """The process group the loader's shards belong to (every rank evaluates its own share)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return DistContext()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), 0, device)
