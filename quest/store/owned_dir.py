"""A directory quest owns (a run directory, an evaluation directory): one lock file that names its holder, one place
for what a command replaces (``.replaced/<UTC time>[-label]/``), and one way to compare the config stored in it with
a new one (:func:`flatten`, :func:`differences`, :class:`Difference`).

The lock is :func:`quest.store.files.lock_file` (flock: exclusive, never waits, released by the OS when the process ends,
however it ends). A command takes it before any check, and a refused one must change nothing: until :meth:`claim`
the lock file is put back as it was on :meth:`unlock`, or removed when this command made it.

The third-party ``filelock`` is not used: its 3.x releases, which torch's unpinned requirement still admits, open the
lock file with ``O_TRUNC`` on every attempt, a refused one included (the holder's name is erased and a refused command
changes the directory), and the 4.x releases that no longer do would be a new pinned dependency for the fifteen lines
of :func:`quest.store.files.lock_file`, which tests hold locks with anyway.
"""
from __future__ import annotations

import fcntl
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quest.store.files import REPLACED, lock_file, move_aside, replaced_dir

__all__ = ["ABSENT", "Difference", "OwnedDirectory", "differences", "flatten", "holder_text"]


class _Absent:
    """A key one config lacks; shown as ``(absent)`` (a string would be quoted and could be a real value)."""

    def __repr__(self) -> str:
        return "(absent)"


ABSENT: Any = _Absent()


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value of nested dicts. Lists are values, not branches: a list-valued key (``data.mean``) is one
    key that differs as a whole. An empty dict below the top is kept as a value (``{"a": {}}`` -> ``{"a": {}}``), so
    that it differs from a missing key; the empty top-level dict has no keys."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out if out or not prefix else {prefix: {}}
    return {prefix: tree}


@dataclass(frozen=True)
class Difference:
    """One key whose value differs between the stored config and the new one (:data:`ABSENT` where one lacks it)."""

    key: str
    stored: Any
    new: Any

    def __str__(self) -> str:
        return self.show()

    def show(self, width: int | None = None) -> str:
        """``key: stored -> new`` with each value's repr cut to ``width`` characters (a long list stays one line)."""
        cut = (lambda v: f"{v!r:.{width}}") if width else repr
        return f"{self.key}: {cut(self.stored)} -> {cut(self.new)}"


def differences(stored: Mapping[str, Any], new: Mapping[str, Any],
                defaults: Mapping[str, Any] | None = None) -> list[Difference]:
    """The keys of two nested configs whose values differ, in key order. A key one of them lacks counts as its value
    in ``defaults`` (flattened keys; e.g. the schema's default, for a config an older quest stored), else as
    :data:`ABSENT`."""
    a, b, defaults = flatten(dict(stored)), flatten(dict(new)), defaults or {}
    found = []
    for key in sorted(set(a) | set(b)):
        old, now = a.get(key, defaults.get(key, ABSENT)), b.get(key, defaults.get(key, ABSENT))
        if old != now:
            found.append(Difference(key, old, now))
    return found


def holder_text() -> bytes:
    """What a lock file says while this process holds it: a second process names it in its refusal."""
    return f"pid {os.getpid()} on {os.uname().nodename}\n".encode()


class OwnedDirectory:
    """A directory one command at a time writes: the lock file ``lock_name`` (``what`` names the directory in the
    warning given where flock is unavailable) and its ``.replaced/``. ``is_main=False`` (the other processes of a
    distributed command) neither locks nor archives: only the main process writes."""

    lock_name = ".lock"
    what = "this directory"

    def __init__(self, path: str | Path, is_main: bool = True):
        self.path, self.is_main = Path(path), is_main
        self._lock_fd: int | None = None
        self._lock_before, self._claimed, self._lock_was_there = b"", False, False

    @property
    def lock_path(self) -> Path:
        return self.path / self.lock_name

    def lock(self) -> None:
        """Take the directory's lock and write this process's pid and host into it. Raises
        :class:`quest.store.files.LockHeld` (its ``holder``: what the lock file says) when another process holds it."""
        if not self.is_main:
            return
        self._lock_was_there = self.lock_path.exists()
        fd = lock_file(self.lock_path, self.what)
        # a command refused before claim() puts the old content back (unlock)
        self._lock_before = os.pread(fd, os.fstat(fd).st_size, 0)  # all of it: a refusal puts back every byte
        self._write_lock(fd, self.holder())
        self._lock_fd, self._claimed = fd, False

    def holder(self) -> bytes:
        """What the lock file says while this process holds it (:func:`holder_text`)."""
        return holder_text()

    @property
    def claimed(self) -> bool:
        return self._claimed

    @staticmethod
    def _write_lock(fd: int, content: bytes) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, content, 0)

    def claim(self) -> None:
        """Every check has passed and the command will write: the lock file keeps naming this process after it
        ends (a refused command changes nothing, the lock file's content included)."""
        self._claimed = True

    def unlock(self) -> None:
        """Release the lock; unclaimed, leave the lock file as it was before :meth:`lock`, or gone if it made it."""
        if self._lock_fd is None:
            return
        if not self._claimed:
            if self._lock_was_there:
                self._write_lock(self._lock_fd, self._lock_before)
            else:
                self.lock_path.unlink(missing_ok=True)  # still held: no other process has it locked
        os.close(self._lock_fd)
        self._lock_fd = None

    def held_elsewhere(self) -> bool:
        """Whether another process holds the lock (a record saying 'running' without it was killed). Only reads: a
        shared lock, tried and dropped, on a descriptor opened read-only (a directory this user cannot write is
        still read)."""
        if self._lock_fd is not None:
            return False
        try:
            fd = os.open(self.lock_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        except OSError:  # no flock on this file system: nothing to tell
            return False
        finally:
            os.close(fd)

    def replaced_dir(self, label: str = "") -> Path:
        """A new ``.replaced/<UTC time>[-label]/`` (made): where files a command replaces are kept."""
        return replaced_dir(self.path, label)

    def archive(self, names: Iterable[str], label: str = "") -> Path | None:
        """Move those of ``names`` (relative to the directory) that exist into a new ``.replaced/<UTC time>[-label]/``;
        it, or None when none existed. Nothing is deleted. The lock file and ``.replaced/`` itself never move: a
        moved lock would let a second process lock a new file while this one still works in the directory."""
        if not self.is_main:
            return None
        kept = {self.lock_name, REPLACED}
        return move_aside(self.path, [self.path / name for name in names if Path(name).parts[0] not in kept], label)
