"""Write tar shards for ``data=imagenet_wds`` from an image folder (``convert``), or count shards written elsewhere
into their _info.json (``index``); docs/distributed.md, "Sharded input".

    python -m quest.tools.make_shards convert /datasets/imagenet /datasets/imagenet-wds --name imagenet1k
    python -m quest.tools.make_shards index /datasets/x train='x-train-{000..127}.tar' validation='x-val-*.tar'

``convert``: an ImageFolder to shuffled shards and their _info.json, every image decoded first (``--bad-images``:
docs/data.md, "Unreadable images when converting to shards"; run again, it redoes exactly the shards whose files
changed: docs/data.md, "Running a data tool again"); ``index``: count existing shards into one.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import re
import tarfile
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator, Sequence

import numpy as np

from quest.data.config import BAD_IMAGES
from quest.data.entries import class_listing
from quest.data.folder import CorruptImageError, check_image_folder
from quest.data.preflight import check_image_folder_files, left_out_record
from quest.data.shard_index import IMAGE_EXTS, INFO_NAMES, SHARD_PATTERN, expand_braces, load_info, resolve_shards
from quest.evaluation.progress import Progress
from quest.runtime.errors import doc_summary, parse_arguments
from quest.store.files import atomic_write, write_text_atomic
from quest.store.manifest import Manifest, file_stamp, is_partial_write
from quest.store.output_folder import holding, input_path, output_path
from quest.store.records import path_problem
from quest.store.tool_records import check_info

log = logging.getLogger(__name__)

__all__ = ["convert_image_folder", "write_index", "main"]

TOOL = "make_shards convert"
FORMAT = "tar: <key>.<ext> then <key>.cls, mode 0o444, mtime 0"  # in every shard's stamp: a new layout redoes all


def _add(tar: tarfile.TarFile, name: str, payload: bytes) -> None:
    member = tarfile.TarInfo(name)
    member.size, member.mode, member.mtime = len(payload), 0o444, 0  # the same bytes on every conversion
    tar.addfile(member, io.BytesIO(payload))


def _write_shard(part: Sequence[tuple[Path, int]], root: Path, f: BinaryIO) -> None:
    """One shard's tar into ``f`` (written whole by atomic_write: a killed conversion leaves no cut-short shard)."""
    with tarfile.open(fileobj=f, mode="w") as tar:
        for path, target in part:
            rel = path.relative_to(root).with_suffix("")
            key = "/".join(x.replace(".", "_") for x in rel.parts)  # the key ends at the first dot
            ext = path.suffix[1:].lower().replace("jpeg", "jpg")
            _add(tar, f"{key}.{ext}", path.read_bytes())
            _add(tar, f"{key}.cls", str(target).encode())


def _merge_info(manifest: Manifest, splits: dict[str, dict[str, Any]], extra: dict[str, Any]) -> Path:
    """The folder's _info.json with ``splits`` and ``extra`` merged in (its other splits kept), noted in the
    manifest; one changed since this tool wrote it is kept aside first (:meth:`Manifest.replace`)."""
    out = manifest.folder
    info, path = load_info(out)
    info.setdefault("splits", {}).update(splits)
    info.update(extra)
    path = path or out / INFO_NAMES[0]
    check_info(info, out, path)  # never a record its reader (load_info) would refuse
    return manifest.replace(path, json.dumps(info, indent=1) + "\n")


def _few(names: Sequence[Any]) -> str:
    return ", ".join(map(str, names[:5])) + (f" ... ({len(names)} in all)" if len(names) > 5 else "")


def _is_name(value: str, split: bool = False) -> bool:
    """A part of a shard's file name: a shard is a file of the output folder, and a name with a ``/`` or ``..``
    would be written elsewhere (a leading dot: a name a cut write's temporary could have). A ``split`` is also a key
    of _info.json that data.train_split must be able to name: the reader takes a name with ``{*?[`` or a ``.tar``
    end for a shard pattern (quest.data.shard_index.split_files), so such a split could never be read by name."""
    plain = bool(value) and "/" not in value and "\0" not in value and not value.startswith(".")
    return plain and not (split and SHARD_PATTERN.search(value))


SPLIT_RULE = "no '/', not empty, not starting with '.', no '{', '*', '?' or '[', not ending in .tar"


def _plain_name(flag: str, value: str) -> None:
    if flag == "--split" and not _is_name(value, split=True):
        raise ValueError(f"{flag} {value!r}: expected a plain name for the shard files' names and a split name "
                         f"data.train_split can name ({SPLIT_RULE}), e.g. train or validation")
    if not _is_name(value):
        raise ValueError(f"{flag} {value!r}: expected a plain name for the shard files' names (no '/', not empty, "
                         "not starting with '.'), e.g. imagenet1k or train")


def _split_folder(src: Path, folder: str) -> None:
    """A split folder is read from inside the source: one outside it could hold the output folder, whose shards would
    then become part of the data set (only the source itself is checked against the output)."""
    if folder == "" or path_problem(folder, "") is not None:
        raise ValueError(f"--split {folder!r}: expected FOLDER[:NAME] with FOLDER a folder of the source {src}, "
                         "relative to it and inside it (not empty, no leading '/', no '..'), e.g. train or "
                         "val:validation")


def _split_option(text: str) -> tuple[str, str]:
    """``--split FOLDER[:NAME]`` -> (folder, name); NAME defaults to FOLDER. An empty side of the ':' is refused:
    ``:x`` would convert the source folder itself, ``train:`` name a split ``train:``."""
    folder, colon, name = text.partition(":")
    if not folder or (colon and not name):
        raise ValueError(f"--split {text!r}: the {'FOLDER before' if not folder else 'NAME after'} ':' is empty; "
                         "expected FOLDER[:NAME], a split folder of the source and optionally its split name in "
                         "_info.json, e.g. train or val:validation")
    return folder, name if colon else folder


def convert_image_folder(src: Path, out: Path, splits: Sequence[tuple[str, str]], name: str = "shards",
                         shard_size: int = 1000, seed: int = 0, bad_images: str = "error") -> Path:
    """ImageFolder ``src/<folder>/<class>/<image>`` -> ``out/<name>-<split>-NNNN.tar`` + ``_info.json``. Samples
    are shuffled (``seed``) before sharding so that every shard mixes the classes: reading shuffles only the shard
    order and windows of consecutive samples. Class index = sorted class-folder order, as ImageFolder.

    Every image is decoded before the first shard is written (:func:`_usable`); one that does not decode refuses
    the conversion (``bad_images="error"``) or is left out and recorded in its split's ``left_out`` (``"skip"``).

    Run again, it follows the source: a shard is kept when the files it is made of (names, sizes, modification
    times, labels) and the settings are unchanged, written again otherwise, and shards of these splits that the
    conversion no longer makes are removed (quest.store.manifest). ``_info.json`` says ``complete: false`` from the
    first shard written to the last, and readers refuse the folder meanwhile."""
    if shard_size < 1:
        raise ValueError(f"--shard-size must be at least 1, got {shard_size}")
    if seed < 0:  # numpy's own refusal names no flag
        raise ValueError(f"--seed must be 0 or more, got {seed}")
    if bad_images not in BAD_IMAGES:
        raise ValueError(f"--bad-images must be one of {', '.join(BAD_IMAGES)} (data.bad_images' values), got "
                         f"{bad_images!r}")
    for folder, _ in splits:  # the folder first: in --split ../x/train it is the folder that is wrong, not the name
        _split_folder(src, folder)
    for flag, value in [("--name", name), *(("--split", split) for _, split in splits)]:
        _plain_name(flag, value)
    names = [split for _, split in splits]
    twice = sorted({split for split in names if names.count(split) > 1})
    if twice:  # two folders under one name would write the same shard files, the first split lost
        raise ValueError(f"--split: the split name {twice[0]!r} is given twice; expected FOLDER[:NAME] with a "
                         "NAME of its own for each folder, e.g. --split train --split val:validation")
    real_src, real_out = Path(src).expanduser().resolve(), Path(out).expanduser().resolve()
    if real_out == real_src or real_src in real_out.parents:  # its shards would become part of the data set
        raise ValueError(f"the shard folder {out} must not lie inside its source {src}; give a folder outside it")
    ours = re.compile("|".join(rf"{re.escape(name)}-{re.escape(split)}-\d+\.tar" for _, split in splits))
    out = Path(out)
    with holding(out, TOOL) as folder, folder.manifest as manifest:  # held: a second conversion is refused
        # every image decoded while the folder is held (a refusal still changes nothing: the lock goes with it), so
        # that a second conversion into it is refused at once rather than after decoding a whole data set
        planned, lengths, classes, left_out = _plan(src, splits, name, shard_size, seed, bad_images)
        existed = manifest.resume({})
        mine = set(manifest.sources().values())
        taken = [n for n in [*planned, *INFO_NAMES] if (out / n).exists() and n not in mine]
        if taken and not existed:
            raise ValueError(f"{out} already holds {', '.join(taken[:3])}{' ...' if len(taken) > 3 else ''}, which "
                             "make_shards did not record writing; give another folder or --name")
        info, _ = load_info(out)  # an _info.json that cannot be read is refused before anything changes
        kept = sorted(set(info.get("splits") or {}) - {split for _, split in splits})
        if kept and info.get("classes") not in (None, classes):  # a label means one class in every split
            raise ValueError(f"{out} holds the split(s) {', '.join(kept)} of another class list ({_few(info['classes'])}"
                             f"; this source's: {_few(classes)}); give another folder, or convert those splits from "
                             "this source too (--split)")
        folder.claim()
        manifest.begin()
        _merge_info(manifest, {}, {"complete": False})  # before the first shard changes
        # what became of each recorded shard, judged before drop_stale acts (its count says only "dropped"): a file
        # somebody deleted was not removed by this run, and one somebody changed is kept in .replaced/, not removed
        # ... under this --name, or under another one that the folder's _info.json lists for these splits (a rerun
        # with a new --name makes them anew: the old-name shards are stale, not a split of their own)
        listed = {f for _, split in splits for f in (info.get("splits") or {}).get(split, {}).get("filenames", ())}
        recorded = {s: n for s, n in manifest.sources().items() if ours.fullmatch(s) or n in listed}
        missing = {n for n in recorded.values() if not os.path.lexists(out / n)}
        changed = {n for n in recorded.values() if n not in missing and not manifest.owns(manifest.folder / n)}
        dropped = manifest.drop_stale({n: stamp for n, (_, stamp) in planned.items()}, sources=set(recorded))
        # shards of these splits the manifest does not list (a kill came before their line, or somebody else's) and
        # partial writes: kept in .replaced/, never deleted
        mine = set(manifest.sources().values())
        unrecorded = [path for path in out.iterdir() if path.is_file() and (
            ours.fullmatch(path.name) and path.name not in mine
            or is_partial_write(path.name) and ours.fullmatch(path.name[1:].rsplit(".", 2)[0]))]
        manifest.keep_aside(unrecorded)
        gone = {recorded[s] for s in dropped}
        summary = _summary(len(gone - missing - changed), len(gone & changed) + len(unrecorded), len(gone & missing))
        # an ImageNet conversion writes about 1,300 shards for many minutes: a line at the first, the last and every
        # 10 s between (a rerun's kept shards count as done at once, so its first ETA is low)
        progress = Progress(f"{TOOL} {out}", len(planned), unit="shard", every_s=10.0, logger=log)
        for shard, (write, stamp) in planned.items():
            if manifest.current(shard, stamp) is None:
                atomic_write(out / shard, write)
                manifest.record(shard, shard, stamp)
            progress.update(extra=lambda: f"{manifest.written} written")
        written = {split: {"name": split, "num_samples": sum(n for _, n in shards),
                           "shard_lengths": [n for _, n in shards], "filenames": [f for f, _ in shards],
                           **({"left_out": left_out[split]} if split in left_out else {})}
                   for split, shards in lengths.items()}
        for split, entry in written.items():
            log.info("%s: %d samples in %d shards", split, entry["num_samples"], len(entry["filenames"]))
        log.info("this run: %d shards written, %s, %d kept from an earlier run (unchanged files)",
                 manifest.written, summary, len(planned) - manifest.written)
        return _merge_info(manifest, written, {"classes": classes, "num_classes": len(classes), "complete": True})


def _summary(removed: int, aside: int, missing: int) -> str:
    """The summary line's middle: shards this run deleted (its own, unchanged since written, that the conversion no
    longer makes or makes anew), kept in .replaced/ (changed since, or not on record) and found missing (deleted by
    somebody since: nothing to remove); the last two only when there were any."""
    return ", ".join([f"{removed} removed", *([f"{aside} moved to .replaced/ (changed since written or not on "
                                              "record)"] if aside else []),
                      *([f"{missing} found missing (deleted since written)"] if missing else [])])


def _plan(src: Path, splits: Sequence[tuple[str, str]], name: str, shard_size: int, seed: int, bad_images: str
          ) -> tuple[dict[str, tuple[Callable[[BinaryIO], None], str]], dict[str, list[tuple[str, int]]], list[str],
                     dict[str, dict[str, Any]]]:
    """Every shard of the conversion, before anything is written: its name -> (its writer, the stamp of what it is
    made of); each split's shards (name, sample count); the classes; each split's record of the images left out."""
    classes: list[str] | None = None
    planned: dict[str, tuple[Callable[[BinaryIO], None], str]] = {}
    lengths: dict[str, list[tuple[str, int]]] = {}
    left_out: dict[str, dict[str, Any]] = {}
    for folder, split in splits:
        root = check_image_folder(src / folder, f"convert {src / folder}")
        log.info("%s: listing %s", split, root)  # a million files take a while on a network disk
        listing = class_listing(root)  # the training data set's classes and files (quest.data.entries)
        found = [class_dir.name for class_dir, _ in listing]
        if classes is not None and found != classes:
            raise ValueError(f"{root} has other class folders than the first split: {sorted(set(found) ^ set(classes))}")
        classes = found
        # every file the data set would read, a dangling link or a FIFO too: the decode below judges each as the
        # pre-flight does, so none is left out unsaid
        items = [(p, i) for i, (_, files) in enumerate(listing) for p in files if p.suffix[1:].lower() in IMAGE_EXTS]
        if not items:
            raise FileNotFoundError(f"{root} holds no images ({', '.join(IMAGE_EXTS)})")
        items, record = _usable(root, split, items, bad_images)  # in listing order: the pre-flight's cache key
        if record is not None:
            left_out[split] = record
        items = [items[i] for i in np.random.default_rng(seed).permutation(len(items))]
        count = -(-len(items) // shard_size)
        log.info("%s: %d images from %s, %d shard(s) of at most %d; reading their sizes and times", split, len(items),
                 root, count, shard_size)
        width = max(4, len(str(count - 1)))
        lengths[split] = []
        for k in range(count):
            part = items[k * shard_size: (k + 1) * shard_size]
            digest = hashlib.sha256(f"{FORMAT}\0{split}\0{folder}\n".encode("utf-8", "surrogateescape"))
            for path, target in part:
                digest.update(f"{path.relative_to(root)}\0{file_stamp(path)}\0{target}\n".encode("utf-8", "surrogateescape"))
            shard = f"{name}-{split}-{k:0{width}d}.tar"
            planned[shard] = (partial(_write_shard, part, root), digest.hexdigest())
            lengths[split].append((shard, len(part)))
    return planned, lengths, classes or [], left_out


def _usable(root: Path, split: str, items: list[tuple[Path, int]], bad_images: str
            ) -> tuple[list[tuple[Path, int]], dict[str, Any] | None]:
    """The images of ``items`` that a reader can use, and the record of those left out (None: none was). Each is
    decoded whole, as the pre-flight does (quest.data.preflight.check_file; cached like it): Pillow's verify() passes
    a truncated JPEG, and a shard holding one would fail only when a run draws it. ``error`` refuses the conversion
    naming the files, before any change; ``skip`` leaves them out, logged and returned for _info.json."""
    log.info("%s: decoding its %d images to check them", split, len(items))
    report = check_image_folder_files(root, files=[path for path, _ in items])
    if not report.problems:
        log.info("%s: all %d images decode%s", split, report.images,
                 " (the pre-flight's cached result: unchanged files)" if report.cached else "")
        return items, None
    named = "; ".join(map(str, report.problems[:5])) + (" ..." if len(report.problems) > 5 else "")
    found = f"{len(report.problems)} of the {len(items)} images of split {split!r} ({root}) are not usable ({named})"
    if bad_images == "error" or report.images == 0:
        fix = ("fix or remove them, or give --bad-images skip to leave them out" if bad_images == "error" else
               "none would be left: fix or remove them")
        raise CorruptImageError(f"{TOOL}: {found}; expected images Pillow decodes whole to 8-bit RGB: {fix}")
    log.warning("%s: %s: left out (--bad-images skip), recorded in _info.json splits.%s.left_out", split, found, split)
    bad, record = report.bad_paths(), left_out_record(report, len(items))
    record["first"] = [os.path.abspath(path) for path in record["first"]]  # _info.json outlives the working folder
    return [(path, target) for path, target in items if str(path) not in bad], record


def write_index(root: Path, splits: dict[str, str]) -> Path:
    """Count the samples of existing shards (``{split: pattern}``) into ``root/_info.json`` (``root`` held meanwhile:
    a conversion or another index into it is refused). Each split's name and pattern are checked first, and the
    record is checked as its reader checks it before anything changes."""
    for split, pattern in splits.items():
        _check_index_split(root, split, pattern)
    with holding(root, "make_shards index") as folder:
        written = _count_splits(root, splits)
        info, existing = load_info(root)
        info.setdefault("splits", {}).update(written)
        path = existing or root / INFO_NAMES[0]
        check_info(info, root, path)  # never a record its reader (load_info, quest-data check) would refuse
        # the splits an _info.json already holds are kept in the new one; the file itself, unless this command
        # wrote it, in .replaced/ too
        folder.make_room([existing] if existing is not None else [], keep_own=True)
        write_text_atomic(path, json.dumps(info, indent=1) + "\n")
        folder.manifest.note([path])
        return path


INDEX_FORM = "SPLIT=PATTERN, e.g. train='x-train-{000..127}.tar' or validation='x-val-*.tar'"


def _index_option(text: str) -> tuple[str, str]:
    """A ``make_shards index`` argument ``SPLIT=PATTERN`` -> (split, pattern), split at the first ``=``."""
    split, equals, pattern = text.partition("=")
    if not equals:
        raise ValueError(f"make_shards index: {text!r} has no '='; expected {INDEX_FORM}")
    return split, pattern


def _check_index_split(root: Path, split: str, pattern: str) -> None:
    """The split's name as convert's (:func:`_is_name`); the pattern one the reader takes for a pattern, naming shards
    inside ``root``: _info.json lists shards by paths relative to its folder, and its reader refuses any outside
    (a brace's every expansion is checked: ``{..,a}/x.tar`` names ``../x.tar``)."""
    given = f"make_shards index {root}: {split}={pattern}"
    if not _is_name(split, split=True):
        raise ValueError(f"{given}: {split!r} cannot name a split; expected {INDEX_FORM}, with a split name such "
                         f"as train or validation ({SPLIT_RULE})")
    if not SHARD_PATTERN.search(pattern):
        raise ValueError(f"{given}: {pattern!r} is not a shard pattern; expected {INDEX_FORM} (a file name ending in "
                         ".tar, a {a..b} range, a {x,y} list or a glob)")
    if any(path_problem(name, "") is not None for name in [pattern, *expand_braces(pattern)]):
        raise ValueError(f"{given}: the pattern names shards outside {root}; expected {INDEX_FORM}, with PATTERN "
                         f"relative to {root} and inside it (no leading '/', no '..'): _info.json lists only the "
                         "shards in its own folder")


def _counted(what: str, shards: list[Path]) -> Iterator[Path]:
    """``shards`` one at a time, each counted into a progress line once its count is done (when the next is asked
    for): the first, the last and one every 10 s between, with an ETA."""
    progress = Progress(what, len(shards), unit="shard", every_s=10.0, logger=log)
    for shard in shards:
        yield shard
        progress.update(extra=shard.name)


def _count_splits(root: Path, splits: dict[str, str]) -> dict[str, dict[str, Any]]:
    written = {}
    for split, pattern in splits.items():
        shards = resolve_shards(root, pattern, count=True,
                                counting=lambda paths, split=split: _counted(f"make_shards index {root} {split}", paths))
        written[split] = {"name": split, "num_samples": sum(s.length for s in shards),
                          "filenames": [str(s.path.relative_to(root)) for s in shards],
                          "shard_lengths": [s.length for s in shards]}
    return written


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m quest.tools.make_shards", description=doc_summary(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="an ImageFolder to tar shards and _info.json",
                          description="Pack an ImageFolder into shuffled tar shards and their _info.json. Every image "
                          "is decoded first (the training pre-flight's check, whose cache .quest-preflight.json goes "
                          "into each split folder, or ~/.cache/quest/preflight/ where that cannot be written); run "
                          "again, it redoes only the shards whose images changed.")
    conv.add_argument("src", type=input_path, help="the ImageFolder root (holding train/ and val/)")
    conv.add_argument("out", type=output_path, help="the folder the shards and _info.json go into")
    conv.add_argument("--split", action="append", metavar="FOLDER[:NAME]",
                      help="a split folder and its name in _info.json (default: train, val:validation)")
    conv.add_argument("--name", default="shards", help="shard file prefix, e.g. imagenet1k (default: shards)")
    conv.add_argument("--shard-size", type=int, default=1000, help="samples a shard (default: 1000)")
    conv.add_argument("--seed", type=int, default=0, help="seed of the shuffle before sharding (default: 0)")
    conv.add_argument("--bad-images", choices=BAD_IMAGES, default="error",
                      help="an image that does not decode: error refuses the conversion naming it (default), skip "
                           "leaves it out, recorded in _info.json (data.bad_images' policy)")
    idx = sub.add_parser("index", help="count existing shards into _info.json",
                         description="Count the samples of shards written elsewhere into ROOT/_info.json, so that "
                         "data=imagenet_wds can read them.")
    idx.add_argument("root", type=output_path, help="the folder holding the shards")
    idx.add_argument("splits", nargs="+", metavar="SPLIT=PATTERN",
                     help="a split name and a shard pattern relative to ROOT, e.g. train='x-train-*.tar'")
    args = parse_arguments(parser, argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "convert":
        pairs = [_split_option(s) for s in args.split or ["train", "val:validation"]]
        print(convert_image_folder(args.src, args.out, pairs, args.name, args.shard_size, args.seed, args.bad_images))
    else:
        pairs = [_index_option(s) for s in args.splits]
        twice = sorted({split for split, _ in pairs if [p[0] for p in pairs].count(split) > 1})
        if twice:  # a dict would keep the last pattern without a word
            raise ValueError(f"make_shards index: the split {twice[0]!r} is given twice; expected {INDEX_FORM}, "
                             "once per split")
        print(write_index(args.root, dict(pairs)))


if __name__ == "__main__":  # quest's one error path (quest/runtime/errors.py): a bad folder or file is one line, exit 1
    from quest.runtime.errors import program_name, reporting_errors

    with reporting_errors(program_name("python -m quest.tools.make_shards")):
        main()
