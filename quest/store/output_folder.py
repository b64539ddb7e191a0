"""The folder a command writes its outputs into (``quest-export --out``, ``quest-report --out``, ``quest-plot --out``'s
folder, ``quest-data cap``'s and ``make_shards``' output, the toy study's, a run's ``tensorboard/``): what a command
may remove there (docs/training.md, "What a command may remove").

- The command holds the folder (:func:`holding`: the lock file ``.lock`` of :class:`~quest.store.owned_dir.OwnedDirectory`,
  naming the command, its pid and host) from before its first check to its end; a second command writing the same
  folder is refused at once, naming the holder, and changes nothing (:class:`FolderHeld`).
- Every check comes before the first change: a refused command leaves the folder as it was (the lock file put back,
  a folder the lock made removed again).
- It removes or replaces in place only a file the folder's manifest says it wrote, unchanged since
  (:attr:`OutputFolder.manifest`, quest.store.manifest: per file the command, its size and SHA-256). Any other file
  in the place of an output (somebody else's, or one edited since) is refused (:func:`quest.store.tree.refuse_present`)
  or moved to ``.replaced/<UTC time>/`` with its bytes (:meth:`OutputFolder.make_room`); nothing is deleted.
- The manifest is believed only once every line is checked, when the folder is held: a damaged one is refused
  before any change.

The resumable data tools hold their folder the same way and keep their outputs in the same manifest, each with the
source it was made from.

A command that writes one file into a folder that is not its own (``quest-plot --out fig.png``, often the user's
working directory) holds that file, not the folder (:func:`holding` with ``output``): its lock file is
``.<name>.lock`` beside it (``.fig.png.lock``), so that two figures can be drawn into one folder at once while a
second command drawing the same figure is refused, and it keeps no manifest: such a command replaces
nothing in place (any file already there is refused, or moved to ``.replaced/`` with ``--overwrite``), so a record
would say nothing it uses. The lock file it made goes at the end, claimed or not, and the folder holds the figure
alone. It is removed while still locked, never after: a process that opened it just before and locks it just after
finds it gone from its path and opens the path again (:func:`quest.store.locks.lock_file` compares the file it locked with
the one at the path), so two commands never both hold one output. A lock file that was there before is left, as
every lock file is, but one the same command left when it was killed, once this run has written its files.

``quest-export`` and ``quest-report --out`` hold their folder the same way (``transient``): an export folder is
handed on whole (uploaded to a model hub, copied beside other models), a report's tables beside a paper's, so each
ends holding its files alone; neither replaces anything in place (earlier files are refused, or moved to
``.replaced/`` with ``--overwrite``), so neither keeps a record.
"""
from __future__ import annotations

import argparse
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from functools import cached_property
from pathlib import Path

from quest.store.files import cut_write_temporaries
from quest.store.locks import LockHeld, holder_text
from quest.store.made_dirs import output_dir_problem
from quest.store.manifest import Manifest
from quest.store.owned_dir import OwnedDirectory
from quest.store.run_files import is_run_directory
from quest.store.tree import move_aside, remove, remove_made_dirs, replaced_problem

__all__ = ["input_path", "FolderHeld", "FolderUnmakeable", "OutputFolder", "holding", "output_path"]


class FolderHeld(ValueError):
    """Another command holds the folder (a ValueError: the user's to resolve, quest.runtime.errors)."""


class FolderUnmakeable(ValueError):
    """The folder a command would write cannot be made (quest.store.made_dirs.output_dir_problem: a part of it is a
    file, a link that leads nowhere, a name too long): a ValueError, the user's to resolve, like a bad ``--out``."""


class OutputFolder(OwnedDirectory):
    """A folder ``command`` writes outputs into (module docstring). Paths given to its methods are files in it."""

    what = "this output folder"

    def __init__(self, path: str | Path, command: str, lock: bool = True, output: str | None = None,
                 transient: bool = False):
        super().__init__(path, is_main=lock)
        self.command, self.output = command, output
        self.transient = transient or output is not None  # the lock file it made goes at the end
        if output is not None:  # one file's lock, not the folder's (module docstring)
            self.lock_name = f".{output}.lock"
            self.what = f"{self.path / output}"

    def unlock(self) -> None:
        """Release the lock; a transient lock file (one output's, or an export's), made by this command, is removed
        first (module docstring)."""
        # a lock file the same command left when it was killed (its holder line) goes too, once this one has written
        left_by_us = self._claimed and self._lock_before.startswith(f"{self.command}, ".encode())
        if self.transient and self._lock_fd is not None and (not self._lock_was_there or left_by_us):
            self.lock_path.unlink(missing_ok=True)  # still held: a process that opened it retries (lock_file)
        super().unlock()

    def holder(self) -> bytes:
        return f"{self.command}, {holder_text().decode()}".encode()

    @cached_property
    def manifest(self) -> Manifest:
        """What the commands writing this folder wrote there (quest.store.manifest), read and checked on first use,
        which :func:`holding` makes before the block runs: a damaged manifest is refused before any change."""
        return Manifest(self.path, self.command)

    def make_room(self, paths: Iterable[str | Path], keep_own: bool = False, label: str = "") -> Path | None:
        """Every check has passed: claim the folder and move those of ``paths`` that exist into a new
        ``.replaced/<UTC time>[-label]/`` (returned; None when none moved), but with ``keep_own`` a file this
        command wrote and nobody changed since (:meth:`Manifest.owns`), which the command then replaces in place."""
        self.claim()
        paths = [Path(p) for p in paths]
        for stale in {t for p in paths for t in cut_write_temporaries(p)}:  # a killed run's, of these very files
            remove(stale)
        present = [p for p in paths if p.exists() or p.is_symlink()]
        return move_aside(self.path, [p for p in present if not (keep_own and self.manifest.owns(p))], label)


def input_path(text: str) -> Path:
    """The argparse type of a path a command reads: never an empty one (an unset shell variable), which would read
    the working directory, and whatever it holds, as the input."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; expected a path (was it an unset shell variable?)")
    return Path(text)


def output_path(text: str, file: bool = False) -> Path:
    """The argparse type of a command's ``--out``: a path, never an empty one (``--out "$OUT"`` with ``OUT`` unset),
    which would write the command's files into the working directory, nor one going up ('..') from a folder that
    does not exist, nor one that cannot be made (quest.store.made_dirs.output_dir_problem: a part of it a file or a
    link that leads nowhere, a name too long), refused before the command reads anything. ``file``: the path of a
    file to write (its folder is checked, and its name's length)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty; expected a path (was it an unset shell variable?)")
    path = Path(text)
    for i, part in enumerate(path.parts):
        # 'x/sub/..' with no x/sub: the folder would be made on the way (its lock's mkdir) and left behind, empty;
        # resolved as written it names no folder, and normalised it would go wrong through a link
        if part == ".." and not Path(*path.parts[:i]).is_dir():
            raise argparse.ArgumentTypeError(
                f"{text} goes up ('..') from {Path(*path.parts[:i])}, which is not an existing folder; expected a "
                "path whose every '..' follows an existing folder (write it without the '..')")
    problem = output_dir_problem(text, file=file)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return path


@contextmanager
def holding(path: str | Path, command: str, output: str | None = None,
            transient: bool = False) -> Iterator[OutputFolder]:
    """Hold the folder ``path`` for ``command`` while the block runs, or with ``output`` (a file's name) only that
    file in it (module docstring); :class:`FolderHeld` naming the holder when another command holds it. A block that
    ends without :meth:`OutputFolder.claim` (refused) leaves the folder as it was: the lock file put back or removed,
    the folders the lock made removed; :class:`FolderUnmakeable` when the folder cannot be made. ``transient``: the
    folder's lock file, when this command made it, goes at the end too (a folder that is handed on whole, such as an
    export uploaded to a model hub, holds its outputs alone)."""
    problem = output_dir_problem(str(path))
    if problem:  # before the lock's mkdir, whose error would name no reason ("File exists" for a dangling link)
        raise FolderUnmakeable(f"{path}: {problem}")
    # a .replaced/ that cannot keep what the command moves aside (a link, a file): refused before the lock file, whose
    # making and removal would change the folder; a tool that found it only when it replaced something would have begun
    # its changes (_info.json marked incomplete). No quest command makes one so while another holds the folder.
    if output is None and (damaged := replaced_problem(path)) is not None:
        raise damaged
    if output is None and is_run_directory(path):  # its lock file is the run's: a tool would take it over
        raise FolderUnmakeable(f"{path} is a training run's directory; give {command} a folder of its own")
    folder = OutputFolder(path, command, output=output, transient=transient)
    made = [p for p in (folder.path, *folder.path.parents) if not p.exists()]  # what lock_file's mkdir makes
    try:
        folder.lock()
    except LockHeld as exc:
        remove_made_dirs(made)
        held = folder.path if output is None else folder.path / output
        raise FolderHeld(f"{held} is being written by {exc.holder} (its lock file {exc.path}); wait for that "
                         f"command to end, or give this {command} another "
                         f"{'folder' if output is None else 'file'}") from None
    try:
        folder.manifest  # a damaged manifest is refused now, before any change, not after the outputs are written
        yield folder
    finally:
        claimed = folder.claimed
        folder.unlock()
        if not claimed:
            remove_made_dirs(made)


