"""The training samplers (quest/data/sampling.py) against torch's and timm's own: one process shuffles each epoch as
DistributedSampler does with one replica, every epoch differently; a resumed epoch is the tail of the same order;
ranks split the data set between them."""
from __future__ import annotations

import pytest
from timm.data.distributed_sampler import RepeatAugSampler
from torch.utils.data import DistributedSampler

from quest.data.sampling import EpochShuffle, ResumableSampler, build_train_sampler

N = 50


@pytest.mark.parametrize("seed", [0, 7])
def test_one_process_shuffles_as_distributed_sampler_with_one_replica(seed):
    ours, reference = EpochShuffle(N, seed), DistributedSampler(range(N), num_replicas=1, rank=0, shuffle=True,
                                                                  seed=seed)
    for epoch in range(4):
        ours.set_epoch(epoch)
        reference.set_epoch(epoch)
        assert list(ours) == list(reference)


def test_every_epoch_has_its_own_order_and_each_is_a_permutation():
    sampler = EpochShuffle(N, seed=3)
    orders = []
    for epoch in range(5):
        sampler.set_epoch(epoch)
        orders.append(tuple(sampler))
    assert all(sorted(order) == list(range(N)) for order in orders)
    assert len(set(orders)) == 5  # a sampler that repeats its order every epoch trains on the same batches


def test_a_resumed_epoch_is_the_rest_of_the_same_order():
    full, resumed = ResumableSampler(EpochShuffle(N, 1)), ResumableSampler(EpochShuffle(N, 1))
    full.set_epoch(2)
    resumed.set_epoch(2, start=17)
    assert list(resumed) == list(full)[17:] and len(resumed) == N - 17


@pytest.mark.parametrize("repeats", [0, 3])
def test_ranks_read_their_own_share(repeats):
    per_rank = []
    for rank in range(2):
        sampler = build_train_sampler(list(range(N)), seed=0, world_size=2, rank=rank, repeats=repeats)
        sampler.set_epoch(0)
        per_rank.append(list(sampler))
    if repeats:
        reference = [RepeatAugSampler(list(range(N)), num_replicas=2, rank=r, num_repeats=repeats, shuffle=True)
                     for r in range(2)]
    else:
        reference = [DistributedSampler(list(range(N)), num_replicas=2, rank=r, shuffle=True, seed=0,
                                        drop_last=True) for r in range(2)]
    for r in reference:
        r.set_epoch(0)
    assert per_rank == [list(r) for r in reference]
    if not repeats:
        assert not set(per_rank[0]) & set(per_rank[1])  # disjoint shares
