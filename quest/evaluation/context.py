"""What every evaluation works with: the run context (:class:`EvalRun`), loaders that see every sample exactly once
over all processes in a fixed order, and the passes built on them.

Loaders use ``ShardSampler`` (rank r takes samples r, r + W, ...; no shuffle, no padding, no drop_last); metrics
are integer counts of correct predictions summed over processes as integers (:class:`quest.train.counts.Counts`,
re-exported here with :func:`percent` and :func:`error_fraction`), turned into percentages once, in float64; and
order-sensitive scorers (ReaL) get the predictions of all processes put back into data-set order. torchmetrics'
accuracy is not used: its ratio is a float32 division, off by up to 3e-6 points.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset

from quest.data import ShardSampler, collate_skipping_bad
from quest.data.worker_errors import NamedLoader
from quest.runtime.distributed import DistContext
from quest.runtime.workers import die_with_parent
from quest.train.counts import Counts, error_fraction, percent

from .progress import Inner, Progress, tracked
from .target import EvalTarget

__all__ = ["EvalRun", "Counts", "percent", "error_fraction", "make_loader", "batches", "shard_batches", "classify",
           "ordered_topk", "error_grid", "sum_over_processes", "SubsetLogits", "evenly_spaced", "fixed_subset"]


@dataclass
class EvalRun:
    """Everything an evaluation needs besides its own config section."""

    target: EvalTarget
    dist: DistContext
    settings: Any  # the eval config node (roots, batch size, every evaluation's section)
    autocast: Callable[[], ContextManager]
    results: dict[str, dict] = field(default_factory=dict)  # earlier evaluations of this run, by name
    out_dir: Path | None = None  # where the report goes (evaluations that also write files: figures, maps)
    listings: dict[Any, Any] = field(default_factory=dict)  # folder listings of the inputs check (inputs.listed)

    @property
    def device(self) -> torch.device:
        return self.dist.device

    @property
    def model(self) -> nn.Module:
        return self.target.model

    def progress(self, what: str, total: int, samples: int | None = None, unit: str = "batch",
                 nested: bool = False) -> Progress:
        """A progress logger for one loop at the configured cadence; only the first process logs, and with several
        processes the counts are its own share."""
        if self.dist.world_size > 1:
            what = f"{what} [rank 0 of {self.dist.world_size}]"
        return Progress(what, total, samples, unit, every_n=self.settings.get("log_every_n", 0),
                        every_s=self.settings.get("log_every_s", 10.0), nested=nested, enabled=self.dist.is_main)


def make_loader(run: EvalRun, dataset: Dataset, batch_size: int | None = None) -> DataLoader:
    """This process's share of ``dataset`` (every W-th sample from its rank), in order, unreadable images skipped
    by the collate function (batches are (images, targets, skipped))."""
    if isinstance(dataset, IterableDataset):
        raise ValueError("the evaluation suites read their data set by index, and a sharded (WebDataset) data set is "
                         "read as a stream: evaluate the same images from an image folder (data=imagenet "
                         "data.root=... or eval.roots.val=...); the training run's own validation covers the shards")
    return NamedLoader(dataset, batch_size=batch_size or run.settings.batch_size, name="eval",
                       sampler=ShardSampler(len(dataset), run.dist.rank, run.dist.world_size),
                       num_workers=run.settings.num_workers, collate_fn=collate_skipping_bad,
                       pin_memory=run.device.type == "cuda",
                       worker_init_fn=die_with_parent if run.settings.num_workers > 0 else None)


def batches(run: EvalRun, dataset: Dataset, what: str, nested: bool = False,
            batch_size: int | None = None) -> tracked:
    """:func:`make_loader` whose batches are counted into a progress logger named ``what`` (``nested``: a pass
    inside a loop that reports its own progress)."""
    loader = make_loader(run, dataset, batch_size)
    return tracked(loader, run.progress(what, len(loader), len(loader.sampler), nested=nested))


def shard_batches(run: EvalRun, dataset: Dataset, indices: Sequence[int], batch_size: int, what: str,
                  extra: Callable[[], str] | None = None, inner: Inner | None = None
                  ) -> Iterator[tuple[torch.Tensor, torch.Tensor, list[int]]]:
    """(images, targets, data-set indices) on the device for this process's share of ``indices`` (every W-th, as
    :func:`make_loader`), in order; progress lines name the pass ``what`` and end with ``extra()``; ``inner``, when
    given, reports the iterations inside a batch to the pass's progress. For passes whose randomness follows the
    sample index: an unreadable image is an error, not skipped."""
    shard = list(indices)[run.dist.rank::run.dist.world_size]
    loader = make_loader(run, Subset(dataset, list(indices)), batch_size)
    progress = run.progress(what, len(loader), len(shard))
    if inner is not None:
        inner.progress = progress
    done = 0
    for images, targets, skipped in loader:
        if skipped:
            raise RuntimeError(f"{what}: cannot skip unreadable images (sample seeds follow indices)")
        yield images.to(run.device), targets.to(run.device), shard[done:done + len(targets)]
        done += len(targets)
        progress.update(len(targets), extra or "")


def _logits(run: EvalRun, dataset: Dataset, model: nn.Module, what: str,
            nested: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor, int]]:
    """(logits, targets on the device, skipped) of every batch of this process's share, the model in eval mode
    (its mode restored afterwards), the forward under the run's autocast."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for images, targets, skipped in batches(run, dataset, what, nested):
                if len(targets) == 0:
                    continue
                with run.autocast():
                    logits = model(images.to(run.device, non_blocking=True))
                yield logits, targets.to(run.device, non_blocking=True), skipped
    finally:
        model.train(was_training)


def classify(run: EvalRun, dataset: Dataset, num_classes: int, model: nn.Module | None = None,
             what: str = "evaluation", nested: bool = False) -> dict[str, Any]:
    """Micro top-1 / top-5 (percent, from integer counts summed over processes), mean NLL, the counts (``correct``,
    ``top5_correct``) and the sample count ``n`` over ``dataset``; progress lines name the pass ``what``
    (``nested``: a pass inside a loop that reports its own progress). ``num_classes``: the width of the logits
    (the top-5 is a top-``num_classes`` below 5 classes)."""
    counts = Counts()
    for logits, targets, _ in _logits(run, dataset, model or run.model, what, nested):
        counts.update(logits, targets)
    counts = counts.reduced(run.dist)
    result = counts.summary()
    if counts.n != len(dataset):  # unreadable images skipped by the collate function: scored on the others
        result["skipped_unreadable"] = len(dataset) - counts.n
    return result


def ordered_topk(run: EvalRun, dataset: Dataset, k: int, model: nn.Module | None = None,
                 what: str = "evaluation") -> torch.Tensor:
    """The top-``k`` classes of every sample, (len(dataset), k), in data-set order on every process.

    With ShardSampler, local prediction j of rank r is sample r + j * W, so the gathered shards interleave back
    into the original order exactly, with nothing padded or repeated."""
    local = []
    for logits, _, skipped in _logits(run, dataset, model or run.model, what, nested=False):
        if skipped:
            raise RuntimeError("an order-sensitive evaluation cannot skip unreadable images")
        local.append(logits.float().topk(k, dim=1).indices.cpu())
    mine = torch.cat(local) if local else torch.empty(0, k, dtype=torch.long)
    world = run.dist.world_size
    if world == 1:
        return mine
    shards: list[Any] = [None] * world
    dist.all_gather_object(shards, mine)
    out = torch.empty(len(dataset), k, dtype=torch.long)
    for rank, shard in enumerate(shards):
        out[rank::world] = shard
    return out


def error_grid(run: EvalRun, what: str, corruptions: Sequence[str], severities: Sequence[int],
               cell: Callable[[str, int], Dataset], num_classes: int) -> dict[str, dict[int, Fraction]]:
    """The exact error (a Fraction of integer counts) of one :func:`classify` pass per corruption x severity over
    ``cell(corruption, severity)``, with one progress step per cell (the passes inside log by time only)."""
    errors: dict[str, dict[int, Fraction]] = {}
    grid = run.progress(what, len(corruptions) * len(severities), unit="corruption x severity")
    for name in corruptions:
        for severity in severities:
            scored = classify(run, cell(name, int(severity)), num_classes, what=f"{what} {name}/{severity}",
                              nested=True)
            errors.setdefault(name, {})[int(severity)] = error_fraction(scored["correct"], scored["n"])
            grid.update(extra=f"{name} severity {severity}: error {100 - scored['top1']:.2f}%")
    return errors


def sum_over_processes(run: EvalRun, counts: Sequence[int]) -> list[int]:
    """Integer counts summed over all processes, as integers (a collective: every process must call it)."""
    if not run.dist.distributed:
        return [int(c) for c in counts]
    total = torch.tensor([int(c) for c in counts], dtype=torch.int64, device=run.device)
    dist.all_reduce(total)
    return [int(v) for v in total.tolist()]


class SubsetLogits(nn.Module):
    """The columns ``indices`` of a model's logits (ImageNet-A/R: 200 of 1000), so that argmax, top-5 and the NLL
    are taken among the subset classes only."""

    def __init__(self, model: nn.Module, indices: list[int] | tuple[int, ...]):
        super().__init__()
        self.model = model
        self.register_buffer("indices", torch.tensor(list(indices), dtype=torch.long), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        return logits.index_select(1, self.indices.to(logits.device))


def evenly_spaced(total: int, max_samples: int | None) -> list[int]:
    """All indices, or ``max_samples`` of them evenly spread over the data set (deterministic, no RNG)."""
    if max_samples is None or max_samples >= total:
        return list(range(total))
    if max_samples < 1:
        raise ValueError(f"max_samples must be positive, got {max_samples}")
    return np.unique(np.linspace(0, total - 1, max_samples).round().astype(int)).tolist()


def fixed_subset(dataset: Dataset, max_samples: int | None) -> tuple[Dataset, dict[str, Any]]:
    """The data set or an evenly spaced subset of it, with a description for the report."""
    indices = evenly_spaced(len(dataset), max_samples)
    if len(indices) == len(dataset):
        return dataset, {"samples": len(dataset), "of": len(dataset), "selection": "all"}
    subset = Subset(dataset, indices)
    return subset, {"samples": len(indices), "of": len(dataset),
                    "selection": f"{len(indices)} evenly spaced indices (round(linspace(0, {len(dataset) - 1}, "
                                 f"{max_samples})))"}
