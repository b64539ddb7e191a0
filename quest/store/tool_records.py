"""The files quest's data tools write and read back, as typed records (quest.store.records): a shard folder's
``_info.json``, a capped copy's ``_capped.json`` and the pre-flight's cache (what a tool wrote, and from which
source, is the folder's manifest: quest.store.manifest). Every field's type and range is checked, and every path a
file names must stay inside the folder the file belongs to, before a tool believes it or acts on it (an
``_info.json`` filename is a shard read and linked); a file that fails is one
:class:`~quest.store.damage.DamagedFile` naming the file and the field (docs/data.md, "What the data tools read
back").
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping

from quest.store.damage import DamagedFile
from quest.store.files import parse_json
from quest.store.records import bounded, check_fields, relative_path

__all__ = ["CAP_SHORT_SIDE", "InfoSplit", "ShardInfo", "CappedRecord", "CachedProblem", "PreflightCache", "check_info",
           "check_capped", "check_preflight_cache"]


@dataclass
class InfoSplit:
    name: str = ""
    num_samples: int = field(default=0, metadata=bounded(0))
    filenames: list[str] = field(default_factory=list, metadata=relative_path())  # shards beside _info.json
    shard_lengths: list[int] = field(default_factory=list)


@dataclass
class ShardInfo:
    splits: dict[str, InfoSplit] = field(default_factory=dict)
    num_classes: int | None = field(default=None, metadata=bounded(1))
    classes: list[str] | None = None
    complete: bool = True


#: the short sides quest-data cap takes, in pixels: 16 (a 16 px patch) to 65,536 (beyond any image's side)
CAP_SHORT_SIDE = (16, 65536)


@dataclass
class CappedRecord:
    short_side: int = field(metadata=bounded(*CAP_SHORT_SIDE))
    quality: int = field(metadata=bounded(1, 100))
    complete: bool = True
    resample: str = ""
    source: str = ""  # where the copy was made from: a path outside the copy, by design
    layout: Literal["image folder", "shards"] = "image folder"
    splits: dict[str, Any] = field(default_factory=dict)
    linked: list[str] = field(default_factory=list, metadata=relative_path())  # split folders linked: plain names


@dataclass
class CachedProblem:
    path: str
    reason: str


@dataclass
class PreflightCache:
    fingerprint: str
    images: int = field(metadata=bounded(0))
    problems: list[CachedProblem] = field(default_factory=list)


def _require(data: Mapping, keys: tuple[str, ...], source: Any, what: str, where: str = "") -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise DamagedFile(source, f"{f'{where}: ' if where else ''}no {', '.join(missing)}; expected {what}", joined=": ")


def check_info(info: Any, folder: Path, source: Any) -> dict[str, Any]:
    """A shard folder's _info.json, checked (timm's layout; keys it does not declare are left alone)."""
    check_fields(ShardInfo, info, source, folder)  # every filename inside the folder: a shard read and linked
    classes, count = info.get("classes"), info.get("num_classes")
    if isinstance(classes, list) and count is not None and count != len(classes):
        raise DamagedFile(source, f"num_classes is {count}, but classes names {len(classes)}; expected the count of "
                                  "the classes it names", joined=": ")
    for split, entry in (info.get("splits") or {}).items():
        _require(entry, ("filenames",), source, "the list of the split's shard files", f"splits.{split}")
        for i, length in enumerate(entry.get("shard_lengths", [])):
            if length < 0:
                raise DamagedFile(source, f"splits.{split}.shard_lengths[{i}] is {length}, expected a sample "
                                          "count >= 0", joined=": ")
    return info


def check_capped(record: Any, folder: Path, source: Any) -> dict[str, Any]:
    check_fields(CappedRecord, record, source, folder)
    _require(record, ("short_side", "quality"), source, "the record quest-data cap writes")
    for i, name in enumerate(record.get("linked", [])):
        if "/" in name:
            raise DamagedFile(source, f"linked[{i}] is {name!r}; expected a split folder's name", joined=": ")
    return record


def check_preflight_cache(data: Any, root: Path, source: Any) -> PreflightCache:
    check_fields(PreflightCache, data, source)
    _require(data, ("fingerprint", "images", "problems"), source, "the pre-flight's cache record")
    for i, p in enumerate(data["problems"]):
        _require(p, ("path", "reason"), source, "a path and a reason", f"problems[{i}]")
    problems = [CachedProblem(p["path"], p["reason"]) for p in data["problems"]]
    for i, p in enumerate(problems):
        if not p.path.startswith(f"{root}/"):
            raise DamagedFile(source, f"problems[{i}].path is {p.path!r}, a path outside {root}; expected a file "
                                      "under it", joined=": ")
    return PreflightCache(data["fingerprint"], data["images"], problems)


CAPPED_INFO = "_capped.json"  # a capped copy's record of its cap, at its root (quest-data cap)


def read_capped(root: str | os.PathLike | None, complete_only: bool = True) -> dict[str, Any] | None:
    """The record of a capped copy at ``root`` (None when ``root`` is not one); a ValueError when the copy was
    interrupted and ``complete_only``: a run on it would read a mix of old and new images, or miss some."""
    if not root:
        return None
    path = Path(root).expanduser() / CAPPED_INFO
    if not path.is_file():
        if os.path.lexists(path):  # a folder or a broken link in the record's place: not a copy, and not nothing
            raise DamagedFile(path, "is not a file; expected the record quest-data cap writes there", joined=" ")
        return None
    try:
        record = parse_json(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not a capped copy's record ({exc}); expected the JSON quest-data cap "
                         "writes") from exc
    check_capped(record, path.parent, path)  # every field's type and range (quest.store.tool_records)
    if complete_only and record.get("complete") is False:
        raise ValueError(f"{root} is a capped copy that was interrupted or is being written ({path} says "
                         "complete: false); run the same quest-data cap command again to finish it")
    return record
