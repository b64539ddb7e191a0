"""Training samplers whose order is a pure function of (seed, epoch), so a run can resume mid-epoch."""
from __future__ import annotations

from typing import Iterator

import torch
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import Dataset, DistributedSampler, Sampler

__all__ = ["EpochShuffle", "ResumableSampler", "ShardSampler", "build_train_sampler"]


class EpochShuffle(Sampler[int]):
    """A random permutation of the data set drawn from (seed, epoch): the single-process counterpart of
    ``DistributedSampler(shuffle=True)``, reproducible without touching the global RNG."""

    def __init__(self, size: int, seed: int = 0):
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        # DistributedSampler's own seeding, so that W processes with batch b see exactly the global batches one
        # process with batch W x b sees (tests/train/test_distributed.py relies on this).
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.size, generator=g).tolist())

    def __len__(self) -> int:
        return self.size


class ResumableSampler(Sampler[int]):
    """Wraps a sampler with ``set_epoch`` and can start an epoch after the first ``start`` samples,
    which is how a resumed run continues exactly where the interrupted one stopped."""

    def __init__(self, sampler: Sampler[int]):
        self.sampler, self.start = sampler, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.sampler.set_epoch(epoch)
        self.start = start

    def __iter__(self) -> Iterator[int]:
        indices = list(self.sampler)
        return iter(indices[self.start :])

    def __len__(self) -> int:
        return len(self.sampler) - self.start


def build_train_sampler(dataset: Dataset, seed: int, world_size: int, rank: int, repeats: int) -> ResumableSampler:
    """DeiT's choice: repeated augmentation (timm ``RepeatAugSampler``) in distributed runs when the recipe asks
    for it, a distributed shuffle otherwise; one process gets a seeded epoch shuffle."""
    if world_size > 1 and repeats > 0:
        # timm rounds each rank's share down to a multiple of 256 images; timm before 1.0.31 did so for a data set of
        # fewer than 256 images too, selecting none: no rounding there gives 1.0.31's choice on every timm release
        selected_round = 256 if len(dataset) >= 256 else 0
        inner: Sampler[int] = RepeatAugSampler(dataset, num_replicas=world_size, rank=rank, num_repeats=repeats,
                                               shuffle=True, selected_round=selected_round)
    elif world_size > 1:
        inner = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed, drop_last=True)
    else:
        inner = EpochShuffle(len(dataset), seed)
    return ResumableSampler(inner)


class ShardSampler(Sampler[int]):
    """Rank r of W takes samples r, r + W, ...: every sample exactly once over all ranks, no padding, no shuffle,
    so distributed evaluation counts nothing twice."""

    def __init__(self, size: int, rank: int = 0, world_size: int = 1):
        self.indices = list(range(rank, size, world_size))

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
