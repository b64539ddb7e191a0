"""A directory quest owns (a run directory, an evaluation directory): one lock file that names its holder, and one
place for what a command replaces (``.replaced/<UTC time>[-label]/``, :func:`quest.store.tree.replaced_dir`).

The lock is :func:`quest.store.locks.lock_file` (flock: exclusive, never waits, released by the OS when the process
ends, however it ends). A command takes it before any check, and a refused one must change nothing: until
:meth:`OwnedDirectory.claim` the lock file is put back as it was on :meth:`OwnedDirectory.unlock`, or removed when
this command made it.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from quest.runtime.phase import begin_changes
from quest.store.files import atomic_write
from quest.store.locks import holder_text, lock_file
from quest.store.made_dirs import missing_dirs
from quest.store.tree import REPLACED, move_aside, remove_made_dirs

__all__ = ["OwnedDirectory"]


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
        self._made: list[Path] = []  # the folders the lock made (the directory and its missing parents)

    @property
    def lock_path(self) -> Path:
        return self.path / self.lock_name

    def lock(self) -> None:
        """Take the directory's lock and write this process's pid and host into it. Raises
        :class:`quest.store.locks.LockHeld` (its ``holder``: what the lock file says) when another process holds it."""
        if not self.is_main:
            return
        self._writable()
        self._lock_was_there = self.lock_path.exists()
        made = missing_dirs(self.path)
        fd = lock_file(self.lock_path, self.what)  # a refused LockHeld found the directory there: nothing made
        # a command refused before claim() puts the old content back (unlock)
        self._lock_before = os.pread(fd, os.fstat(fd).st_size, 0)  # all of it: a refusal puts back every byte
        try:
            self._write_lock(fd, self.holder())
        except OSError as exc:  # a full disk: refused as before the lock, naming its file (pwrite names none)
            self._undo_lock(fd, made)
            if exc.filename is None and exc.errno is not None:
                raise OSError(exc.errno, exc.strerror, str(self.lock_path)) from exc
            raise
        self._made = made
        self._lock_fd, self._claimed = fd, False

    def _writable(self) -> None:
        """PermissionError naming the directory when this process cannot write where it would be made (its nearest
        folder that exists: a read-only mount, another user's run), before the lock's mkdir would make part of it
        and fail with a bare "Permission denied"."""
        probe = next(p for p in (self.path, *self.path.parents) if os.path.lexists(p) or p == p.parent)
        if probe.is_dir() and not os.access(probe, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, f"not writable by this user (uid {os.getuid()}; {probe} has mode "
                                  f"{os.stat(probe).st_mode & 0o777:o}): give another folder, or make it writable "
                                  "(chmod u+w)", str(self.path))

    def _undo_lock(self, fd: int, made: list[Path]) -> None:
        """The lock file as it was (its bytes put back, or gone if this command made it, while still held), the
        descriptor closed, the folders it made removed."""
        try:
            if self._lock_was_there:
                self._write_lock(fd, self._lock_before)  # the space the truncation freed holds them again
            else:
                self.lock_path.unlink(missing_ok=True)
        finally:
            os.close(fd)
            remove_made_dirs(made)

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
        ends (a refused command changes nothing, the lock file's content included), and the command's changes begin
        (quest.runtime.phase)."""
        self._claimed = True
        begin_changes()
        if self._lock_fd is not None and os.fstat(self._lock_fd).st_nlink > 1:
            self._own_lock_file()

    def _own_lock_file(self) -> None:
        """A lock file hard-linked with another folder's (a copy made with ``cp -al``): the command's changes would
        name this process in both, and each folder's commands would hold the other's. This folder gets a lock file
        of its own, locked before it takes the name (a process that opens the name meanwhile finds it held), and the
        shared file says again what it said before this command."""
        held: list[int] = []

        def write(f: BinaryIO) -> None:
            f.write(self.holder())
            with contextlib.suppress(OSError):  # no flock on this file system: lock_file warned already
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else has it open
            held.append(os.dup(f.fileno()))  # the same open file: the lock outlives atomic_write's close

        try:
            atomic_write(self.lock_path, write)
        except BaseException:
            for fd in held:
                os.close(fd)
            raise
        shared, self._lock_fd = self._lock_fd, held[0]
        try:
            self._write_lock(shared, self._lock_before)
        finally:
            os.close(shared)

    def unlock(self) -> None:
        """Release the lock; unclaimed, leave the lock file as it was before :meth:`lock`, or gone if it made it,
        with the folders it made to hold it (each only while empty)."""
        if self._lock_fd is None:
            return
        fd, self._lock_fd, made, self._made = self._lock_fd, None, self._made, []
        if not self._claimed:
            self._undo_lock(fd, made)  # unlinked while still held: no other process has it locked
        else:
            os.close(fd)

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

    def archive(self, names: Iterable[str], label: str = "") -> Path | None:
        """Move those of ``names`` (relative to the directory) that exist into a new ``.replaced/<UTC time>[-label]/``;
        it, or None when none existed. Nothing is deleted. The lock file and ``.replaced/`` itself never move: a
        moved lock would let a second process lock a new file while this one still works in the directory."""
        if not self.is_main:
            return None
        kept = {self.lock_name, REPLACED}
        return move_aside(self.path, [self.path / name for name in names if Path(name).parts[0] not in kept], label)
