"""The data pre-flight of WebDataset tar shards (``data=imagenet_wds``; docs/data.md): before training, every shard
of a split is read header by header (``tarfile``, no image decoded, only the small ``.cls`` members read) and each
problem is named with its shard and member:

- a shard that does not exist, is empty, cannot be read, or is not a tar file;
- a shard cut short: a member whose data runs past the end of the file, a damaged header, or a file that ends
  without the tar end-of-archive blocks (a cut at a member boundary would otherwise read as a shorter, whole tar);
- a shard whose sample count differs from the one ``_info.json`` states for it;
- a sample without an image member, without a ``.cls`` label, with a label that is not an integer, or with one
  outside ``0 .. num_classes - 1``; a sample key that occurs twice in a shard.

Shards are checked in parallel worker processes (one shard a task).
"""
from __future__ import annotations

import os
import tarfile
from pathlib import Path
from typing import Callable, Iterable

from quest.runtime.workers import worker_pool

from .preflight import Problem, Report
from .shard_index import IMAGE_EXTS, IrregularMember, info_lengths, load_info, sample_groups, split_files

__all__ = ["check_shard", "check_shard_split", "apply_shard_preflight", "END_OF_ARCHIVE"]

END_OF_ARCHIVE = 2 * tarfile.BLOCKSIZE  # two zero blocks close every tar (POSIX); tarfile and GNU tar write them


def _label_problem(raw: bytes, num_classes: int | None) -> str | None:
    try:
        label = int(raw.decode().strip())
    except (UnicodeDecodeError, ValueError):
        return f"label {raw[:32]!r} is not a class index"
    if num_classes is not None and not 0 <= label < num_classes:
        return f"label {label} is outside the classes 0..{num_classes - 1} (data.num_classes={num_classes})"
    return None


def _tail_is_end_marker(path: str, offset: int, size: int) -> bool:
    """The bytes where tarfile stopped reading are the two zero blocks that end a whole tar file."""
    if size - offset < END_OF_ARCHIVE:
        return False
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(END_OF_ARCHIVE).count(0) == END_OF_ARCHIVE


def check_shard(path: str, stated: int | None = None, num_classes: int | None = None) -> tuple[int, list[Problem]]:
    """(samples read, problems) of one tar shard, from its headers and ``.cls`` members; ``stated``: the sample
    count _info.json gives for it (None: not checked); ``num_classes``: labels must lie in 0..num_classes-1."""
    problems: list[Problem] = []
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return 0, [Problem(path, "listed in _info.json but does not exist")]
    except OSError as exc:
        return 0, [Problem(path, f"unreadable ({exc.strerror or exc})")]
    if size == 0:
        return 0, [Problem(path, "empty file (0 bytes)")]
    try:
        tar = tarfile.open(path, mode="r:")  # uncompressed, as the reader needs (it seeks past member data)
    except PermissionError as exc:
        return 0, [Problem(path, f"unreadable ({exc.strerror or 'permission denied'})")]
    except (tarfile.TarError, OSError) as exc:
        return 0, [Problem(path, f"not a tar file ({exc})")]
    samples, keys, last = 0, set(), "its first member"
    with tar:
        try:
            for key, members in sample_groups(tar):
                samples += 1
                last = f"member {sorted(members.values(), key=lambda m: m.offset)[-1].name}"
                if key in keys:
                    problems.append(Problem(f"{path}:{key}", "the sample key occurs twice in the shard (its members "
                                                             "are not consecutive)"))
                keys.add(key)
                if not any(e in members for e in IMAGE_EXTS):
                    problems.append(Problem(f"{path}:{key}", f"no image member ({', '.join(IMAGE_EXTS)}); its "
                                                             f"members: {sorted(members)}"))
                if "cls" not in members:
                    problems.append(Problem(f"{path}:{key}", f"no .cls label; its members: {sorted(members)}"))
                    continue
                f = tar.extractfile(members["cls"])
                raw = f.read() if f is not None else b""
                if len(raw) < members["cls"].size:
                    raise tarfile.ReadError("unexpected end of data")
                if (why := _label_problem(raw, num_classes)) is not None:
                    problems.append(Problem(f"{path}:{key}.cls", why))
            whole = _tail_is_end_marker(path, tar.offset, size)
        except IrregularMember as exc:  # the reader would refuse the shard at this member
            problems.append(Problem(path, exc.reason))
            return samples, problems
        except (tarfile.TarError, OSError, EOFError) as exc:
            # the last header read names where: the member whose data runs past the end, or the one before a damaged
            # header (``last``, the end of the last whole sample, is further back when the first sample is cut)
            at = f"member {tar.members[-1].name}" if tar.members else last
            problems.append(Problem(path, f"cut short or damaged after {samples} samples, after {at} ({exc})"))
            return samples, problems
    if not whole:
        problems.append(Problem(path, f"cut short or damaged: after {samples} samples ({last}) the file has no tar "
                                      "end-of-archive blocks"))
    elif stated is not None and samples != stated:
        problems.append(Problem(path, f"holds {samples} samples, but _info.json says {stated}"))
    return samples, problems


def _check(args: tuple[str, int | None, int | None]) -> tuple[int, list[Problem]]:
    return check_shard(*args)


def check_shard_split(root: str | Path, split: str, num_classes: int | None = None, workers: int | None = None,
                      progress: Callable[[Iterable, int], Iterable] | None = None) -> Report:
    """Every shard of ``split`` (an _info.json split or a shard pattern under ``root``), in ``workers`` processes
    (default: the CPU count, at most 8); ``Report.images`` counts the samples read."""
    root = Path(root).expanduser()
    info, info_path = load_info(root)
    names = split_files(root, split, info, info_path)
    known = info_lengths(info)
    tasks = [(str(root / n), known.get(n), num_classes) for n in names]
    workers = workers or min(8, os.cpu_count() or 1)
    report = Report(str(root))
    if workers > 1 and len(tasks) > 1:
        with worker_pool(min(workers, len(tasks))) as pool:
            results: Iterable = pool.map(_check, tasks)
            results = list(progress(results, len(tasks)) if progress else results)
    else:
        results = [_check(t) for t in (progress(tasks, len(tasks)) if progress else tasks)]
    for samples, problems in results:
        report.images += samples
        report.problems.extend(problems)
    if info_path and split in (info.get("splits") or {}):
        stated = info["splits"][split].get("num_samples")
        lengths = [known.get(n) for n in names]
        if stated is not None and None not in lengths and int(stated) != sum(lengths):
            report.problems.append(Problem(str(info_path), f"split {split!r} says num_samples={stated} but its "
                                                           f"shard_lengths add up to {sum(lengths)}"))
        if len(info["splits"][split].get("shard_lengths", [])) != len(names):
            report.problems.append(Problem(str(info_path), f"split {split!r} lists {len(names)} filenames but "
                                           f"{len(info['splits'][split].get('shard_lengths', []))} shard_lengths"))
    return report


def apply_shard_preflight(data, split: str) -> None:
    """Before training: check every shard of the ``split`` ('train' or 'val') of a shard data set (a DataConfig)
    and refuse it naming every problem. Labels and structure cannot be skipped: data.bad_images applies only to
    images that do not decode, which this header-only check does not look at."""
    from .shard_index import ShardError

    if not data.root or data.root == "???" or not Path(data.root).expanduser().is_dir():
        return  # build_shards names the missing root
    root = Path(data.root).expanduser()
    name = data.train_split if split == "train" else data.val_split
    report = check_shard_split(root, name, data.num_classes)
    if report.problems:
        raise ShardError(f"data pre-flight: {len(report.problems)} problem(s) in the shards of the {split} split "
                         f"{name!r} under {root} (docs/data.md):\n{report.describe()}\nRewrite the named shards "
                         "(python -m quest.tools.make_shards) or fix _info.json")
