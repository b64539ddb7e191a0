"""WebDataset tar shards (``data=imagenet_wds``): the layout timm and Hugging Face publish, read sequentially,
every sample exactly once per epoch across ranks and data-loader workers (docs/distributed.md, "Sharded input").

Layout: ``${data.root}/_info.json`` lists each split's shards and their sample counts (timm's ``splits.<name>.
{filenames, shard_lengths, num_samples}``); a sample is the consecutive tar members ``{key}.jpg`` (or png/webp/...)
and ``{key}.cls`` (the class index as text). ``data.train_split`` / ``data.val_split`` name a split of it, or a
shard pattern relative to the root (``imagenet1k-train-{0000..1023}.tar``).

Why not timm's ``ReaderWds`` or webdataset's splitters: both hand out whole shards to ranks and workers and pad or
cut each worker's stream to an equal length (``with_epoch``), so with unequal shards some samples come twice in an
epoch and others not at all, and a bad sample is skipped with a warning. Here the split is per sample, from the
known shard lengths, and the tar format is read with the standard library, so there is no extra dependency.

The epoch stream (training): the shards in an order drawn from (seed, epoch), concatenated; then each window of
``data.shuffle_window`` consecutive samples permuted, drawn from (seed, epoch, window). Rank r of W takes the
contiguous positions [r M, (r + 1) M) of that stream, M = floor(N / (W B)) B for batch B (the last N - W M
positions are the epoch's documented remainder); its batch b is positions r M + b B ... and data-loader worker p of K
yields batches p, p + K, ..., which PyTorch's loader returns in round-robin order: the batch sequence of a rank does
not depend on the number of workers, and a resumed epoch skips exactly the batches already consumed.
Validation: the shards in listed order, rank r takes its contiguous N / W share (shares differ by at most one),
nothing shuffled, padded or dropped. Finding and indexing the shards: quest/data/shard_index.py; writing shards
(from an ImageFolder) and _info.json: quest/tools/make_shards.py.
"""
from __future__ import annotations

import io
import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .folder import CorruptImageError
from .shard_index import IMAGE_EXTS, Shard, ShardError, load_info, open_tar, resolve_shards, sample_groups

log = logging.getLogger(__name__)

__all__ = ["WdsDataset", "WdsLoader", "build_shards", "shard_loaders"]

@dataclass
class _Raw:
    path: Path
    key: str
    ext: str
    image: bytes
    cls: bytes


class _Cursor:
    """Reads samples by position in a concatenation of shards, moving forward: each shard is opened once and the
    samples between two wanted ones are skipped without reading their data."""

    def __init__(self, shards: Sequence[Shard]):
        self.shards = shards
        self.starts = np.concatenate([[0], np.cumsum([s.length for s in shards])])
        self.k, self.tar, self.groups, self.next_index = -1, None, None, 0

    def _open(self, k: int) -> None:
        self.close()
        self.k, self.tar, self.next_index = k, open_tar(self.shards[k].path), 0
        self.groups = sample_groups(self.tar)

    def read(self, position: int) -> _Raw:
        k = int(np.searchsorted(self.starts, position, side="right")) - 1
        index = position - int(self.starts[k])
        if k != self.k or index < self.next_index:
            self._open(k)
        shard = self.shards[k]
        while True:
            group = next(self.groups, None)
            if group is None:
                raise ShardError(f"shard {shard.path} ends after {self.next_index} samples, but its stated length "
                                 f"is {shard.length} (_info.json or the count at start)")
            self.next_index += 1
            if self.next_index > index:
                break
        key, members = group
        ext = next((e for e in IMAGE_EXTS if e in members), None)
        if ext is None:
            raise ShardError(f"{shard.path}: sample {key!r} has no image ({', '.join(IMAGE_EXTS)}); its files: "
                             f"{sorted(members)}")
        if "cls" not in members:
            raise ShardError(f"{shard.path}: sample {key!r} has no .cls file (the class index as text); its files: "
                             f"{sorted(members)}")
        read = lambda m: self.tar.extractfile(m).read()  # noqa: E731
        return _Raw(shard.path, key, ext, read(members[ext]), read(members["cls"]))

    def close(self) -> None:
        if self.tar is not None:
            self.tar.close()
        self.tar = None


# --- the epoch stream ----------------------------------------------------------------------------------------------
@dataclass
class _EpochPlan:
    shards: list[Shard]  # in reading order
    window: int  # positions are permuted within windows of this many (validation: an identity, read per window)
    seed: tuple[int, int] | None  # (seed, epoch) of the permutations; None: no shuffle
    total: int

    def chunks(self, positions: np.ndarray) -> list[np.ndarray]:
        return np.split(positions, np.flatnonzero(np.diff(positions // self.window)) + 1) if len(positions) else []

    def sources(self, chunk: np.ndarray) -> np.ndarray:
        """Where the stream positions of one window come from in the concatenated shards."""
        if self.seed is None:
            return chunk
        j = int(chunk[0]) // self.window
        size = min(self.window, self.total - j * self.window)
        perm = np.random.default_rng([*self.seed, 1, j]).permutation(size)
        return j * self.window + perm[chunk - j * self.window]


class WdsDataset(IterableDataset):
    """One split of a shard set. ``len()`` is the split's sample count; :meth:`distribute` sets this process's rank,
    batch size and seed; :meth:`set_epoch` (shared with persistent workers) the epoch and the batches to skip."""

    def __init__(self, shards: list[Shard], *, train: bool, transform: Callable | None = None, num_classes: int,
                 classes: list[str] | None = None, bad_images: str = "error", shuffle_window: int = 8192):
        if bad_images not in ("error", "skip"):
            raise ValueError(f"data.bad_images must be 'error' or 'skip', got {bad_images!r}")
        self.shards, self.train, self.transform = shards, train, transform
        self.num_classes, self.classes, self.bad_images = num_classes, classes, bad_images
        self.window = max(1, int(shuffle_window))
        self.total = sum(s.length for s in shards)
        # (epoch, batches already consumed): in shared memory, so persistent workers see each new epoch
        self._epoch = torch.zeros(2, dtype=torch.int64).share_memory_()
        self.distribute(0, 1, 1)

    def __len__(self) -> int:
        return self.total

    def distribute(self, rank: int, world_size: int, batch_size: int, seed: int = 0) -> None:
        self.rank, self.world_size, self.batch_size, self.seed = rank, world_size, batch_size, seed
        if self.train:
            self.num_batches = self.total // (world_size * batch_size)  # equal on every rank: DDP steps in lockstep
            if self.num_batches == 0:
                raise ShardError(f"the training shards hold {self.total} samples, fewer than one global batch "
                                 f"({batch_size} x {world_size} processes); lower data.batch_size")
            self.first, self.count = rank * self.num_batches * batch_size, self.num_batches * batch_size
        else:
            lo, hi = self.total * rank // world_size, self.total * (rank + 1) // world_size
            self.first, self.count = lo, hi - lo
            self.num_batches = -(-self.count // batch_size)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """``start``: samples of this rank's epoch already consumed (a whole number of batches)."""
        if start % self.batch_size:
            raise ValueError(f"a shard epoch resumes at a batch boundary; start={start} with batch {self.batch_size}")
        self._epoch[0], self._epoch[1] = epoch, start // self.batch_size

    def _plan(self, epoch: int) -> _EpochPlan:
        if not self.train:
            return _EpochPlan(self.shards, self.batch_size, None, self.total)
        order = np.random.default_rng([self.seed, epoch, 0]).permutation(len(self.shards))
        return _EpochPlan([self.shards[i] for i in order], self.window, (self.seed, epoch), self.total)

    def worker_positions(self, worker: int, num_workers: int) -> np.ndarray:
        """Stream positions worker ``worker`` of ``num_workers`` yields this epoch, in order: batches worker,
        worker + K, ... of this rank after the consumed ones."""
        consumed = int(self._epoch[1]) if self.train else 0
        batches = np.arange(consumed + worker, self.num_batches, num_workers)
        pos = (self.first + batches[:, None] * self.batch_size + np.arange(self.batch_size)).ravel()
        return pos[pos < self.first + self.count]

    def _raw_samples(self, worker: int, num_workers: int) -> Iterator[_Raw]:
        plan = self._plan(int(self._epoch[0]))
        cursor = _Cursor(plan.shards)
        try:
            for chunk in plan.chunks(self.worker_positions(worker, num_workers)):
                sources = plan.sources(chunk)
                held = {int(s): cursor.read(int(s)) for s in np.sort(sources)}  # one window, read forward
                for s in sources:
                    yield held.pop(int(s))
        finally:
            cursor.close()

    def worker_keys(self, worker: int, num_workers: int) -> list[str]:
        """The sample keys a worker yields this epoch (reads the shards, decodes nothing): for tests and checks."""
        return [raw.key for raw in self._raw_samples(worker, num_workers)]

    def _decode(self, raw: _Raw) -> tuple[Any, int] | None:
        try:
            target = int(raw.cls.decode().strip())
        except (UnicodeDecodeError, ValueError):
            raise ShardError(f"{raw.path}: {raw.key}.cls holds {raw.cls[:32]!r}, not a class index") from None
        if not 0 <= target < self.num_classes:
            raise ShardError(f"{raw.path}: {raw.key}.cls is class {target}, outside 0..{self.num_classes - 1} "
                             f"(data.num_classes={self.num_classes})")
        try:
            with Image.open(io.BytesIO(raw.image)) as im:
                img = im.convert("RGB")
        except Exception as exc:  # PIL raises several types for truncated / non-image data
            name = f"{raw.path}:{raw.key}.{raw.ext}"
            if self.bad_images == "error":
                raise CorruptImageError(f"cannot read image {name}: {exc}. Set data.bad_images=skip to skip such "
                                        "samples.") from exc
            log.warning("skipping unreadable image %s (%s)", name, exc)
            return None
        return (self.transform(img) if self.transform is not None else img), target

    def __iter__(self) -> Iterator[tuple[Any, int] | None]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None and self.train:
            # augmentation randomness per (seed, epoch, rank, worker, resume point), whether workers persist or not
            state = np.random.SeedSequence([self.seed, *self._epoch.tolist(), self.rank, worker]).generate_state(1)
            torch.manual_seed(int(state[0]))
            random.seed(int(state[0]))
            np.random.seed(int(state[0]))
        for raw in self._raw_samples(worker, num_workers):
            yield self._decode(raw)


class _EpochControl:
    """``loader.sampler`` of a :class:`WdsLoader`, what the trainer drives: ``set_epoch(epoch, start)`` and
    ``len(loader.sampler.sampler)`` (this rank's samples in a full epoch), as with ``ResumableSampler``."""

    def __init__(self, dataset: WdsDataset):
        self.dataset = dataset

    @property
    def sampler(self) -> _EpochControl:
        return self

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.dataset.set_epoch(epoch, start)

    def __len__(self) -> int:
        return self.dataset.num_batches * self.dataset.batch_size if self.dataset.train else self.dataset.count


class WdsLoader(DataLoader):
    """A DataLoader over a distributed :class:`WdsDataset`; ``len()`` is this rank's batches per epoch."""

    def __init__(self, dataset: WdsDataset, **kwargs: Any):
        super().__init__(dataset, batch_size=dataset.batch_size, drop_last=False, **kwargs)
        # An iterable data set takes no sampler; the trainer still calls loader.sampler.set_epoch (DataLoader only
        # reads .sampler without batching, and this loader always batches).
        object.__setattr__(self, "sampler", _EpochControl(dataset))

    def __len__(self) -> int:
        return self.dataset.num_batches


def shard_loaders(train: WdsDataset, val: WdsDataset, *, rank: int, world_size: int, batch_size: int,
                  eval_batch_size: int, seed: int, **loader_kwargs: Any) -> tuple[WdsLoader, WdsLoader]:
    """Training and validation loaders over shards: each data set splits itself by rank and worker."""
    train.distribute(rank, world_size, batch_size, seed)
    val.distribute(rank, world_size, eval_batch_size)
    return (WdsLoader(train, generator=torch.Generator(), **loader_kwargs),
            WdsLoader(val, generator=torch.Generator(), **loader_kwargs))


def build_shards(data: Any, split: str, transform: Callable | None) -> WdsDataset:
    """The ``split`` ('train' or 'val') of a shard set from a DataConfig."""
    if not data.root or data.root == "???":
        raise ValueError(f"data={data.name} needs data.root=<directory of the shards and their _info.json>")
    root = Path(data.root).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"data={data.name}: data.root={root} does not exist or is not a directory")
    name = data.train_split if split == "train" else data.val_split
    shards = resolve_shards(root, name, count=data.num_samples is not None)
    total = sum(s.length for s in shards)
    if split == "train" and data.num_samples is not None and data.num_samples != total:
        raise ShardError(f"the shards of split {name!r} under {root} hold {total} samples, but data.num_samples="
                         f"{data.num_samples}")
    info, _ = load_info(root)
    return WdsDataset(shards, train=split == "train", transform=transform, num_classes=data.num_classes,
                      classes=info.get("classes"), bad_images=data.bad_images, shuffle_window=data.shuffle_window)
