"""``quest-data cap SRC DST --short-side 256``: a copy of an image folder, or of a directory of WebDataset shards, whose
images have their short side at most N pixels (docs/data.md, "Resolution-capped storage").

Decoding is most of a training input's CPU cost and grows with the pixels decoded; ImageNet's training images
average about 400 x 350, so a copy capped at 256 decodes in about half the time (the FFCV recipe). It changes the
data: an image larger than the cap is resized (PIL's antialiased bicubic) and re-encoded as JPEG (``--quality``),
so crops that used to be downsampled from the original can become upsampled. Smaller images are copied byte for
byte. A run on such a copy says so: ``DST/_capped.json`` records the cap, and the run's training input label names
it (quest.data.pipelines.train_input.build_train_input).

Resumable, safe to interrupt, and it follows its source: every output file is written whole (quest.store.files.atomic_write)
and recorded in the folder's manifest ``DST/.manifest.jsonl`` (quest.store.manifest) with its own size and SHA-256
and its source's size and modification time. Running
the same command again keeps the outputs whose source is unchanged, redoes those whose source changed, removes
those whose source is gone, moves anything it did not record to ``DST/.replaced/`` (never deleted), and ends with
the copy a fresh run would make of today's source. The folder is held for the whole command: a second one into it
is refused (quest.store.output_folder). ``_capped.json`` says ``complete: false`` from the first change to the last, and runs and
``quest-data check`` refuse such a copy; it says ``complete: true`` only once the copy is whole. A folder that holds
files quest-data cap did not write is refused. Only the
training split is capped by default; the other splits are linked to the source (``DST/val -> SRC/val``), so
validation and evaluation read the original images.
"""
from __future__ import annotations

import io
import json
import os
import re
import stat
import tarfile
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

from PIL import Image

from quest.data.entries import class_folders
from quest.data.folder import CorruptImageError
from quest.data.shard_index import IMAGE_EXTS, ShardError, load_info, require_complete
from quest.data.shard_preflight import check_shard_split
from quest.runtime.workers import worker_pool
from quest.store.files import atomic_write
from quest.store.manifest import MANIFEST_NAME, Manifest, file_stamp, remove_unrecorded
from quest.store.output_folder import OutputFolder, holding
from quest.store.tool_records import CAP_SHORT_SIDE, CAPPED_INFO, read_capped
from quest.store.tree import REPLACED, make_dirs, make_link, remove_empty_dirs

__all__ = ["cap_image", "cap_folder", "cap_shards"]

RESAMPLE = "PIL bicubic (antialiased)"
TOOL = "quest-data cap"


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
        # PIL names the in-memory buffer by its address: the reason would differ on every run
        raise ValueError(f"not a readable image ({re.sub(r'<_io.BytesIO object at 0x[0-9a-f]+>', 'it', str(exc))})"
                         ) from exc
    return out.getvalue(), True


def _cap_file(job: tuple[str, str], short_side: int, quality: int) -> tuple[str | None, str | None]:
    """Write one capped image (under its own name when kept, as ``<stem>.JPEG`` when re-encoded from another
    format): (its path, None), or (None, the reason the source could not be read). A full disk is not a reason: it
    stops the copy."""
    src, folder = Path(job[0]), Path(job[1])
    try:
        if not stat.S_ISREG(os.stat(src).st_mode):  # a FIFO would block the read forever; a device never ends
            return None, "not a regular file"
        payload, resized = cap_image(src.read_bytes(), short_side, quality)
    except FileNotFoundError:
        return None, "a link that leads nowhere" if src.is_symlink() else "gone while the copy ran"
    except (OSError, ValueError) as exc:
        return None, str(exc)
    out = atomic_write(folder / (_jpeg_name(src) if resized else src.name), lambda f: f.write(payload))
    return str(out), None


def _stamp(path: Path) -> str:
    """The source file's stamp (quest.store.manifest.file_stamp); one that matches no output for a file that cannot
    be looked at (a link that leads nowhere), whose job then says why it is left out."""
    try:
        return file_stamp(path)
    except OSError:
        return "unreadable"


def _run(jobs: Sequence[Any], work: Callable[[Any], Any], workers: int,
         progress: Callable[[Iterable, int], Iterable] | None) -> Iterator[tuple[Any, Any]]:
    """(job, result) in job order, each as soon as it is done, so that the caller records it before the next."""
    if workers > 1 and len(jobs) > 16:
        with worker_pool(workers) as pool:
            results: Iterable = pool.map(work, jobs, chunksize=16)
            yield from zip(jobs, progress(results, len(jobs)) if progress else results)
        return
    for job in (progress(jobs, len(jobs)) if progress else jobs):
        yield job, work(job)


def _jpeg_name(path: Path) -> str:
    # a resized image is a JPEG whatever it was: its name keeps the stem and says so
    return path.name if path.suffix[1:].lower() in ("jpg", "jpeg") else path.stem + ".JPEG"


def cap_folder(src: Path, dst: Path, short_side: int, quality: int = 90, splits: Sequence[str] = ("train",),
               workers: int = 1, progress: Callable[[Iterable, int], Iterable] | None = None) -> dict[str, Any]:
    """An image folder ``src/<split>/<class>/<image>``: the ``splits`` capped into ``dst``, every other split folder
    linked. Run again, it follows the source (module docstring). Returns the record written to
    ``dst/_capped.json`` and, under ``this_run``, how many outputs this run kept, wrote and removed."""
    from quest.data.preflight import folder_files

    given, src, dst = Path(src), Path(src).expanduser().resolve(), Path(dst).expanduser()
    _check(src, dst, short_side, quality, given)
    folders = sorted(p.name for p in src.iterdir() if p.is_dir() and not p.name.startswith("."))
    missing = [s for s in splits if s not in folders]
    if missing:
        raise FileNotFoundError(f"{src} has no split folder {missing[0]!r} (its folders: {folders})")
    splits = sorted(set(splits))
    files = {split: [f for f in folder_files(src / split) if f.suffix[1:].lower() in IMAGE_EXTS] for split in splits}
    for split, found in files.items():
        seen: dict[tuple[Path, str], Path] = {}
        for f in found:
            other = seen.setdefault((f.parent, Path(_jpeg_name(f)).stem.lower()), f)
            if other is not f:
                raise ValueError(f"{other} and {f} share a name stem; the capped copy would write both to one JPEG: "
                                 "rename one of them")
    stamps = {str(f.relative_to(src)): _stamp(f) for found in files.values() for f in found}
    counts: dict[str, Any] = {}
    with holding(dst, TOOL) as folder, _manifest(folder, short_side, quality, splits) as manifest:
        folder.claim()
        manifest.begin()
        _record(manifest, src, short_side, quality)
        linked = _link(dst, {s: src / s for s in folders if s not in splits}, manifest)
        manifest.drop_stale(stamps)
        for split in splits:
            _mirror_classes(src / split, dst / split, manifest)
        todo = [(str(src / key), str(dst / Path(key).parent)) for key, stamp in stamps.items()
                if manifest.current(key, stamp) is None]
        problems: dict[str, str] = {}
        for job, (out, reason) in _run(todo, partial(_cap_file, short_side=short_side, quality=quality), workers,
                                       progress):
            key = str(Path(job[0]).relative_to(src))
            if out is not None:
                manifest.record(key, str(Path(out).relative_to(dst)), stamps[key])
            else:
                problems[job[0]] = reason
        for split in splits:
            unreadable = {p: r for p, r in problems.items() if Path(p).relative_to(src).parts[0] == split}
            counts[split] = {"images": len(files[split]) - len(unreadable), "unreadable": unreadable}
        manifest.close()
        capped = _record(manifest, src, short_side, quality, {"layout": "image folder", "splits": counts,
                                                              "linked": linked})
    return {**capped, "this_run": manifest.report(kept=len(stamps) - len(todo))}  # not in the file: a fresh copy's


def _mirror_classes(src_split: Path, dst_split: Path, manifest: Manifest) -> None:
    """``dst_split`` holds a folder for every class folder of the source, also one whose images are all unreadable
    (ImageFolder numbers classes by their folders), and nothing the manifest does not list."""
    classes = [p.name for p in class_folders(src_split)]  # the data set's classes (quest.data.entries)
    make_dirs(dst_split)
    for path in dst_split.iterdir():
        if path.is_dir() and not path.is_symlink() and path.name not in classes:
            # a class the source no longer has: its outputs left the manifest with their sources; anything else in it
            # is kept in .replaced/, and the emptied folders go
            remove_unrecorded(path, set(), manifest)
            remove_empty_dirs(path, keep_top=False)
    for name in classes:
        make_dirs(dst_split / name)
        remove_unrecorded(dst_split / name, set(), manifest)
        remove_empty_dirs(dst_split / name, keep_top=True)  # sub-folders the source no longer has


def _link(dst: Path, targets: dict[str, Path], manifest: Manifest) -> list[str]:
    """``dst/<name>`` a link to each target, and no other link at the top of ``dst`` (one that leads elsewhere is
    kept in .replaced/: a link the manifest does not record); the names linked."""
    manifest.keep_aside([path for path in dst.iterdir() if path.is_symlink() and (
        path.name not in targets or path.resolve() != targets[path.name].resolve())])
    for name, target in targets.items():
        link = dst / name
        if not link.is_symlink():
            make_link(link, target)
    return sorted(targets)


def _cap_shard(job: tuple[str, str], short_side: int, quality: int) -> str | None:
    """Write one capped shard: None, or why it could not be, naming the shard and the member (a full disk is not a
    reason: it stops the copy)."""
    src, dst = Path(job[0]), Path(job[1])
    at = "its first member"  # where reading stopped, for the reason: the member being capped

    def write(f) -> None:
        nonlocal at
        with tarfile.open(src) as tar_in, tarfile.open(fileobj=f, mode="w") as tar_out:
            for member in tar_in:
                at = f"member {member.name}"
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
    except (ValueError, tarfile.TarError, EOFError) as exc:
        # an image member that does not decode (cap_image), or a shard changed since _check_shards read its headers
        return f"{src}: {at}: {exc}"
    return None


def cap_shards(src: Path, dst: Path, short_side: int, quality: int = 90, splits: Sequence[str] = ("train",),
               workers: int = 1, progress: Callable[[Iterable, int], Iterable] | None = None) -> dict[str, Any]:
    """A directory of WebDataset shards with an ``_info.json`` (quest.tools.make_shards): the shards of ``splits``
    capped into ``dst`` under the same names, the other splits' shards linked, the ``_info.json`` copied (the sample
    counts stay). Run again, it follows the source (module docstring)."""
    given, src, dst = Path(src), Path(src).expanduser().resolve(), Path(dst).expanduser()
    _check(src, dst, short_side, quality, given)
    info, info_path = load_info(src)
    if info_path is None:
        raise FileNotFoundError(f"{src} has no _info.json; index the shards first (python -m quest.tools.make_shards "
                                "index)")
    require_complete(info, info_path)
    known = info.get("splits", {})
    missing = [s for s in splits if s not in known]
    if missing:
        raise FileNotFoundError(f"{info_path} has no split {missing[0]!r} (its splits: {sorted(known)})")
    splits = sorted(set(splits))
    names = sorted({n for s in splits for n in known[s].get("filenames", [])})
    # the shards of every split, those linked as they are too: a link to a missing one would leave the copy, marked
    # complete, failing quest-data check
    gone = sorted({n for s in known for n in known[s].get("filenames", []) if not (src / n).is_file()})
    if gone:
        raise FileNotFoundError(f"{info_path} lists shards that do not exist: {', '.join(gone[:5])}")
    _check_shards(src, info, splits, workers)
    stamps = {n: file_stamp(src / n) for n in names}
    links = {n: src / n for s in known if s not in splits for n in known[s].get("filenames", [])}
    with holding(dst, TOOL) as folder, _manifest(folder, short_side, quality, splits) as manifest:
        folder.claim()
        manifest.begin()
        _record(manifest, src, short_side, quality)
        _link(dst, links, manifest)
        manifest.drop_stale(stamps)
        remove_unrecorded(dst, {CAPPED_INFO, info_path.name, *links}, manifest)
        todo = [(str(src / n), str(dst / n)) for n in names if manifest.current(n, stamps[n]) is None]
        problems = []
        for job, reason in _run(todo, partial(_cap_shard, short_side=short_side, quality=quality), workers, progress):
            if reason is None:
                name = str(Path(job[1]).relative_to(dst))
                manifest.record(name, name, stamps[name])
            else:
                problems.append(reason)
        manifest.close()
        if problems:  # found by decoding, which is the copy's work: the shards capped are kept for the rerun
            raise CorruptImageError(f"{len(problems)} shard(s) could not be capped: " + "; ".join(problems[:5])
                                    + (" ..." if len(problems) > 5 else "") + "; expected image members Pillow "
                                    f"decodes; {dst} stays marked incomplete: fix or rewrite these shards and run the "
                                    "same command again, which redoes only them")
        manifest.replace(dst / info_path.name, info_path.read_text())
        capped = _record(manifest, src, short_side, quality, {"layout": "shards", "splits": {s: {"shards": len(
            known[s].get("filenames", []))} for s in splits}, "linked": [s for s in known if s not in splits]})
    return {**capped, "this_run": manifest.report(kept=len(names) - len(todo))}


def _check_shards(src: Path, info: dict[str, Any], splits: Sequence[str], workers: int) -> None:
    """Every shard to cap read header by header as a training run's pre-flight reads it (quest.data.shard_preflight:
    a cut-short or damaged shard, a member that is not a regular file, a bad label, a count that differs from
    _info.json), before the copy is begun: each problem names the shard and the member, and the copy, which keeps
    _info.json, would be refused by every reader for the same reason."""
    num_classes = info.get("num_classes") or (len(info["classes"]) if info.get("classes") else None)
    problems = [p for split in splits for p in check_shard_split(src, split, num_classes, workers).problems]
    if problems:
        raise ShardError(f"{len(problems)} problem(s) in the shards to cap, found before anything was written: "
                         + "; ".join(map(str, problems[:5]))
                         + (" ..." if len(problems) > 5 else "") + f"; expected shards a run reads (quest-data check "
                         f"{src} lists every problem; python -m quest.tools.make_shards writes such shards)")


def _check(src: Path, dst: Path, short_side: int, quality: int, given: Path) -> None:
    """``src`` resolved from ``given``, the path as the user wrote it, which a refusal names (with where its links
    lead, when they lead elsewhere: a link to a disk that is not mounted)."""
    if not src.is_dir():
        through = f" (it leads to {src})" if given.expanduser().absolute() != src else ""
        raise FileNotFoundError(f"{given}{through} is not a directory; expected an image folder or a directory of "
                                "shards")
    low, high = CAP_SHORT_SIDE
    if not low <= short_side <= high:
        raise ValueError(f"--short-side must be in {low}..{high} pixels, got {short_side}")
    if not 1 <= quality <= 100:
        raise ValueError(f"--quality must be in 1..100, got {quality}")
    if dst.resolve() == src or src in dst.resolve().parents:
        raise ValueError(f"the capped copy {dst} must not lie inside its source {src}")
    old = read_capped(dst, complete_only=False)
    if old is not None and (old["short_side"], old["quality"]) != (short_side, quality):
        raise ValueError(f"{dst} holds a copy capped at short side {old['short_side']}, quality {old['quality']}; "
                         "a different cap needs another folder")


def _manifest(folder: OutputFolder, short_side: int, quality: int, splits: Sequence[str]) -> Manifest:
    """The copy's manifest, once the folder is held (the caller) and checked: a copy goes into a new or empty folder,
    or one an earlier run of this tool with these settings wrote (the rerun removes what the source no longer makes,
    which must never be somebody else's files)."""
    existed = folder.manifest.resume({"short_side": short_side, "quality": quality, "splits": list(splits)})
    _refuse_foreign(folder.path, existed)
    _refuse_inner_links(folder.path)
    return folder.manifest


def _refuse_foreign(dst: Path, existed: bool) -> None:
    if not dst.is_dir() or existed or (dst / CAPPED_INFO).exists():
        return
    found = sorted(p.name for p in dst.iterdir() if p.name not in (OutputFolder.lock_name, MANIFEST_NAME))
    if found:
        raise ValueError(f"{dst} already holds files quest-data cap did not write ({', '.join(found[:5])}"
                         f"{' ...' if len(found) > 5 else ''}); give a new or empty folder for the copy")


def _refuse_inner_links(dst: Path) -> None:
    """The copy's folders are its own: a link to a folder below its top (``dst/train/cat`` -> elsewhere) would let
    the rerun write, and set aside, files outside ``dst``. The split links at its top are the tool's (``_link``)."""
    if not dst.is_dir():
        return
    found = []
    for top, dirs, _ in os.walk(dst):  # links are listed, never followed
        if Path(top) == dst:
            dirs[:] = [d for d in dirs if d != REPLACED]
            continue
        found += [Path(top, d) for d in dirs if Path(top, d).is_symlink()]
    if found:
        raise ValueError(f"{dst} holds links to folders elsewhere ({', '.join(map(str, found[:5]))}"
                         f"{' ...' if len(found) > 5 else ''}); quest-data cap writes and removes files only inside "
                         f"{dst}: make each a real folder, or give another folder for the copy")


def _record(manifest: Manifest, src: Path, short_side: int, quality: int, extra: dict[str, Any] | None = None
            ) -> dict[str, Any]:
    """Write _capped.json: without ``extra`` (before any output changes) it says the copy is incomplete, and runs and
    checks refuse it; with ``extra`` (the last write) complete. Returns what it wrote."""
    record = {"complete": extra is not None, "short_side": short_side, "quality": quality, "resample": RESAMPLE,
              "source": str(src), **(extra or {})}
    manifest.replace(manifest.folder / CAPPED_INFO, json.dumps(record, indent=1) + "\n")
    return record
