"""Writing result files so that a reader never sees half of one: a temporary sibling, fsync, then a rename; a
failed write (a full disk, Ctrl-C) removes the temporary and leaves the previous file as it was. And the one
markdown table renderer the reports share.

Used by the training engine (summary.json, run.json, checkpoints), the evaluation reports, ``quest.report`` and the
toy study.
"""
from __future__ import annotations

import csv
import errno
import fcntl
import hashlib
import io
import json
import logging
import math
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from omegaconf import OmegaConf

__all__ = ["DamagedFile", "LockHeld", "OutsideFolder", "inside_folder", "atomic_write",
           "lock_file", "move_aside", "replaced_dir", "REPLACED",
           "figure_bytes", "new_file_mode", "open_records", "parse_json", "read_json", "file_sha256", "readable",
           "refuse_present", "save_figure", "write_text_atomic", "write_json_atomic", "write_csv_atomic", "csv_text",
           "json_text", "markdown_table", "plain"]


_UMASK_LOCK = threading.Lock()


def _umask() -> int:
    """The process's umask. Linux shows it in /proc (read-only, thread-safe); elsewhere it can only be read by
    setting it, so that is done under a lock and undone at once."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    with _UMASK_LOCK:
        mask = os.umask(0o022)
        os.umask(mask)
    return mask


def new_file_mode(path: str | Path) -> int:
    """The mode a replaced file keeps, or what ``open(path, "w")`` would give a new one (0o666 less the umask):
    mkstemp's 0o600 would hide a run's results from the teammates its umask lets read them."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write`` on a binary file that becomes ``path`` only once complete and on disk, with the mode of the
    file it replaces or, for a new one, the mode the umask gives (:func:`new_file_mode`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, new_file_mode(path))
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class DamagedFile(ValueError):
    """A file quest wrote earlier that cannot be read back as what it should hold (cut short, overwritten, another
    format). The message names the file and what was expected; ``path`` and ``problem`` say it to code."""

    def __init__(self, path: Path, problem: str, remedy: str = ""):
        super().__init__(f"{path} is damaged: {problem}" + (f". {remedy}" if remedy else ""))
        self.path, self.problem = Path(path), problem


def readable(path: Path, what: str) -> None:
    """Raise PermissionError naming ``path`` and the permission it lacks (a raw ``[Errno 13]`` names neither the
    permission nor the way out), when the process cannot read it."""
    if path.exists() and not os.access(path, os.R_OK | (os.X_OK if path.is_dir() else 0)):
        need = "read and search (r-x)" if path.is_dir() else "read (r)"
        raise PermissionError(f"{what} {path} is not readable by this user (uid {os.getuid()}): it needs {need} "
                              f"permission (mode {os.stat(path).st_mode & 0o777:o}); fix it with chmod or run as its owner")


class OutsideFolder(ValueError):
    """A file a folder holds (a run's summary.json) that is a link resolving outside that folder: believing it
    would read another folder's file (another run's numbers counted twice) as this folder's own."""


def inside_folder(path: str | Path, folder: str | Path) -> Path:
    """``path``, a file ``folder`` holds, when it resolves (every link followed) inside ``folder``; a link within
    the folder is its own file. :class:`OutsideFolder` naming the file and where it points otherwise."""
    path = Path(path)
    target = path.resolve()
    if target.is_relative_to(Path(folder).resolve()):
        return path
    raise OutsideFolder(f"{path}: a link to {target}, outside {folder} (expected the folder's own file, not a link "
                        "to another's: replace the link by a copy of the file, or remove it)")


def parse_json(text: str | bytes) -> Any:
    """``json.loads``, but JSON nested deeper than Python's decoder goes (``[[[[...``, which no file quest writes
    holds) is a :class:`json.JSONDecodeError` like any other damage, not a RecursionError (a bug's traceback)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise json.JSONDecodeError("nested deeper than any file quest writes", str(text[:40]), 0) from None


def read_json(path: str | Path, expected: type = dict) -> Any:
    """A JSON file quest wrote: its content, ``None`` when there is no such file, :class:`DamagedFile` when it is not
    valid JSON of the ``expected`` type (cut short, garbage, ``[]`` where an object belongs), and PermissionError
    naming the file when it cannot be read."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except PermissionError:
        readable(path, "file")
        raise
    try:
        value = parse_json(raw.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DamagedFile(path, f"not valid JSON ({exc}; {len(raw)} bytes)") from None
    if not isinstance(value, expected):
        raise DamagedFile(path, f"holds a JSON {type(value).__name__}, expected a JSON "
                                f"{'object' if expected is dict else expected.__name__}")
    return value


def open_records(path: str | Path) -> TextIO:
    """A line-per-record text file (JSON lines) opened for appending, line-buffered, after a last line that a killed
    writer left half-written has been cut off: every record appended starts on a line of its own."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_file() and path.stat().st_size:
        with open(path, "rb+") as f:
            data = f.read()
            if not data.endswith(b"\n"):
                f.truncate(data.rfind(b"\n") + 1)
    return open(path, "a", buffering=1)


def figure_bytes(fig: Any, path: str | Path, **savefig_kwargs: Any) -> bytes:
    """A matplotlib figure rendered in the format of ``path``'s suffix, as ``fig.savefig(path)`` would choose it:
    a command renders before it changes anything, so that a refused format or a failed drawing moves nothing aside."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format=Path(path).suffix[1:].lower() or None, **savefig_kwargs)
    return buffer.getvalue()


def save_figure(fig: Any, path: str | Path, **savefig_kwargs: Any) -> Path:
    """A matplotlib figure written like every other result (whole, or the previous file left as it was)."""
    data = figure_bytes(fig, path, **savefig_kwargs)
    return atomic_write(path, lambda f: f.write(data))


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


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, read in blocks (a checkpoint can be gigabytes)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_text_atomic(path: str | Path, text: str) -> Path:
    return atomic_write(path, lambda f: f.write(text.encode()))


def plain(value: Any) -> Any:
    """Plain JSON values: OmegaConf configs as resolved containers, torch / numpy scalars as numbers, tuples as
    lists, and non-finite floats as the strings 'nan', 'inf', '-inf' (JSON has no NaN or infinity; the strings stay
    readable and parseable)."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def json_text(obj: Any, indent: int | None = 2) -> str:
    """``obj`` as JSON (through :func:`plain`; anything else JSON cannot hold as its text), ending in a newline."""
    return json.dumps(plain(obj), indent=indent, default=str, allow_nan=False) + "\n"


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    return write_text_atomic(path, json_text(obj))


def csv_text(rows: Iterable[Mapping[str, Any]] | Iterable[Sequence[Any]], fields: Sequence[str] | None = None) -> str:
    """Rows as CSV: dicts under a header of ``fields`` (all keys of the first row by default), or plain sequences
    (the first one being the header)."""
    buf = io.StringIO()
    rows = list(rows)
    if rows and isinstance(rows[0], Mapping):
        writer = csv.DictWriter(buf, fieldnames=list(fields or rows[0]), lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)  # type: ignore[arg-type]
    else:
        csv.writer(buf, lineterminator="\n").writerows(rows)
    return buf.getvalue()


def write_csv_atomic(path: str | Path, rows: Iterable[Mapping[str, Any]] | Iterable[Sequence[Any]],
                     fields: Sequence[str] | None = None) -> Path:
    return write_text_atomic(path, csv_text(rows, fields))


def markdown_table(header: Sequence[Any], rows: Iterable[Sequence[Any]]) -> list[str]:
    """A GitHub markdown table, one string per line; ``|`` inside a cell is escaped."""
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(map(esc, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return lines + ["| " + " | ".join(map(esc, row)) + " |" for row in rows]


class OutputExists(ValueError):
    """A command would replace files it finds in place (quest.runtime.errors counts a ValueError as the user's)."""


def refuse_present(paths: Iterable[str | Path], overwrite: bool, flag: str = "--overwrite") -> list[Path]:
    """A command's check before it writes ``paths``: OutputExists naming those that exist and ``flag``, unless
    ``overwrite``; those that exist."""
    present = [Path(p) for p in paths if Path(p).exists() or Path(p).is_symlink()]
    if present and not overwrite:
        names = ", ".join(str(p) for p in present)
        raise OutputExists(f"{names} already exist{'s' if len(present) == 1 else ''}: pass {flag} to replace "
                           f"{'it' if len(present) == 1 else 'them'} (the old files are kept in .replaced/ beside "
                           "them), or choose another output")
    return present


#: where a folder quest owns keeps what a command replaced (a run, an evaluation's results, an export): nothing is
#: deleted, every replacement gets its own ``.replaced/<UTC time>[-<label>]/``
REPLACED = ".replaced"


def replaced_dir(folder: str | Path, label: str = "") -> Path:
    """A new ``folder/.replaced/<UTC time>[-label]/`` (made), for what a command is about to replace;
    :class:`DamagedFile` when ``.replaced`` is a link (what is kept would leave the folder) or a file."""
    import datetime

    root = Path(folder) / REPLACED
    if root.is_symlink() or (root.exists() and not root.is_dir()):  # what is kept stays in the folder
        kind = f"a symbolic link to {os.readlink(root)}" if root.is_symlink() else "not a directory"
        raise DamagedFile(root, f"{kind}, expected the folder inside {folder} where quest keeps what a command "
                                "replaces", "Move it away; quest makes the folder again")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
    # two replacements within one tick of a coarse clock: the second gets a count, never the first one's folder
    n = 1
    while True:
        name = stamp if n == 1 else f"{stamp}-{n}"
        dest = Path(folder) / REPLACED / (f"{name}-{label}" if label else name)
        try:
            dest.mkdir(parents=True)
            return dest
        except FileExistsError:
            n += 1


def remove_made_dirs(made: Iterable[str | Path]) -> None:
    """Remove the directories a refused command made (deepest first), each only while empty, stopping at the first
    that is not: whatever anything wrote in them stays, and a directory that was there before is never in ``made``."""
    for path in made:
        try:
            Path(path).rmdir()
        except OSError:
            return


def move_aside(folder: str | Path, paths: Iterable[str | Path], label: str = "") -> Path | None:
    """Move those of ``paths`` that exist into a new :func:`replaced_dir` of ``folder``, each under its path
    relative to ``folder`` (its name when outside it: two files of one name in different sub-folders never meet);
    it, or None when none existed. The one way quest's runs, evaluations and tools keep what they replace."""
    present = [Path(p) for p in paths if Path(p).exists() or Path(p).is_symlink()]
    if not present:
        return None
    dest = replaced_dir(folder, label)
    for path in present:
        rel = path.relative_to(folder) if path.is_relative_to(folder) else Path(path.name)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(path), dest / rel)  # os.replace within a file system (a link stays a link); a copy across them
    return dest

