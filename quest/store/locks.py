"""The lock of a folder (or one output) quest writes: :func:`lock_file` takes an exclusive flock on a lock file that
names its holder (:func:`holder_text`), never waits, and is released by the OS when the process ends, however it
ends; a second process is refused with :class:`LockHeld` naming the first.

The third-party ``filelock`` is not used: its 3.x releases, which torch's unpinned requirement still admits, open the
lock file with ``O_TRUNC`` on every attempt, a refused one included (the holder's name is erased and a refused command
changes the directory), and the 4.x releases that no longer do would be a new pinned dependency for the few lines of
:func:`lock_file`, which tests hold locks with anyway.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
from pathlib import Path

from quest.store.damage import DamagedFile

__all__ = ["LockHeld", "holder_text", "lock_file"]


def holder_text() -> bytes:
    """What a lock file says while this process holds it: a second process names it in its refusal."""
    return f"pid {os.getpid()} on {os.uname().nodename}\n".encode()


class LockHeld(OSError):
    """Another process holds the lock; ``holder`` is what it wrote into the lock file (its pid and host)."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is locked by {holder}")
        self.path, self.holder = path, holder


def lock_file(path: Path, what: str) -> int:
    """An exclusive lock on ``path`` (created if missing), held until the returned descriptor is closed or the
    process ends, however it ends. Raises :class:`LockHeld` when another process holds it; on a file system without
    flock (some network mounts) warns that ``what`` is unprotected and returns the descriptor anyway. The file
    locked is the one at ``path`` when the lock is taken: a holder may remove its lock file as it lets go. A link, a
    directory or a special file where the lock file belongs is :class:`DamagedFile`: it is never followed or written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = _open_lock(path, what)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "unknown"
            if (links := os.fstat(fd).st_nlink) > 1:  # the holder may be working in another folder
                holder += (f" (this lock file is one of {links} hard links to one file, as in a folder copied with "
                           "cp -al: a command in any of those folders holds it)")
            os.close(fd)
            raise LockHeld(path, holder) from None
        except OSError as exc:
            logging.getLogger("quest").warning("cannot lock %s (%s); make sure no other process uses %s", path, exc,
                                               what)
            return fd
        if _same_file(fd, path):
            return fd
        # the holder removed the lock file as it let go (a lock file a command made for one output, quest.store.output_folder)
        # between this open and this flock: the file locked is no longer at ``path``, and a third process may lock
        # the one there now; try again with the file that is there
        os.close(fd)


def _open_lock(path: Path, what: str) -> int:
    """The lock file at ``path``, opened (made if missing), never through a link: the holder's name written into a
    file elsewhere would overwrite it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            raise
        kind = f"a symbolic link to {os.readlink(path)}" if path.is_symlink() else "a directory or special file"
        raise DamagedFile(path, f"{kind}, expected the plain lock file that names the command writing {what}",
                          "Move it away; quest makes the lock file again") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device opened: no lock file of quest's
        os.close(fd)
        raise DamagedFile(path, f"a special file, expected the plain lock file that names the command writing {what}",
                          "Move it away; quest makes the lock file again")
    return fd


def _same_file(fd: int, path: Path) -> bool:
    try:
        found, held = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)
