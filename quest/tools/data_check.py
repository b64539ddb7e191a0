"""``quest-data check ROOT`` (``python -m quest.tools.data_check ROOT``): the data pre-flight on its own (docs/data.md).

ROOT is an image folder (its ``train/`` and ``val/`` splits, or one split folder of ``<class>/<image>``) or a
directory of WebDataset shards (an ``_info.json``, or ``*.tar`` files): every image is decoded, or every shard
header and label read, with a progress bar; what was found is printed per reason. Exit status 0 when every file
is usable, 1 when there are problems, 2 when ROOT is not a data set.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Sequence, TextIO

from quest.data.entries import LayoutError
from quest.data.folder import CorruptImageError
from quest.data.preflight import Problem, Report, check_image_folder_files, folder_files
from quest.data.shard_index import info_lengths, load_info, require_complete
from quest.data.shard_preflight import check_shard_split
from quest.runtime.errors import input_error, parse_arguments, program_name
from quest.runtime.phase import begin_changes
from quest.runtime.workers import process_count_problem
from quest.store.output_folder import input_path, output_path
from quest.store.tool_records import read_capped

__all__ = ["check_root", "main", "reason_kind"]

FOLDER_SPLITS = ("train", "val")


_KINDS = (("holds ", "sample count differs from _info.json"), ("label ", "bad label"), ("cut short", "cut short"),
          ("split ", "_info.json inconsistent"), ("member ", "a member that is not a regular file"))


def reason_kind(reason: str) -> str:
    """The kind of a problem, without what is particular to one file: "undecodable (broken data stream ...)" ->
    "undecodable", "label 7 is outside the classes 0..2 ..." -> "bad label"."""
    for start, kind in _KINDS:
        if reason.startswith(start):
            return kind
    return reason.split(" (")[0].split(";")[0]


def _progress_bar(desc: str, stream: TextIO) -> Callable[[Iterable, int], Iterable]:
    def wrap(items: Iterable, total: int) -> Iterable:
        try:
            from tqdm import tqdm
        except ImportError:  # a counter line instead
            return _counter(items, total, desc, stream)
        return tqdm(items, total=total, desc=desc, file=stream, unit="file", mininterval=0.5)
    return wrap


def _counter(items: Iterable, total: int, desc: str, stream: TextIO) -> Iterable:
    for i, item in enumerate(items, 1):
        if i == total or i % 1000 == 0:
            print(f"\r{desc}: {i}/{total}", end="\n" if i == total else "", file=stream, flush=True)
        yield item


def _is_shard_dir(root: Path) -> bool:
    return load_info(root)[1] is not None or any(root.glob("*.tar"))


def _shard_reports(root: Path, workers: int | None, progress) -> list[tuple[str, Report]]:
    info, info_path = load_info(root)
    splits = sorted((info.get("splits") or {}))
    num_classes = info.get("num_classes") or (len(info["classes"]) if info.get("classes") else None)
    out = [(f"shards {s}", check_shard_split(root, s, num_classes, workers, progress(f"shards {s}")))
           for s in splits]
    listed = set(info_lengths(info)) | {f for s in splits for f in info["splits"][s].get("filenames", [])}
    unlisted = sorted(str(p.relative_to(root)) for p in root.glob("*.tar") if str(p.relative_to(root)) not in listed)
    if unlisted and info_path is None:  # no _info.json: every tar, counted, labels unchecked against a class count
        out.append(("shards *.tar", check_shard_split(root, "*.tar", None, workers, progress("shards *.tar"))))
    elif unlisted:
        out.append(("unlisted", Report(str(root), 0, [Problem(str(root / n), f"a tar file no split of {info_path.name}"
                                                              " lists") for n in unlisted])))
    return out


def check_root(root: str | Path, workers: int | None = None, use_cache: bool = True, progress: bool = True,
               out: TextIO | None = None, err: TextIO | None = None, limit: int = 50) -> int:
    """Run the pre-flight on ``root``, print what it found per reason to ``out`` (the progress bar to ``err``) and
    return the exit status: 0 clean, 1 problems, 2 not a data set."""
    out, err = out or sys.stdout, err or sys.stderr  # looked up now: a caller may have redirected them
    root = Path(root).expanduser()
    if not root.is_dir():
        print(f"quest-data check: error: {root} does not exist or is not a directory", file=err)
        return 2
    bar = (lambda desc: _progress_bar(desc, err)) if progress else (lambda desc: None)
    try:  # a copy or conversion a data tool has not finished is never reported clean
        read_capped(root)
        require_complete(*load_info(root))
    except ValueError as exc:
        print(f"{root}: {exc}", file=out)
        return 1
    begin_changes()  # the pre-flight is this command's work; its cache (quest.data.preflight) is its one write
    if _is_shard_dir(root):
        reports = _shard_reports(root, workers, bar)
        unit = "samples (headers and labels read, images not decoded):"
    else:
        splits = [s for s in FOLDER_SPLITS if (root / s).is_dir()]
        folders = [(s, root / s) for s in splits] or [(root.name, root)]
        try:  # every split's layout (the top level first: bounded work) and listing before the first decode
            listed = [(s, folder, folder_files(folder)) for s, folder in folders]
        except LayoutError as exc:
            print(f"quest-data check: error: {root} is neither an image folder (<split>/<class>/<image> or "
                  f"<class>/<image>) nor a shard directory (_info.json or *.tar): {exc}", file=err)
            return 2
        reports = [(s, check_image_folder_files(folder, workers, use_cache, bar(s), files=files))
                   for s, folder, files in listed]
        unit = "usable images,"
    problems = 0
    for name, report in reports:
        problems += len(report.problems)
        cached = " (cached result)" if report.cached else ""
        print(f"{name}: {report.images} {unit} {len(report.problems)} problem(s){cached}", file=out)
        for kind, n in sorted(Counter(reason_kind(p.reason) for p in report.problems).items()):
            print(f"  {n:>8}  {kind}", file=out)
        if report.problems:
            print(report.describe(limit), file=out)
    print(f"{root}: {'clean' if not problems else f'{problems} problem(s)'}", file=out)
    return 1 if problems else 0


def _workers(text: str) -> int:
    """--workers: a process count a machine can hold (a pool forks all of them at once: a typo would fork until
    memory ran out). One range in every message: -3 and 0 are refused alike."""
    n = _whole(text)
    problem = process_count_problem(n, 1)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"must be {problem}, got {n}")
    return n


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None


def _count(text: str) -> int:
    n = _whole(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {n}")
    return n


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="quest-data", description="Data set tools (docs/data.md).")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="run the data pre-flight on an image folder or a shard directory",
                           description="Decode every image of an image folder, or read every header of a shard "
                           "directory, as a training run's pre-flight does, and list the problems (exit 1 when any).")
    check.add_argument("root", type=input_path, help="an image folder (<root>/<split>/<class>/<image>) or a folder "
                       "of shards with their _info.json")
    check.add_argument("--workers", type=_workers, default=None, help="worker processes (default: CPUs, at most 8)")
    check.add_argument("--no-cache", action="store_true", help="check again even if the cached result matches")
    check.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    check.add_argument("--limit", type=_count, default=50, help="problems listed per split (all are counted)")
    cap = sub.add_parser("cap", help="copy an image folder or shard directory with every image's short side capped "
                         "(faster decoding; it changes the data: docs/data.md)",
                         description="Copy an image folder or a shard directory with every image's short side capped, "
                         "the other splits linked; run again, it redoes only what changed in the source.")
    cap.add_argument("src", type=input_path, help="the image folder or shard directory to copy")
    cap.add_argument("dst", type=output_path, help="the folder the capped copy goes into")
    cap.add_argument("--short-side", type=int, required=True, help="the largest short side kept, e.g. 256")
    cap.add_argument("--quality", type=int, default=90, help="JPEG quality of the resized images (default 90)")
    cap.add_argument("--split", action="append", help="a split to cap (default: train); the others are linked")
    cap.add_argument("--workers", type=_workers, default=None, help="worker processes (default: CPUs, at most 8)")
    cap.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    args = parse_arguments(parser, argv)
    if args.command == "cap":
        return cap_root(args)
    return check_root(args.root, args.workers, not args.no_cache, not args.no_progress, limit=args.limit)


def cap_root(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """``quest-data cap``: exit 0 when every image was capped or copied, 1 when some could not be read, 2 when the
    command cannot run (the message says why)."""
    import os

    out = out or sys.stdout
    from .capped import cap_folder, cap_shards

    progress = None if args.no_progress else _progress_bar(f"cap {args.src}", sys.stderr)
    kwargs = dict(short_side=args.short_side, quality=args.quality, splits=args.split or ["train"],
                  workers=args.workers or min(8, os.cpu_count() or 1), progress=progress)
    try:
        manifest = (cap_shards if _is_shard_dir(args.src) else cap_folder)(args.src, args.dst, **kwargs)
    except (FileNotFoundError, ValueError) as exc:
        return input_error(program_name("quest-data") + " cap", exc)
    except CorruptImageError as exc:  # shards whose image members did not decode, each named: some could not be read
        input_error(program_name("quest-data") + " cap", exc)
        return 1
    unreadable = 0
    for split, counts in manifest["splits"].items():
        problems = counts.get("unreadable", {})
        unreadable += len(problems)
        done = f"{counts['images']} images" if "images" in counts else f"{counts['shards']} shards"
        print(f"{split}: {done} capped at short side {args.short_side}" +
              (f", {len(problems)} unreadable (left out):" if problems else ""), file=out)
        for path, reason in list(problems.items())[:20]:
            print(f"  {Problem(path, reason)}", file=out)
    run = manifest["this_run"]
    moved = f"; {run['moved']} moved to .replaced/ (not what this tool wrote)" if run.get("moved") else ""
    print(f"this run: {run['written']} written, {run['removed']} removed, {run['kept']} kept from an earlier run "
          f"(unchanged source){moved}", file=out)
    for split in manifest["linked"]:
        print(f"{split}: linked to {args.src / split if manifest['layout'] == 'image folder' else args.src}", file=out)
    print(f"{args.dst}: {'complete' if not unreadable else f'complete but for {unreadable} unreadable image(s)'}",
          file=out)
    return 1 if unreadable else 0


if __name__ == "__main__":  # quest's one error path (quest/runtime/errors.py), as the quest-data console script
    from quest.runtime.errors import program_name, reporting_errors

    with reporting_errors(program_name("quest-data")):
        code = main()
    sys.exit(code)
