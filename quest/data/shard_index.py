"""Where a split's WebDataset shards are and what they hold, without reading an image: ``_info.json`` (timm's
``splits.<name>.{filenames, shard_lengths, num_samples}``) or a shard pattern (``imagenet1k-train-{0000..1023}.tar``),
the shards' sample counts, and a tar's samples as groups of members (``{key}.jpg`` + ``{key}.cls``). Read by the
shard data set (quest/data/shards.py), its pre-flight (shard_preflight.py), ``quest-data check`` and make_shards.py.
"""
from __future__ import annotations

import json
import os
import re
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from quest.store.damage import DamagedFile
from quest.store.files import parse_json
from quest.store.tool_records import check_info

__all__ = ["INFO_NAMES", "IMAGE_EXTS", "SHARD_PATTERN", "ShardError", "Shard", "expand_braces", "load_info", "require_complete",
           "info_lengths", "split_files", "resolve_shards", "shard_num_classes", "key_ext", "sample_groups",
           "IrregularMember", "open_tar", "count_samples"]

INFO_NAMES = ("_info.json", "info.json")  # timm's reader looks for both
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp")  # the first one a sample has is its image
#: what makes a split value a shard pattern rather than a split name (split_files), shared with make_shards
SHARD_PATTERN = re.compile(r"[{*?\[]|\.tar$")


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
        if not path.is_file() and os.path.lexists(path):  # a folder or a broken link in the index's place
            raise ShardError(f"{path} is not a file; expected the shard index (JSON) make_shards writes there")
        if path.is_file():
            try:
                info = parse_json(path.read_bytes().decode())
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ShardError(f"{path} is not valid JSON: {exc}") from None
            try:  # every field's type and range, every filename inside root, before anything reads a shard
                return check_info(info, root, path), path
            except DamagedFile as exc:
                raise ShardError(str(exc)) from None
    return {}, None


def require_complete(info: dict[str, Any], info_path: Path | None) -> None:
    """Refuse shards whose conversion is unfinished: make_shards marks _info.json ``complete: false`` before its first
    shard and ``true`` after its last (a file written by another tool, without the key, counts as complete)."""
    if info_path is not None and info.get("complete") is False:
        raise ShardError(f"{info_path} says complete: false: the conversion that writes {info_path.parent} was "
                         "interrupted or is still running; run the same `python -m quest.tools.make_shards convert` "
                         "command again to finish it")


def info_lengths(info: dict[str, Any]) -> dict[str, int]:
    """Every shard file name the info lists, with its sample count."""
    out: dict[str, int] = {}
    for split in (info.get("splits") or {}).values():
        out.update(zip(split.get("filenames", []), split.get("shard_lengths", [])))
    return out


def split_files(root: Path, split: str, info: dict[str, Any], info_path: Path | None) -> list[str]:
    if SHARD_PATTERN.search(split):
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


def resolve_shards(root: Path, split: str, count: bool = False,
                   counting: Callable[[list[Path]], Iterable[Path]] | None = None) -> list[Shard]:
    """The shards of ``split`` (an _info.json split or a pattern) with their lengths: from _info.json, else counted
    when ``count`` (a pass over every tar header); every file must exist and hold at least one sample. ``counting``
    wraps the shards as they are counted, one at a time (a progress line per shard: quest.tools.make_shards index,
    where a pass over a thousand large shards takes minutes)."""
    info, info_path = load_info(root)
    require_complete(info, info_path)
    names = split_files(root, split, info, info_path)
    paths = [root / n for n in names]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{len(missing)} of the {len(paths)} shards of split {split!r} do not exist: "
                                + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))
    for p in paths:
        if p.stat().st_size == 0:
            raise ShardError(f"empty shard {p} (0 bytes)")
    known = info_lengths(info)
    if all(n in known for n in names):
        lengths = [int(known[n]) for n in names]
    elif not count:
        raise ShardError(f"the sample counts of split {split!r} under {root} are unknown: no {INFO_NAMES[0]} lists "
                         "its shards. Write one once with `python -m quest.tools.make_shards index "
                         f"{root} {split}=<pattern>`, or set data.num_samples=<training samples> to count the shards "
                         "at every start")
    else:
        lengths = [count_samples(p) for p in (counting(paths) if counting is not None else paths)]
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
def key_ext(name: str) -> tuple[str, str] | None:
    """webdataset's convention: the key runs up to the first dot of the file name, the extension is the rest. A
    member under a hidden folder or itself hidden (``.ipynb_checkpoints/k.jpg``, ``._k.jpg``) is no part of a sample
    (quest.data.entries: names starting with '.' are never data); a leading ``./`` is only the tar's root."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or any(p.startswith(".") for p in parts):
        return None
    stem, dot, ext = parts[-1].partition(".")
    if not dot:
        return None  # not part of a sample (no extension)
    return "/".join([*parts[:-1], stem]), ext.lower()


_KINDS = {tarfile.SYMTYPE: "a symbolic link", tarfile.LNKTYPE: "a hard link", tarfile.DIRTYPE: "a directory",
          tarfile.CHRTYPE: "a character device", tarfile.BLKTYPE: "a block device", tarfile.FIFOTYPE: "a FIFO"}


class IrregularMember(ShardError):
    """A shard member that is not a regular file: a link would read another member's (or the host's) bytes as this
    sample's, a directory or a device holds no sample; every shard reader refuses it with this message."""

    def __init__(self, shard: str, member: tarfile.TarInfo):
        kind = _KINDS.get(member.type, f"of tar type {member.type!r}")
        target = f" to {member.linkname}" if member.issym() or member.islnk() else ""
        self.shard, self.reason = shard, (f"member {member.name} is {kind}{target}, not a regular file; a shard "
                                          "holds only regular files <key>.<ext> (python -m quest.tools.make_shards "
                                          "writes them so)")
        super().__init__(f"shard {shard}: {self.reason}")


def sample_groups(tar: tarfile.TarFile) -> Iterator[tuple[str, dict[str, tarfile.TarInfo]]]:
    """(key, {extension: member}) per sample, in file order; reading headers only (data is skipped by seeking). A
    member that is not a regular file is refused (:class:`IrregularMember`)."""
    key, members = None, {}
    while (m := tar.next()) is not None:
        if not m.isfile():
            raise IrregularMember(str(tar.name), m)
        split = key_ext(m.name)
        if split is None:
            continue
        if split[0] != key:
            if key is not None:
                yield key, members
            key, members = split[0], {}
        members[split[1]] = m
    if key is not None:
        yield key, members


def open_tar(path: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(path, mode="r:")  # uncompressed: members can be skipped by seeking
    except (tarfile.TarError, OSError) as exc:
        raise ShardError(f"cannot read shard {path} as an uncompressed tar file: {exc}") from exc


def count_samples(path: Path) -> int:
    with open_tar(path) as tar:
        return sum(1 for _ in sample_groups(tar))
