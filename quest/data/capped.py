"""``quest-data cap SRC DST --short-side 256``: a copy of an image folder, or of a directory of WebDataset shards, whose
images have their short side at most N pixels (docs/data.md, "Resolution-capped storage").

Decoding is most of a training input's CPU cost and grows with the pixels decoded; ImageNet's training images
average about 400 x 350, so a copy capped at 256 decodes in about half the time (the FFCV recipe). It changes the
data: an image larger than the cap is resized (PIL's antialiased bicubic) and re-encoded as JPEG (``--quality``),
so crops that used to be downsampled from the original can become upsampled. Smaller images are copied byte for
byte. A run on such a copy says so: ``DST/_capped.json`` records the cap, and the run's training input label names
it (quest.engine.builders).

Resumable and safe to interrupt: every output file is written whole (quest.io.atomic_write), an existing output is
kept, and ``_capped.json`` is written last, so running the same command again finishes what is missing. Only the
training split is capped by default; the other splits are linked to the source (``DST/val -> SRC/val``), so
validation and evaluation read the original images.
"""
from __future__ import annotations

import io
import json
import os
import tarfile
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from PIL import Image

from quest.io import atomic_write, write_text_atomic
from quest.workers import die_with_parent

from .shard_index import IMAGE_EXTS, load_info

__all__ = ["cap_image", "cap_folder", "cap_shards", "read_capped", "CAPPED_INFO"]

CAPPED_INFO = "_capped.json"
RESAMPLE = "PIL bicubic (antialiased)"


def cap_image(payload: bytes, short_side: int, quality: int) -> tuple[bytes, bool]:
    """The image's bytes with its short side at most ``short_side`` (True when it was resized and re-encoded as
    JPEG), or the bytes unchanged. A ValueError naming the reason when they are not an image."""
    try:
        with Image.open(io.BytesIO(payload)) as img:
            width, height = img.size
            if min(width, height) <= short_side:
                return payload, False
            factor = short_side / min(width, height)
            size = (max(1, round(width * factor)), max(1, round(height * factor)))
            out = io.BytesIO()
            img.convert("RGB").resize(size, Image.Resampling.BICUBIC).save(out, "JPEG", quality=quality)
    except Exception as exc:  # PIL raises several types for files that are not images
        raise ValueError(f"not a readable image ({exc})") from exc
    return out.getvalue(), True


def _cap_file(job: tuple[str, str], short_side: int, quality: int) -> str | None:
    """Write one capped image (under its own name when kept, as ``<stem>.JPEG`` when re-encoded from another
    format); None, or the reason it could not be read."""
    src, folder = Path(job[0]), Path(job[1])
    names = {src.name, _jpeg_name(src)}
    if any((folder / name).exists() for name in names):
        return None  # done by an earlier, interrupted run (written whole or not at all)
    try:
        payload, resized = cap_image(src.read_bytes(), short_side, quality)
    except (OSError, ValueError) as exc:
        return str(exc)
    atomic_write(folder / (_jpeg_name(src) if resized else src.name), lambda f: f.write(payload))
    return None


def _run(jobs: Sequence[Any], work: Callable[[Any], str | None], workers: int,
         progress: Callable[[Iterable, int], Iterable] | None) -> list[str | None]:
    if workers > 1 and len(jobs) > 16:
        with ProcessPoolExecutor(workers, initializer=die_with_parent) as pool:
            results: Iterable = pool.map(work, jobs, chunksize=16)
            return list(progress(results, len(jobs)) if progress else results)
    return [work(j) for j in (progress(jobs, len(jobs)) if progress else jobs)]


def _jpeg_name(path: Path) -> str:
    # a resized image is a JPEG whatever it was: its name keeps the stem and says so
    return path.name if path.suffix[1:].lower() in ("jpg", "jpeg") else path.stem + ".JPEG"


def cap_folder(src: Path, dst: Path, short_side: int, quality: int = 90, splits: Sequence[str] = ("train",),
               workers: int = 1, progress: Callable[[Iterable, int], Iterable] | None = None) -> dict[str, Any]:
    """An image folder ``src/<split>/<class>/<image>``: the ``splits`` capped into ``dst``, every other split folder
    linked. Returns the manifest written to ``dst/_capped.json``."""
    from .preflight import _files

    src, dst = Path(src).expanduser().resolve(), Path(dst).expanduser()
    _check(src, dst, short_side, quality)
    folders = sorted(p.name for p in src.iterdir() if p.is_dir() and not p.name.startswith("."))
    missing = [s for s in splits if s not in folders]
    if missing:
        raise FileNotFoundError(f"{src} has no split folder {missing[0]!r} (its folders: {folders})")
    dst.mkdir(parents=True, exist_ok=True)
    counts: dict[str, Any] = {}
    for split in folders:
        if split not in splits:
            link = dst / split
            if not link.exists():
                link.symlink_to(src / split, target_is_directory=True)
            continue
        files = [f for f in _files(src / split) if f.suffix[1:].lower() in IMAGE_EXTS]
        jobs = [(str(f), str(dst / f.relative_to(src).parent)) for f in files]
        if len({(j[1], Path(_jpeg_name(f)).stem.lower()) for j, f in zip(jobs, files)}) != len(jobs):
            raise ValueError(f"{src / split}: two images of one class folder share a name stem; the capped copy "
                             "would write both to one JPEG")
        reasons = _run(jobs, partial(_cap_file, short_side=short_side, quality=quality), workers, progress)
        problems = {j[0]: r for j, r in zip(jobs, reasons) if r is not None}
        counts[split] = {"images": len(jobs) - len(problems), "unreadable": problems}
    return _finish(dst, src, short_side, quality, {"layout": "image folder", "splits": counts,
                                                   "linked": [s for s in folders if s not in splits]})


def _cap_shard(job: tuple[str, str], short_side: int, quality: int) -> str | None:
    src, dst = Path(job[0]), Path(job[1])
    if dst.exists():
        return None

    def write(f) -> None:
        with tarfile.open(src) as tar_in, tarfile.open(fileobj=f, mode="w") as tar_out:
            for member in tar_in:
                data = tar_in.extractfile(member).read() if member.isfile() else b""
                name = member.name
                if member.isfile() and name.rsplit(".", 1)[-1].lower() in IMAGE_EXTS:
                    data, resized = cap_image(data, short_side, quality)
                    if resized:  # the sample key stays, the extension says JPEG
                        name = name.rsplit(".", 1)[0] + ".jpg"
                out = tarfile.TarInfo(name)
                out.size, out.mode, out.mtime = len(data), 0o444, 0
                tar_out.addfile(out, io.BytesIO(data))

    try:
        atomic_write(dst, write)
    except (OSError, ValueError, tarfile.TarError) as exc:
        return f"{src.name}: {exc}"
    return None


def cap_shards(src: Path, dst: Path, short_side: int, quality: int = 90, splits: Sequence[str] = ("train",),
               workers: int = 1, progress: Callable[[Iterable, int], Iterable] | None = None) -> dict[str, Any]:
    """A directory of WebDataset shards with an ``_info.json`` (quest.data.make_shards): the shards of ``splits``
    capped into ``dst`` under the same names, the other splits' shards linked, the ``_info.json`` copied (the sample
    counts stay)."""
    src, dst = Path(src).expanduser().resolve(), Path(dst).expanduser()
    _check(src, dst, short_side, quality)
    info, info_path = load_info(src)
    if info_path is None:
        raise FileNotFoundError(f"{src} has no _info.json; index the shards first (python -m quest.data.make_shards "
                                "index)")
    known = info.get("splits", {})
    missing = [s for s in splits if s not in known]
    if missing:
        raise FileNotFoundError(f"{info_path} has no split {missing[0]!r} (its splits: {sorted(known)})")
    dst.mkdir(parents=True, exist_ok=True)
    for split, entry in known.items():
        for name in [] if split in splits else entry.get("filenames", []):
            if not (dst / name).exists():
                (dst / name).parent.mkdir(parents=True, exist_ok=True)
                (dst / name).symlink_to(src / name)
    names = sorted({n for s in splits for n in known[s].get("filenames", [])})
    jobs = [(str(src / n), str(dst / n)) for n in names]
    reasons = _run(jobs, partial(_cap_shard, short_side=short_side, quality=quality), workers, progress)
    problems = [r for r in reasons if r is not None]
    if problems:
        raise ValueError(f"{len(problems)} shard(s) could not be capped (run again after fixing them): "
                         + "; ".join(problems[:5]))
    write_text_atomic(dst / info_path.name, info_path.read_text())
    return _finish(dst, src, short_side, quality, {"layout": "shards", "splits": {s: {"shards": len(known[s].get(
        "filenames", []))} for s in splits}, "linked": [s for s in known if s not in splits]})


def _check(src: Path, dst: Path, short_side: int, quality: int) -> None:
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory; expected an image folder or a directory of shards")
    if short_side < 16:
        raise ValueError(f"--short-side must be at least 16 pixels, got {short_side}")
    if not 1 <= quality <= 100:
        raise ValueError(f"--quality must be in 1..100, got {quality}")
    if dst.resolve() == src or src in dst.resolve().parents:
        raise ValueError(f"the capped copy {dst} must not lie inside its source {src}")
    old = read_capped(dst)
    if old is not None and (old["short_side"], old["quality"]) != (short_side, quality):
        raise ValueError(f"{dst} holds a copy capped at short side {old['short_side']}, quality {old['quality']}; "
                         "a different cap needs another folder")


def _finish(dst: Path, src: Path, short_side: int, quality: int, extra: dict[str, Any]) -> dict[str, Any]:
    manifest = {"short_side": short_side, "quality": quality, "resample": RESAMPLE, "source": str(src), **extra}
    write_text_atomic(dst / CAPPED_INFO, json.dumps(manifest, indent=1) + "\n")  # last: the copy is complete
    return manifest


def read_capped(root: str | os.PathLike | None) -> dict[str, Any] | None:
    """The manifest of a capped copy at ``root`` (None when ``root`` is not one)."""
    if not root:
        return None
    path = Path(root).expanduser() / CAPPED_INFO
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        int(manifest["short_side"]), int(manifest["quality"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a capped copy's manifest ({exc}); expected the JSON quest-data cap "
                         "writes") from exc
    return manifest
