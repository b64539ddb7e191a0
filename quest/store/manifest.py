"""The one manifest of what the commands writing a folder wrote there: ``<folder>/.manifest.jsonl``, kept by every
writer that replaces or removes its own files (quest.store.output_folder: eval results, report and plot outputs, the
toy study, a run's ``tensorboard/``; the resumable data tools ``quest-data cap`` and ``make_shards convert``). A
command removes or replaces in place only a file this manifest says it wrote and that nobody changed since; any
other file in its way is kept in ``.replaced/`` (docs/data.md, "Running a data tool again"; docs/training.md, "What
a command may remove").

Line 1 is the header, ``{"manifest": 1, "settings": {<tool>: {<its settings>}}}``: the settings each resumable tool
wrote the folder with (a rerun with others, or another tool, is refused: the outputs would mix). Every other line is
an entry, ``{"path": <inside the folder>, "by": <command>, "size": <bytes>, "mtime_ns": ..., "sha256": ...}``, with,
for a resumable tool's output, ``"source"`` (what it was made from) and ``"stamp"`` (the source's state then); an
entry without size and digest is a file the command goes on appending to (TensorBoard's event files), known by its
name; ``{"path": ..., "removed": true}`` says the file went. A later line for a path replaces the earlier one. Every
line is checked (:class:`ManifestHeader`, :class:`ManifestEntry`: each path inside the folder) before any is
believed, and a damaged manifest is one :class:`~quest.store.damage.DamagedFile`, refused before any change.

Writes go through quest.store.files: the whole manifest is written atomically (:meth:`Manifest.note`, and when a
resumable tool begins and ends), and a resumable tool appends a line per output while it works
(quest.store.files.open_records), each after its output is whole on disk: a kill leaves at worst an output without
a line (not the tool's: kept in ``.replaced/`` and redone) or a cut last line (skipped on reading).

Whether a file is still what its entry says (:meth:`Manifest.owns`): the size first, which proves most changes at
the cost of a ``stat``; the same size and the same modification time (ns) are taken as the same bytes, the test make
and rsync use, so that a rerun over gigabytes of shards reads none of them; only a file of the recorded size with
another modification time is digested and compared with the SHA-256 taken when it was written. An edit to the same
size that also puts the modification time back goes unseen; anything else is caught.

A folder an earlier quest wrote holds ``.written.json`` or ``_ledger.jsonl`` instead (quest.store.old_manifests),
read and checked the same way: ``.written.json`` while there is no manifest, the ledger by the first resumable tool
that holds the folder (only such a tool wrote one). Either is carried into the manifest on the command's next write
and removed once the manifest is on disk; a command refused before its first change leaves it as it was.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, ClassVar, Literal, TextIO

from quest.store.damage import DamagedFile
from quest.store.files import OutsideFolder, file_sha256, inside_folder, open_records, parse_json, readable, write_text_atomic
from quest.store.old_manifests import OLD_LEDGER, OLD_RECORD, REMEDY, read_old_ledger, read_old_record
from quest.store.records import bounded, check_record, matching, relative_path
from quest.store.tree import REPLACED, make_dirs, move_aside

__all__ = ["MANIFEST_NAME", "UNRECORDED", "ManifestHeader", "ManifestEntry", "Manifest", "file_stamp",
           "is_partial_write", "remove_unrecorded"]

MANIFEST_NAME = ".manifest.jsonl"
#: the label of the ``.replaced/<UTC time>-unrecorded/`` holding files a command found where it writes but did not
#: write (quest.store.tree.move_aside)
UNRECORDED = "unrecorded"


@dataclass
class ManifestHeader:
    """Line 1 of the manifest (module docstring)."""

    closed: ClassVar[bool] = True
    manifest: Literal[1]
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass
class ManifestEntry:
    """A line of the manifest after the header: one file (module docstring)."""

    closed: ClassVar[bool] = True  # nothing else: an entry another program wrote is not believed
    path: str = field(metadata=relative_path())  # a file a rerun may remove: inside the folder
    by: str = ""  # the command that wrote it
    size: int | None = field(default=None, metadata=bounded(0))
    mtime_ns: int | None = field(default=None, metadata=bounded(0))
    sha256: str | None = field(default=None, metadata=matching("[0-9a-f]{64}", "64 hex digits (a SHA-256)"))
    source: str | None = None  # a resumable tool's: what the file was made from
    stamp: str | None = None  # and that source's state then
    removed: bool = False

    def line(self) -> str:
        """The entry as its manifest line (fields at their defaults left out)."""
        row = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if getattr(self, f.name) != f.default or f.name == "path"}
        return json.dumps(row, sort_keys=True) + "\n"


class Manifest:
    """The manifest of ``folder``, read and checked when made (nothing written until a change); ``command`` is the
    command writing the folder now (one at a time: the folder's lock), whose files :meth:`owns` tells apart."""

    def __init__(self, folder: str | Path, command: str):
        self.folder, self.command = Path(folder), command
        self.path = self.folder / MANIFEST_NAME
        self.entries: dict[str, ManifestEntry] = {}  # path -> entry
        self.settings: dict[str, dict[str, Any]] = {}
        self.carried: list[Path] = []  # an older quest's records read here: removed once the manifest is written
        self._append: TextIO | None = None
        # what this command did to the files of the manifest, for its report: written, deleted (its own, unchanged),
        # moved to .replaced/ (anything else in an output's place)
        self.written = self.removed = self.moved = 0
        self.aside: Path | None = None  # this command's one .replaced/<UTC time>-unrecorded/, made at its first move
        if self._is_file(self.path):
            self._read()
            if (self.folder / OLD_RECORD).is_file():  # a kill came before it was removed: its content is here
                self.carried.append(self.folder / OLD_RECORD)
        else:  # no manifest yet: an older quest's record is carried
            self._carry(OLD_RECORD)

    @staticmethod
    def _is_file(path: Path) -> bool:
        if path.is_symlink() or (path.exists() and not path.is_file()):
            kind = "a symbolic link" if path.is_symlink() else "not a plain file"
            raise DamagedFile(path, f"{kind}, expected the manifest quest writes there", REMEDY)
        return path.exists()

    def _read(self) -> None:
        try:
            lines = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        except PermissionError:
            readable(self.path, "file")
            raise
        for number, line in enumerate(lines, 1):
            try:
                row = parse_json(line)
            except json.JSONDecodeError:
                if number == len(lines) > 1:
                    continue  # cut by a kill while appending: its file, if any, is not on record and is redone
                raise DamagedFile(self.path, f"line {number} is not JSON; expected "
                                  f"{'the header' if number == 1 else 'an entry'} quest writes", REMEDY, " ") from None
            try:
                if number == 1:
                    check_record(ManifestHeader, row, "", "the header quest writes")
                    self.settings = row.get("settings", {})
                else:
                    self._believe(row)
            except DamagedFile as exc:  # the file itself, so that a reader keeping it aside has its path
                raise DamagedFile(self.path, f"line {number}: {exc.problem}", REMEDY, " ") from None
        if not lines:
            raise DamagedFile(self.path, "empty; expected the header quest writes", REMEDY)

    def _believe(self, row: Any) -> None:
        check_record(ManifestEntry, row, "", "an entry quest writes", folder=self.folder)
        entry = ManifestEntry(**row)
        if PurePosixPath(entry.path).parts[0] == REPLACED or entry.path == MANIFEST_NAME:
            # a line naming what quest kept aside, or the manifest itself, would have a rerun delete it
            raise DamagedFile("", f"path {entry.path!r} is no command's output (expected a file outside {REPLACED}/ "
                              "and other than the manifest)")
        if not entry.removed and not entry.by:
            raise DamagedFile("", "no by; expected the command that wrote the file")
        if entry.removed:
            self.entries.pop(entry.path, None)
        else:
            self.entries[entry.path] = entry

    def _carry(self, name: str) -> None:
        """An older quest's record ``name`` (module docstring): ``.written.json`` while this folder has no manifest;
        the data tools' ledger by the first resumable tool that holds the folder (:meth:`resume`), the one kind of
        command that wrote it, also where another command began the manifest since."""
        if name == OLD_LEDGER:
            settings, rows = read_old_ledger(self.folder)
        else:
            settings, rows = {}, read_old_record(self.folder)
        try:
            for row in rows:  # each checked as its old file's line was, and again as an entry
                self._believe(row)
        except DamagedFile as exc:
            raise DamagedFile(self.folder / name, exc.problem, REMEDY, ": ") from None
        self.settings.update(settings)
        if (self.folder / name).exists():
            self.carried.append(self.folder / name)

    # ---- which files are whose

    def owns(self, path: str | Path) -> bool:
        """Whether ``path`` (in the folder) is a file this command wrote and nobody changed since (module
        docstring: the size, then the modification time, then the digest)."""
        entry = self.entries.get(self._name(path))
        return entry is not None and entry.by == self.command and self._unchanged(entry)

    def remove_if_owned(self, path: str | Path) -> bool:
        """Delete ``path`` if it is a file this command wrote and nobody changed since (:meth:`owns`); whether it
        did. Anything else stays where it is, for the caller to keep aside."""
        if not self.owns(path):
            return False
        self._remove_own(self.folder / self._name(path))
        return True

    def _unchanged(self, entry: ManifestEntry) -> bool:
        path = self.folder / entry.path
        if path.is_symlink() or not path.is_file():
            return False
        if entry.size is None:  # a file the command appends to: its by name
            return True
        st = path.stat()
        if st.st_size != entry.size:
            return False
        if st.st_mtime_ns == entry.mtime_ns:
            return True
        if entry.sha256 is None or file_sha256(path) != entry.sha256:
            return False
        entry.mtime_ns = st.st_mtime_ns  # the same bytes, touched: digested once, not on every later check
        return True

    def _name(self, path: str | Path) -> str:
        return str(Path(path).relative_to(self.folder))

    def _entry(self, name: str, digest: bool = True, source: str | None = None,
               stamp: str | None = None) -> ManifestEntry:
        """The entry of the file ``name`` as it is now, just written by this command."""
        if not digest:
            return ManifestEntry(name, self.command, source=source, stamp=stamp)
        path = self.folder / name
        st = path.stat()
        return ManifestEntry(name, self.command, st.st_size, st.st_mtime_ns, file_sha256(path), source, stamp)

    # ---- writing

    def note(self, paths: Iterable[str | Path], digest: bool = True) -> None:
        """Record ``paths`` (files in the folder, just written whole by this command) with their size, modification
        time and SHA-256 (``digest``; False for a file the command goes on appending to, known by its name); entries
        of files now gone are dropped."""
        new = [self._entry(self._name(p), digest) for p in paths]
        if self._append is not None:  # a resumable tool at work: appended like its outputs
            for entry in new:
                self._add(entry)
            return
        self.entries = {name: e for name, e in self.entries.items() if (self.folder / name).exists()}
        self.entries.update((entry.path, entry) for entry in new)
        self._rewrite()

    def replace(self, path: Path, text: str) -> Path:
        """Write ``text`` as ``path``, a record of the folder this command rewrites on every run (_capped.json,
        _info.json), and note it; one somebody changed since this command wrote it is kept aside first
        (:meth:`keep_aside`), never overwritten."""
        entry = self.entries.get(self._name(path))
        if entry is not None and os.path.lexists(path) and not self._unchanged(entry):
            self.keep_aside([path])
            self.moved += 1
        write_text_atomic(path, text)
        self.note([path])
        return path

    def _rewrite(self) -> None:
        header = json.dumps({"manifest": 1, "settings": self.settings}, sort_keys=True) + "\n"
        write_text_atomic(self.path, header + "".join(e.line() for _, e in sorted(self.entries.items())))
        for old in self.carried:  # its content is in the manifest now
            self._remove_own(old)
        self.carried = []

    def begin(self) -> None:
        """Start appending (a resumable tool, once its checks passed): the folder made, the manifest rewritten whole
        first (so that no append continues a cut line)."""
        if self._append is None:
            make_dirs(self.folder)
            self._rewrite()
            self._append = open_records(self.path)  # closed by close()

    def _add(self, entry: ManifestEntry) -> None:
        self.begin()
        assert self._append is not None
        if entry.removed:
            self.entries.pop(entry.path, None)
        else:
            self.entries[entry.path] = entry
        self._append.write(entry.line())
        self._append.flush()  # a line on record is a line a later rerun trusts; the file it names is already whole

    def close(self) -> None:
        """Stop appending: the manifest rewritten whole with its current entries."""
        if self._append is not None:
            self._append.close()
            self._append = None
            self._rewrite()

    def __enter__(self) -> Manifest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- a resumable tool's outputs, each made from a source

    def resume(self, params: dict[str, Any]) -> bool:
        """Check that this folder is this tool's with these ``params`` (its settings; a ValueError naming the
        writer otherwise), and whether this tool wrote here before."""
        self._carry(OLD_LEDGER)  # there until a resumable tool carried it
        for tool, theirs in self.settings.items():
            if (tool, theirs) != (self.command, params):
                raise ValueError(f"{self.folder} was written by {tool} with {theirs}; this command is {self.command} "
                                 f"with {params}: use another folder for it")
        before = self.command in self.settings
        self.settings[self.command] = params
        return before

    def sources(self) -> dict[str, str]:
        """Each source this tool's outputs were made from -> the output's path."""
        return {e.source: name for name, e in self.entries.items() if e.source is not None and e.by == self.command}

    def current(self, source: str, stamp: str) -> str | None:
        """The output made from ``source`` when it was made from this very ``stamp`` and is still what the tool
        wrote, else None."""
        name = self.sources().get(source)
        entry = self.entries.get(name) if name is not None else None
        return name if entry is not None and entry.stamp == stamp and self._unchanged(entry) else None

    def record(self, source: str, out: str, stamp: str) -> None:
        """The output ``out`` (a path in the folder, just written whole) was made from ``source`` at ``stamp``."""
        self._add(self._entry(out, source=source, stamp=stamp))
        self.written += 1

    def keep_aside(self, paths: Iterable[str | Path]) -> None:
        """Move ``paths`` (files in the folder that this command will not keep) into its one
        ``.replaced/<UTC time>-unrecorded/``, made at the first call: one folder for all a run kept aside, so that
        a user restores it from one place; each call all or nothing (quest.store.tree.move_aside)."""
        self.aside = move_aside(self.folder, paths, UNRECORDED, into=self.aside) or self.aside

    def _remove_own(self, path: Path) -> bool:
        """Delete ``path``, a file this folder's record names as written by quest, only while it is that: a plain
        file (not a link, not a folder) that lies inside the folder; anything else in its place is moved to
        ``.replaced/``, never deleted. Whether it was deleted."""
        try:
            inside = bool(inside_folder(path, self.folder)) and path.is_file() and not path.is_symlink()
        except OutsideFolder:
            inside = False
        if inside:
            path.unlink()
        elif os.path.lexists(path):
            self.keep_aside([path])
        return inside

    def _drop(self, name: str, unchanged: bool) -> None:
        """Remove the output ``name`` (its source changed or is gone) and say so; a file in its place that is not
        what the tool wrote (not ``unchanged``) is moved to ``.replaced/`` instead."""
        path = self.folder / name
        if unchanged and self._remove_own(path):
            self.removed += 1
        elif os.path.lexists(path):
            if unchanged:  # _remove_own moved it: not a plain file inside the folder
                self.moved += 1
            else:
                self.keep_aside([path])
                self.moved += 1
        self._add(ManifestEntry(name, removed=True))

    def drop_stale(self, stamps: dict[str, str], sources: set[str] | None = None) -> list[str]:
        """Drop every output (of ``sources``, default all) whose source is not in ``stamps`` or has another stamp
        now, or that is no longer what the tool wrote; the sources dropped."""
        stale = []
        for source, name in self.sources().items():
            if sources is None or source in sources:
                unchanged = self._unchanged(self.entries[name])  # judged once: a digest can be costly
                if stamps.get(source) != self.entries[name].stamp or not unchanged:
                    self._drop(name, unchanged)
                    stale.append(source)
        return stale

    def report(self, kept: int) -> dict[str, int]:
        """What this run did: outputs kept from an earlier run, written, deleted, moved to ``.replaced/``."""
        return {"kept": kept, "written": self.written, "removed": self.removed, "moved": self.moved}


def file_stamp(path: Path) -> str:
    """The state of a source file a resumable tool's rerun compares against: its size and modification time (ns),
    the test make and rsync use (a file rewritten in place to the same size within the file system's time
    resolution goes unseen)."""
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def is_partial_write(name: str) -> bool:
    """A temporary file of quest.store.files.atomic_write (``.<name>.<random>.tmp``) that a kill left behind."""
    return name.startswith(".") and name.endswith(".tmp")


def remove_unrecorded(folder: Path, keep: set[str], manifest: Manifest) -> list[str]:
    """Move every file under ``folder`` (a folder this tool writes) that the manifest does not list and ``keep``
    (paths relative to the manifest's folder) does not name to ``.replaced/<UTC time>-unrecorded/``: outputs a kill
    left unrecorded, partial writes, somebody else's files. Hidden files other than partial writes stay (the
    manifest, a data check's cache, the lock file). The paths moved."""
    listed = set(manifest.entries) | keep
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):
        if Path(dirpath) == manifest.folder:
            dirnames[:] = [d for d in dirnames if d != REPLACED]
        for name in filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(manifest.folder))
            if rel not in listed and (not name.startswith(".") or is_partial_write(name)):
                found.append(path)
    manifest.keep_aside(found)
    manifest.moved += len(found)
    return [str(p.relative_to(manifest.folder)) for p in found]
