"""The two records of what a command wrote that quest kept before its one manifest (quest.store.manifest), read so
that a folder an earlier quest wrote goes on working: each is checked as strictly as it was then, and turned into
the manifest's header settings and entry lines, which the manifest checks again and writes on the command's next
change (the old file is removed once the manifest holding its content is on disk).

- ``.written.json`` (an output folder's record: eval results, report and plot outputs, the toy study, a run's
  ``tensorboard/``): ``{"files": {<path>: {"by": <command>, "sha256": <64 hex digits, absent for a file the
  command appends to>}}}``. It held no size: a file carried into the manifest is the command's only while its bytes
  still have the recorded SHA-256 (digested once, here; these are small files), and its size and modification time
  are taken from it then.
- ``_ledger.jsonl`` (``quest-data cap`` and ``make_shards convert``): a header ``{"tool", "params"}``, then per output
  ``{"key": <source>, "out": <path>, "stamp": <the source's state>, "made": "<size>:<mtime ns>"}`` or
  ``{"key", "out": null}`` once removed; only its last line may be cut (a kill while appending: skipped). It held
  no digest: a carried output is the tool's while its size and modification time are those of ``made`` (a line
  without ``made``, from an older ledger still: while it is there, as that quest judged).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from quest.store.damage import DamagedFile
from quest.store.files import file_sha256, parse_json, read_json, readable
from quest.store.records import check_fields, check_record, matching, relative_path

__all__ = ["OLD_RECORD", "OLD_LEDGER", "WrittenEntry", "WrittenRecord", "LedgerHeader", "LedgerLine",
           "read_old_record", "read_old_ledger"]

OLD_RECORD = ".written.json"
OLD_LEDGER = "_ledger.jsonl"
#: what a damaged record of quest's says to do about it (the manifest's own message too)
REMEDY = ("Move it away: without it no file in this folder counts as written by quest, and one in the way of an "
          "output is kept in .replaced/ when it is replaced, never deleted")


@dataclass
class WrittenEntry:
    """One file of :class:`WrittenRecord`: the command that wrote it and the SHA-256 of what it wrote."""

    closed: ClassVar[bool] = True  # nothing else: an entry another program wrote is not believed
    by: str
    sha256: str = field(default="", metadata=matching("[0-9a-f]{64}", "64 hex digits (a SHA-256)"))


@dataclass
class WrittenRecord:
    """``.written.json``: each file's path (inside the folder) -> its entry."""

    files: dict[str, WrittenEntry] = field(metadata=relative_path())


@dataclass
class LedgerHeader:
    tool: str
    params: dict[str, Any]


@dataclass
class LedgerLine:
    key: str  # what the output was made from (a path under the source, or a shard's name)
    out: str | None = field(metadata=relative_path())  # the output's path under the ledger's folder; null: removed
    stamp: str | None = None  # the source's state it was made from
    made: str | None = None  # the output's own size and modification time as the tool wrote it (older: none)


def _plain_file(path: Path, what: str) -> bool:
    """Whether there is such a file; DamagedFile when a link or something else stands in its place."""
    if path.is_symlink() or (path.exists() and not path.is_file()):
        kind = "a symbolic link" if path.is_symlink() else "not a plain file"
        raise DamagedFile(path, f"{kind}, expected {what}", REMEDY)
    return path.exists()


def read_old_record(folder: Path) -> list[dict[str, Any]]:
    """The manifest lines of ``folder/.written.json`` (none when there is none): every field checked first
    (:class:`WrittenRecord`), then each file that still holds what was recorded."""
    path = folder / OLD_RECORD
    if not _plain_file(path, "the record quest writes there"):
        return []
    try:
        found = read_json(path)
        check_record(WrittenRecord, found, path, "the record quest writes there", folder=folder)
    except DamagedFile as exc:  # not JSON, not an object, a field: the same way out
        raise DamagedFile(path, exc.problem, REMEDY, exc.joined) from None
    rows = []
    for name, entry in found["files"].items():
        file = folder / name
        if not file.is_file() or file.is_symlink():
            continue
        if "sha256" not in entry:  # a file the command appends to: its by name
            rows.append({"path": name, "by": entry["by"]})
        elif file_sha256(file) == entry["sha256"]:  # not the command's any more otherwise: left out
            st = file.stat()
            rows.append({"path": name, "by": entry["by"], "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                         "sha256": entry["sha256"]})
    return rows


def read_old_ledger(folder: Path) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The settings and manifest lines of ``folder/_ledger.jsonl`` (none when there is none)."""
    path = folder / OLD_LEDGER
    if not _plain_file(path, "the ledger quest's data tools write there"):
        return {}, []
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except PermissionError:
        readable(path, "file")
        raise
    try:
        header = parse_json(lines[0]) if lines else None
    except json.JSONDecodeError:
        header = None
    if not isinstance(header, dict) or "tool" not in header:
        raise ValueError(f"{path} is not a ledger quest's data tools wrote (its first line is not their header); "
                         f"{folder} holds files quest did not write: choose another folder")
    try:
        check_fields(LedgerHeader, header, "")
    except DamagedFile as exc:
        raise DamagedFile(path, f"line 1: {exc.problem}", REMEDY, " ") from None
    if "params" not in header:
        raise DamagedFile(path, "line 1: no params; expected the header line quest's data tools write", REMEDY, " ")
    outputs: dict[str, tuple[str, str | None, str | None]] = {}  # key -> (out, stamp, made)
    for number, line in enumerate(lines[1:], 2):
        try:
            row = parse_json(line)
        except json.JSONDecodeError:
            if number == len(lines):
                continue  # a line cut by a kill: its output, if any, is not on the record and will be redone
            raise DamagedFile(path, f"line {number} is not JSON; expected a line {{\"key\": ..., \"out\": ...}}",
                              REMEDY, " ") from None
        try:
            check_fields(LedgerLine, row, "", folder)  # out inside the folder: a rerun deletes it
        except DamagedFile as exc:  # the file itself, so that a reader keeping it aside has its path
            raise DamagedFile(path, f"line {number}: {exc.problem}", REMEDY, " ") from None
        missing = [k for k in ("key", "out") if k not in row]
        if missing:
            raise DamagedFile(path, f"line {number}: no {', '.join(missing)}; expected a line {{\"key\": ..., "
                                    "\"out\": ..., \"stamp\": ...}", REMEDY, " ")
        if row["out"] is None:
            outputs.pop(row["key"], None)
        else:
            outputs[row["key"]] = (row["out"], row.get("stamp"), row.get("made"))
    rows = []
    for key, (out, stamp, made) in outputs.items():
        file = folder / out
        if not file.is_file() or file.is_symlink():
            continue  # gone: redone, as the ledger's reader did
        size, _, mtime = (made or "").partition(":")
        if not (size.isdigit() and mtime.isdigit()):  # an older line without the output's own state: as it is now
            st = file.stat()
            size, mtime = str(st.st_size), str(st.st_mtime_ns)
        rows.append({"path": out, "by": header["tool"], "size": int(size), "mtime_ns": int(mtime), "source": key,
                     "stamp": stamp})
    return {header["tool"]: header["params"]}, rows
