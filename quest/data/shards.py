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
nothing shuffled, padded or dropped. Writing shards (from an ImageFolder) and _info.json: quest/data/make_shards.py.
"""
from __future__ import annotations

import io
import json
import logging
import random
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .folder import CorruptImageError

log = logging.getLogger(__name__)

__all__ = ["SHARD_DATASETS", "INFO_NAMES", "IMAGE_EXTS", "ShardError", "Shard", "WdsDataset", "WdsLoader",
           "build_shards", "shard_loaders", "shard_num_classes", "expand_braces", "load_info", "resolve_shards",
           "count_samples"]

SHARD_DATASETS = ("imagenet_wds", "wds")
INFO_NAMES = ("_info.json", "info.json")  # timm's reader looks for both
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp")  # the first one a sample has is its image
_PATTERN = re.compile(r"[{*?\[]|\.tar$")


class ShardError(ValueError):
    """Shards that do not hold what the layout says; the message names the file."""


@dataclass(frozen=True)
class Shard:
    path: Path
    length: int  # samples (groups of members sharing a key)


# --- layout --------------------------------------------------------------------------------------------------------
def expand_braces(pattern: str) -> list[str]:
    """``a-{0000..0003}.tar`` -> four names, zero-padded as written; ``{x,y}`` lists; nested and repeated braces."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    body, head, tail = m.group(1), pattern[: m.start()], pattern[m.end():]
    lo, sep, hi = body.partition("..")
    if sep and lo.isdigit() and hi.isdigit():
        width = max(len(lo), len(hi)) if lo.startswith("0") and len(lo) > 1 else 0
        choices = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        choices = body.split(",")
    return [name for c in choices for name in expand_braces(head + c + tail)]


def load_info(root: Path) -> tuple[dict[str, Any], Path | None]:
    for name in INFO_NAMES:
        path = root / name
        if path.is_file():
            try:
                return json.loads(path.read_text()), path
            except json.JSONDecodeError as exc:
                raise ShardError(f"{path} is not valid JSON: {exc}") from exc
    return {}, None


def _info_lengths(info: dict[str, Any]) -> dict[str, int]:
    """Every shard file name the info lists, with its sample count."""
    out: dict[str, int] = {}
    for split in (info.get("splits") or {}).values():
        out.update(zip(split.get("filenames", []), split.get("shard_lengths", [])))
    return out


def _split_files(root: Path, split: str, info: dict[str, Any], info_path: Path | None) -> list[str]:
    if _PATTERN.search(split):
        if re.search(r"[*?\[]", split):
            names = sorted(str(p.relative_to(root)) for p in root.glob(split))
            if not names:
                raise FileNotFoundError(f"no shard under {root} matches {split!r}")
            return names
        return expand_braces(split)
    splits = info.get("splits") or {}
    if split not in splits:
        where = f"{info_path} has the splits {sorted(splits)}" if info_path else f"{root} has no {INFO_NAMES[0]}"
        raise FileNotFoundError(f"no shards for split {split!r}: {where}; name one of its splits or give a shard "
                                "pattern such as imagenet1k-train-{0000..1023}.tar (data.train_split / data.val_split)")
    return list(splits[split]["filenames"])


def resolve_shards(root: Path, split: str, count: bool = False) -> list[Shard]:
    """The shards of ``split`` (an _info.json split or a pattern) with their lengths: from _info.json, else counted
    when ``count`` (a pass over every tar header); every file must exist and hold at least one sample."""
    info, info_path = load_info(root)
    names = _split_files(root, split, info, info_path)
    paths = [root / n for n in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} of the {len(paths)} shards of split {split!r} do not exist: "
                                + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))
    for p in paths:
        if p.stat().st_size == 0:
            raise ShardError(f"empty shard {p} (0 bytes)")
    known = _info_lengths(info)
    if all(n in known for n in names):
        lengths = [int(known[n]) for n in names]
    elif not count:
        raise ShardError(f"the sample counts of split {split!r} under {root} are unknown: no {INFO_NAMES[0]} lists "
                         "its shards. Write one once with `python -m quest.data.make_shards index "
                         f"{root} {split}=<pattern>`, or set data.num_samples=<training samples> to count the shards "
                         "at every start")
    else:
        lengths = [count_samples(p) for p in paths]
    for p, n in zip(paths, lengths):
        if n <= 0:
            raise ShardError(f"empty shard {p}: it holds no samples" + (f" ({info_path} says 0)" if info_path else ""))
    if info_path and split in (info.get("splits") or {}):
        stated = info["splits"][split].get("num_samples")
        if stated is not None and int(stated) != sum(lengths):
            raise ShardError(f"{info_path}: split {split!r} says num_samples={stated} but its shard_lengths add up "
                             f"to {sum(lengths)}")
    return [Shard(p, n) for p, n in zip(paths, lengths)]


def shard_num_classes(root: str | Path) -> int | None:
    """The class count _info.json states (``num_classes`` or the length of ``classes``), else None."""
    info, _ = load_info(Path(root).expanduser())
    if info.get("num_classes") is not None:
        return int(info["num_classes"])
    return len(info["classes"]) if info.get("classes") else None


# --- reading tar files ---------------------------------------------------------------------------------------------
def _key_ext(name: str) -> tuple[str, str] | None:
    """webdataset's convention: the key runs up to the first dot of the file name, the extension is the rest."""
    head, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot or not stem:
        return None  # not part of a sample (no extension, or a hidden file)
    return (f"{head}/{stem}" if head else stem), ext.lower()


def _groups(tar: tarfile.TarFile) -> Iterator[tuple[str, dict[str, tarfile.TarInfo]]]:
    """(key, {extension: member}) per sample, in file order; reading headers only (data is skipped by seeking)."""
    key, members = None, {}
    while (m := tar.next()) is not None:
        split = _key_ext(m.name) if m.isfile() else None
        if split is None:
            continue
        if split[0] != key:
            if key is not None:
                yield key, members
            key, members = split[0], {}
        members[split[1]] = m
    if key is not None:
        yield key, members


def _open_tar(path: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(path, mode="r:")  # uncompressed: members can be skipped by seeking
    except (tarfile.TarError, OSError) as exc:
        raise ShardError(f"cannot read shard {path} as an uncompressed tar file: {exc}") from exc


def count_samples(path: Path) -> int:
    with _open_tar(path) as tar:
        return sum(1 for _ in _groups(tar))


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
        self.k, self.tar, self.next_index = k, _open_tar(self.shards[k].path), 0
        self.groups = _groups(self.tar)

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
