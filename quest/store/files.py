"""Writing result files so that a reader never sees half of one: a temporary sibling, fsync, then a rename; a
failed write (a full disk, Ctrl-C) removes the temporary and leaves the previous file as it was. Appending to a
record or a log (:func:`open_records`), and reading back a JSON file quest wrote (:func:`read_json`;
quest.store.damage.DamagedFile when it cannot be believed). Every write asks the running command's phase first
(quest.runtime.phase). Changes to a folder's tree (folders made, files moved or removed, ``.replaced/``) are
quest.store.tree; the locks of the folders quest writes, quest.store.locks.
"""
from __future__ import annotations

import csv
import glob
import hashlib
import io
import json
import logging
import math
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from omegaconf import OmegaConf

from quest.runtime.phase import may_change
from quest.store.damage import DamagedFile
from quest.store.tree import move_aside

__all__ = ["OutsideFolder", "inside_folder", "atomic_write", "cut_write_temporaries", "figure_bytes", "new_file_mode",
           "open_records", "parse_json", "read_json", "file_sha256", "readable", "save_figure", "write_text_atomic",
           "write_json_atomic", "write_csv_atomic", "csv_text", "json_text", "plain"]


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


def cut_write_temporaries(path: str | Path) -> list[Path]:
    """The temporary files that killed writes of ``path`` left beside it (:func:`atomic_write`'s
    ``.<name>.<random>.tmp``, an older quest's ``.<name>.tmp``): its writer's own by name, removed before the writer
    writes ``path`` again."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    found = {*path.parent.glob(f".{glob.escape(path.name)}.*.tmp"), path.with_name(f".{path.name}.tmp")}
    return sorted(t for t in found if t.is_file() and not t.is_symlink())


def atomic_write(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write`` on a binary file that becomes ``path`` only once complete and on disk, with the mode of the
    file it replaces or, for a new one, the mode the umask gives (:func:`new_file_mode`)."""
    path = Path(path)
    may_change(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = ""  # made inside the try: a Ctrl-C just after mkstemp must not leave its file
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, new_file_mode(path))
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        named = _named(exc, path)  # a write or fsync (a full disk): the file it was making
        if named is exc:
            raise
        raise named from exc
    except BaseException:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        raise
    return path


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


#: the integers a file quest writes can hold: 64 bits, as torch and numpy count (a step, a byte count, a time in ns)
_INT_RANGE = (-2**63, 2**63 - 1)


def parse_json(text: str | bytes) -> Any:
    """``json.loads``, but what no file quest writes holds is a :class:`json.JSONDecodeError` like any other damage,
    not a bug's traceback further on: JSON nested deeper than Python's decoder goes (``[[[[...``, a RecursionError
    here), and an integer beyond 64 bits (``10**400``, which Python reads whole and float() then overflows on)."""
    doc = text.decode(errors="replace") if isinstance(text, bytes) else text

    def integer(digits: str) -> int:
        # length first: Python refuses to read an integer of over 4,300 digits (a ValueError of its own)
        if len(digits.lstrip("-")) > 19 or not _INT_RANGE[0] <= int(digits) <= _INT_RANGE[1]:
            raise json.JSONDecodeError(f"an integer of {len(digits.lstrip('-'))} digits, beyond the 64 bits of any "
                                       "file quest writes", doc, max(doc.find(digits), 0))
        return int(digits)

    try:
        return json.loads(text, parse_int=integer)
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


def _named(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path`` where the system's error names no file (a write or fsync on a full disk)."""
    if exc.filename is None and exc.errno is not None:
        return OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path))
    return exc


class _Records(io.TextIOWrapper):
    """A record file's text stream whose errors of the system (a full disk) name the file: a write's own name none."""

    path: Path

    def write(self, text: str) -> int:
        try:
            return super().write(text)
        except OSError as exc:
            raise _named(exc, self.path) from exc

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as exc:
            raise _named(exc, self.path) from exc

    def close(self) -> None:
        try:
            super().close()
        except OSError as exc:
            raise _named(exc, self.path) from exc


def open_records(path: str | Path, warn: Callable[[str], None] | None = None) -> TextIO:
    """A line-per-record text file (JSON lines, a log) opened for appending, line-buffered, after a last line that a
    killed writer left half-written has been cut off: every record appended starts on a line of its own.

    Appending never writes through to another file. A file with another name too (a hard link, as ``cp -al`` and
    backups by hard links make) becomes this folder's own copy first, with the same bytes: the other name keeps its
    file as it was. A link in the file's place is not this folder's record: it is moved, not followed, to
    ``.replaced/<UTC time>-unrecorded/`` beside it, and a new file begins; ``warn`` (a logger's warning by default)
    is told so once the new file is open."""
    path = Path(path)
    may_change(path)
    if path.is_symlink():
        target, kept = os.readlink(path), move_aside(path.parent, [path], "unrecorded")
    else:
        target = kept = None
        if path.is_file() and os.lstat(path).st_nlink > 1:
            held = path.read_bytes()
            atomic_write(path, lambda f: f.write(held))  # a new file of its own under this name
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = new_file_mode(path)
    # appending, never through a link (O_NOFOLLOW), and readable too: the cut below reads the file's last line
    # a name in a line that is not UTF-8 (a file of an old zip archive) is written escaped, never an encoder's error
    raw = io.FileIO(path, "a", opener=lambda name, flags: os.open(name, (flags & ~os.O_WRONLY) | os.O_RDWR
                                                                  | os.O_NOFOLLOW, mode))
    records = _Records(io.BufferedWriter(raw), encoding="utf-8", errors="backslashreplace", line_buffering=True)
    records.path = path
    fd = records.fileno()
    size = os.fstat(fd).st_size
    if size:
        data = os.pread(fd, size, 0)
        if not data.endswith(b"\n"):
            os.ftruncate(fd, data.rfind(b"\n") + 1)
    if kept is not None:
        (warn or logging.getLogger("quest").warning)(f"{path} was a link to {target}, not this folder's own: kept in "
                                                     f"{kept}, and a new one begins")
    return records


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


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, read in blocks (a checkpoint can be gigabytes)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``text`` written as UTF-8; a name in it that is not UTF-8 (a folder of an old zip archive) is written escaped
    (``caf\\udce9``), never an encoder's error after the work was done."""
    return atomic_write(path, lambda f: f.write(text.encode("utf-8", "backslashreplace")))


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
