"""What a resumable data tool wrote from which source (``quest-data cap``, ``python -m quest.tools.make_shards
convert``), so that running it again redoes exactly the outputs whose source changed or disappeared, removes the
outputs nothing produces any more, and never takes a file it did not write for its own (docs/data.md, "Running a
data tool again").

``<folder>/_ledger.jsonl`` holds a header line ``{"tool": ..., "params": {...}}``, then a line per output,
``{"key": <what it was made from>, "out": <its path under the folder>, "stamp": <the source's state>}``, or
``{"key": ..., "out": null}`` once it was removed; ``made`` is the output's own size and modification time as the
tool wrote it, so that an output somebody changed or replaced since is not taken for the tool's (a rerun moves it to
``.replaced/`` and writes its own again). An output is written whole first (quest.store.files.atomic_write) and
recorded after, so a kill leaves at worst a whole output without a line (not in the ledger: removed and redone) or a
cut last line (skipped on reading). Every run that writes rewrites the ledger whole with the lines it kept before
its first append, so appends never continue a cut line. A source's stamp is its size and modification time in
nanoseconds (for a converted shard, a digest of those of its images, their labels and the settings), the test make
and rsync use: a file rewritten in place to the same size within the filesystem's time resolution goes unseen.
"""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any, TextIO

from quest.store.damage import DamagedFile
from quest.store.files import open_records, parse_json, write_text_atomic
from quest.store.tree import REPLACED, make_dirs, move_aside, remove

from .tool_records import check_ledger_header, check_ledger_line

__all__ = ["LEDGER_NAME", "UNRECORDED", "Ledger", "file_stamp", "is_partial_write", "remove_unrecorded"]

#: the label of the ``.replaced/<UTC time>-<label>/`` that holds files a tool found where it writes but did not write
#: (a tool deletes only what its ledger says it wrote: quest.store.tree.move_aside with this label)
UNRECORDED = "unrecorded"

LEDGER_NAME = "_ledger.jsonl"


def file_stamp(path: Path) -> str:
    """The state of a source file a rerun compares against: its size and modification time (ns)."""
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def is_partial_write(name: str) -> bool:
    """A temporary file of quest.store.files.atomic_write (``.<name>.<random>.tmp``) that a kill left behind."""
    return name.startswith(".") and name.endswith(".tmp")


class Ledger:
    """The outputs under ``folder`` that ``tool`` (run with ``params``) wrote, each with the source stamp it was made
    from. Use as a context manager: the ledger is rewritten whole, with only its current lines, on leaving."""

    def __init__(self, folder: Path, tool: str, params: dict[str, Any]):
        self.folder, self.tool, self.params = Path(folder), tool, params
        self.path = self.folder / LEDGER_NAME
        if self.path.exists() and not self.path.is_file():  # not a ledger: nothing of the folder can be placed
            raise IsADirectoryError(errno.EISDIR, "the data tools' ledger is a directory, not a file", str(self.path))
        self.existed = self.path.is_file()
        self.entries: dict[str, tuple[str, str]] = {}  # key -> (output path under folder, stamp)
        self.made: dict[str, str] = {}  # output path -> its own stamp when the tool wrote it (older ledgers: none)
        if self.existed:
            self._read()
        self._append: TextIO | None = None  # nothing is written before begin(): a refused command changes nothing
        self.written = self.removed = 0  # what this run did, for the tool's report

    def begin(self) -> None:
        """Start writing: the folder made, the ledger rewritten whole (so no append continues a cut line)."""
        if self._append is None:
            make_dirs(self.folder)
            self._rewrite()
            self._append = open_records(self.path)  # closed by close()

    def _read(self) -> None:
        """The header and every line checked (quest.store.tool_records) before any is believed: a line's ``out`` is a
        file a rerun may delete. Only the last line may be cut (a kill while appending): it is skipped."""
        lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        try:
            header = parse_json(lines[0]) if lines else None
        except json.JSONDecodeError:
            header = None
        if not isinstance(header, dict) or "tool" not in header:
            raise ValueError(f"{self.path} is not a ledger quest's data tools wrote (its first line is not their "
                             f"header); {self.folder} holds files {self.tool} did not write: choose another folder")
        check_ledger_header(header, f"{self.path} line 1")
        if (header["tool"], header["params"]) != (self.tool, self.params):
            raise ValueError(f"{self.folder} was written by {header['tool']} with {header['params']}; this "
                             f"command is {self.tool} with {self.params}: use another folder for it")
        for number, line in enumerate(lines[1:], 2):
            try:
                row = parse_json(line)
            except json.JSONDecodeError:
                if number == len(lines):
                    continue  # a line cut by a kill: its output, if any, is not on the record and will be redone
                raise DamagedFile(self.path, f"line {number} is not JSON; expected a line {{\"key\": ..., "
                                             "\"out\": ...}", joined=" ") from None
            entry = check_ledger_line(row, self.folder, f"{self.path} line {number}")
            if entry.out is None:
                self.entries.pop(entry.key, None)
            else:
                self.entries[entry.key] = (entry.out, str(entry.stamp))
                if entry.made is not None:
                    self.made[entry.out] = entry.made

    def _rewrite(self) -> None:
        header = json.dumps({"tool": self.tool, "params": self.params}, sort_keys=True)
        rows = (json.dumps({"key": k, "out": o, "stamp": s, **({"made": self.made[o]} if o in self.made else {})})
                for k, (o, s) in sorted(self.entries.items()))
        write_text_atomic(self.path, "".join(f"{line}\n" for line in (header, *rows)))

    def _write(self, row: dict[str, Any]) -> None:
        self.begin()
        assert self._append is not None
        self._append.write(json.dumps(row) + "\n")
        self._append.flush()  # a line on record is a line a later rerun trusts; the output it names is already whole

    def current(self, key: str, stamp: str) -> str | None:
        """The output made from ``key`` when it was made from this very ``stamp`` and is still what the tool wrote,
        else None."""
        out, old = self.entries.get(key, (None, None))
        return out if out is not None and old == stamp and self.unchanged(out) else None

    def unchanged(self, out: str) -> bool:
        """Whether the output ``out`` is the file the tool wrote: there, and with the size and modification time it
        had then (an older ledger's line, which did not record them: there)."""
        path = self.folder / out
        return path.is_file() and not path.is_symlink() and self.made.get(out, file_stamp(path)) == file_stamp(path)

    def report(self, kept: int) -> dict[str, int]:
        """What this run did: outputs kept from an earlier run, written, removed."""
        return {"kept": kept, "written": self.written, "removed": self.removed}

    def outputs(self) -> set[str]:
        return {out for out, _ in self.entries.values()}

    def record(self, key: str, out: str, stamp: str) -> None:
        self.entries[key] = (out, stamp)
        self.made[out] = file_stamp(self.folder / out)
        self._write({"key": key, "out": out, "stamp": stamp, "made": self.made[out]})
        self.written += 1

    def drop(self, key: str) -> None:
        """Remove the output made from ``key`` (its source changed or is gone) and say so in the ledger; a file in its
        place that is not what the tool wrote is moved to ``.replaced/`` instead."""
        out, _ = self.entries.pop(key)
        if self.unchanged(out):
            remove(self.folder / out)
        else:
            move_aside(self.folder, [self.folder / out], UNRECORDED)
        self.made.pop(out, None)
        self._write({"key": key, "out": None})
        self.removed += 1

    def drop_stale(self, stamps: dict[str, str], keys: set[str] | None = None) -> list[str]:
        """Drop every entry (of ``keys``, default all) whose source is not in ``stamps`` or has another stamp now, or
        whose output is gone or no longer what the tool wrote; the keys dropped."""
        stale = [k for k, (out, stamp) in self.entries.items() if (keys is None or k in keys)
                 and (stamps.get(k) != stamp or not self.unchanged(out))]
        for key in stale:
            self.drop(key)
        return stale

    def close(self) -> None:
        if self._append is not None:
            self._append.close()
            self._append = None
            self._rewrite()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_unrecorded(folder: Path, keep: set[str], ledger: Ledger) -> list[str]:
    """Move every file under ``folder`` (a folder this tool writes) that the ledger does not list and ``keep`` (paths
    relative to the ledger's folder) does not name to ``.replaced/`` (``.replaced/<UTC time>-unrecorded/``): outputs a kill left
    unrecorded, partial writes, somebody else's files. Hidden files other than partial writes stay (a data check's
    cache, the lock file). The paths moved."""
    listed = ledger.outputs() | keep
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        if Path(dirpath) == ledger.folder:
            dirnames[:] = [d for d in dirnames if d != REPLACED]
        for name in filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(ledger.folder))
            if rel not in listed and (not name.startswith(".") or is_partial_write(name)):
                found.append(path)
    move_aside(ledger.folder, found, UNRECORDED)
    ledger.removed += len(found)
    return [str(p.relative_to(ledger.folder)) for p in found]
