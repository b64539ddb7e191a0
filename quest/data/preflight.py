"""The data pre-flight of an image folder: every file under ``<root>/<class>/`` is decoded once, before training, in
parallel worker processes, and either counted as a usable image or reported with its reason (docs/data.md).

The result is cached by the folder's fingerprint (every path, size and mtime): in ``<root>/.quest-preflight.json``
when the root is writable, else under ``$XDG_CACHE_HOME/quest/preflight/`` (``~/.cache``), so a second run on an
unchanged folder reads one file instead of decoding every image.
"""
from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from PIL import Image

from quest.runtime.errors import printable
from quest.runtime.phase import after_checks
from quest.runtime.workers import worker_pool
from quest.store.damage import DamagedFile
from quest.store.files import parse_json
from quest.store.tool_records import check_preflight_cache

from .entries import class_listing, not_read_reason

__all__ = ["Problem", "Report", "check_image_folder_files", "check_file", "folder_files", "RGB_MODES"]

log = logging.getLogger(__name__)
CACHE_NAME = ".quest-preflight.json"
#: Pillow modes whose conversion to RGB keeps the image's values (grey levels, palette colours, alpha dropped, CMYK
#: and YCbCr converted by Pillow's own formulas); 16/32-bit and float modes ("I;16", "I", "F") would be clipped to
#: 8 bits by convert("RGB") and are refused, naming the mode.
RGB_MODES = frozenset({"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr", "La", "RGBa"})


@dataclass(frozen=True)
class Problem:
    path: str
    reason: str

    def __str__(self) -> str:
        """``path: reason``, a line break or other control character in the name escaped: one line in any message."""
        return f"{printable(self.path)}: {self.reason}"


@dataclass
class Report:
    root: str
    images: int = 0  # files that decode to RGB
    problems: list[Problem] = field(default_factory=list)
    cached: bool = False

    def bad_paths(self) -> set[str]:
        return {p.path for p in self.problems}

    def describe(self, limit: int = 20) -> str:
        lines = [f"  {p}" for p in self.problems[:limit]]
        more = len(self.problems) - limit
        return "\n".join(lines + ([f"  ... and {more} more"] if more > 0 else []))


def check_file(path: str) -> str | None:
    """None if ``path`` is a file the data set reads (quest.data.entries: its name) and an image Pillow decodes
    completely and converts to RGB at its real values, else why not: the pre-flight counts as usable only what the
    data set will read (an animated GIF decodes, and ImageFolder never lists it)."""
    if (why := not_read_reason(os.path.basename(path))) is not None:
        return why
    try:
        if os.path.getsize(path) == 0:
            return "empty file (0 bytes)"
        with open(path, "rb") as f:
            with Image.open(f) as img:
                mode = img.mode
                img.load()  # the whole image: a truncated file fails here, not when the sampler draws it
    except PermissionError as exc:
        return f"unreadable ({exc.strerror or 'permission denied'})"
    except OSError as exc:
        text = str(exc)
        if "cannot identify image file" in text:
            return "not an image Pillow can open"
        return f"undecodable ({text})"
    except Exception as exc:  # Pillow raises several types for damaged data (SyntaxError, ValueError, ...)
        return f"undecodable ({type(exc).__name__}: {exc})"
    if mode not in RGB_MODES:
        return f"image mode {mode!r} cannot be converted to RGB at its real values (8-bit RGB or grey expected)"
    return None


def folder_files(root: Path) -> list[Path]:
    """Every visible file under the class folders of ``root`` in sorted order, the layout checked first
    (quest.data.entries: the data set's own listing)."""
    return [f for _, files in class_listing(root) for f in files]


#: changes whenever what a file's verdict depends on changes, so that an older cache is not believed
RULES = "entries-1"


def _fingerprint(files: list[Path]) -> str:
    h = hashlib.sha256(f"{RULES}\n".encode())
    for f in files:
        try:
            st = f.stat()
            h.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))  # any name
        except OSError:
            h.update(f"{f}\0?\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _cache_paths(root: Path) -> list[Path]:
    user = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "quest" / "preflight"
    key = hashlib.sha256(os.fsencode(root.resolve())).hexdigest()[:24]
    return [root / CACHE_NAME, user / f"{key}.json"]


def _read_cache(root: Path, fingerprint: str, names: set[str]) -> Report | None:
    """The cached report of the folder whose files (``names``) have ``fingerprint``, when it accounts for exactly
    those files: every file is a usable image or a problem, so the counts must add up and each problem must be
    one of them. A cache that does not is not believed (a hand-edited count would be reported as checked)."""
    for path in _cache_paths(root):
        try:
            cached = check_preflight_cache(parse_json(path.read_text()), root, path)
            if cached.fingerprint != fingerprint:
                continue
            stray = next((i for i, p in enumerate(cached.problems) if p.path not in names), None)
            if stray is not None:
                raise DamagedFile(path, f"problems[{stray}].path is {cached.problems[stray].path!r}, not one of the "
                                        f"files of {root}", joined=": ")
            if cached.images + len(cached.problems) != len(names):
                raise DamagedFile(path, f"images is {cached.images} beside {len(cached.problems)} problems, where "
                                        f"{root} holds {len(names)} files (each is a usable image or a problem)",
                                  joined=": ")
        except DamagedFile as exc:  # a cache is only a shortcut: not believed, the folder is checked again
            log.warning("the pre-flight's cache is not used: %s", exc)
            continue
        except (OSError, ValueError):
            continue
        return Report(str(root), cached.images, [Problem(p.path, p.reason) for p in cached.problems], cached=True)
    return None


def _write_cache(root: Path, fingerprint: str, report: Report) -> None:
    from quest.store.files import write_json_atomic
    from quest.store.tree import make_dirs

    record = {"fingerprint": fingerprint, "images": report.images,
              "problems": [{"path": p.path, "reason": p.reason} for p in report.problems]}
    for path in _cache_paths(root):  # the root when writable, else the user's cache directory
        if path.name == CACHE_NAME and (why := _not_a_cache(path, root)) is not None:
            log.warning("%s is not the pre-flight's cache (%s): left as it is; the cache is kept in the user's cache "
                        "folder", path, why)
            continue
        try:
            make_dirs(path.parent)
            write_json_atomic(path, record)
            return
        except OSError:
            continue


def _not_a_cache(path: Path, root: Path) -> str | None:
    """Why the file at the cache's name in the data folder is not a pre-flight cache (so somebody's, never written
    over), or None: nothing there, or a cache of any fingerprint."""
    if not os.path.lexists(path):
        return None
    if path.is_symlink() or not path.is_file():
        return "not a regular file"
    try:
        check_preflight_cache(parse_json(path.read_bytes()), root, path)
    except DamagedFile as exc:
        return exc.problem
    except (OSError, ValueError) as exc:
        return str(exc)
    return None


def check_image_folder_files(root: str | Path, workers: int | None = None, use_cache: bool = True,
                             progress: Callable[[Iterable, int], Iterable] | None = None,
                             files: list[Path] | None = None) -> Report:
    """Decode every file under ``root``'s class folders in ``workers`` processes (default: the CPU count, at most
    8) and report each that is not a usable image, with its reason; cached by the folder's fingerprint.
    ``progress(iterable, total)`` wraps the per-file results (a progress bar); ``files``: ``folder_files(root)`` when the
    caller listed them already."""
    root = Path(root).expanduser()
    files = folder_files(root) if files is None else files
    fingerprint = _fingerprint(files)
    if use_cache and (cached := _read_cache(root, fingerprint, {str(f) for f in files})) is not None:
        return cached
    report = Report(str(root))
    names = [str(f) for f in files]
    workers = workers or min(8, os.cpu_count() or 1)
    if workers > 1 and len(names) > 64:
        with worker_pool(workers) as pool:
            results: Iterable = pool.map(check_file, names, chunksize=64)
            results = list(progress(results, len(names)) if progress else results)
    else:
        results = [check_file(n) for n in (progress(names, len(names)) if progress else names)]
    for name, reason in zip(names, results):
        if reason is None:
            report.images += 1
        else:
            report.problems.append(Problem(name, reason))
    if use_cache:
        # a cache is a change too: written once the command's checks have all passed (quest.runtime.phase)
        after_checks(lambda: _write_cache(root, fingerprint, report))
    return report


def apply_preflight(ds, root: Path, bad_images: str, max_skipped_fraction: float, split: str) -> None:
    """Before training: check every file of an image-folder split; with bad_images=error refuse the split naming
    every problem, with skip drop the bad files from ``ds.samples`` (recorded in ``ds.preflight_skipped``), failing
    when they exceed ``max_skipped_fraction``. Files the data set never reads (other extensions) count as problems,
    so every visible file is accounted for."""
    from .folder import CorruptImageError

    report = check_image_folder_files(root)
    ds.preflight_skipped = len(report.problems)
    if not report.problems:
        return
    total = report.images + len(report.problems)
    if bad_images == "error":
        raise CorruptImageError(f"data pre-flight: {len(report.problems)} of the {total} files of the {split} split "
                                f"{root} are not usable images (docs/data.md):\n{report.describe()}\nFix or remove "
                                "them, or set data.bad_images=skip to leave them out")
    if report.images == 0 or len(report.problems) / total > max_skipped_fraction:
        raise CorruptImageError(f"data pre-flight: {len(report.problems)} of the {total} files of the {split} split "
                                f"{root} are not usable images, more than data.max_skipped_fraction="
                                f"{max_skipped_fraction} (docs/data.md):\n{report.describe()}")
    bad = report.bad_paths()
    ds.samples = [s for s in ds.samples if s[0] not in bad]
    ds.imgs, ds.targets = ds.samples, [t for _, t in ds.samples]
    # a decision on the record (summary.json, the first metrics row, train.log: quest.train.lifecycle), not only
    # in the sample list
    ds.preflight_left_out = left_out_record(report, total)


def left_out_record(report: Report, total: int, first: int = 5) -> dict:
    """What the pre-flight left out of a split: how many files of how many, per kind of reason, the first paths."""
    kinds: dict[str, int] = {}
    for problem in report.problems:
        kind = problem.reason.split(":", 1)[0].split(" (", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"files": len(report.problems), "of": total, "by_reason": kinds,
            "first": [p.path for p in report.problems[:first]]}


def preflight_left_out(ds: Any) -> dict | None:
    """The record of what the pre-flight left out of ``ds`` (a Subset's underlying set too), or None."""
    while ds is not None and not hasattr(ds, "preflight_left_out") and hasattr(ds, "dataset"):
        ds = ds.dataset
    return getattr(ds, "preflight_left_out", None)
