"""Writing tar shards for ``data=imagenet_wds`` (quest/data/shards.py; docs/distributed.md, "Sharded input"):

    python -m quest.data.make_shards convert /datasets/imagenet /datasets/imagenet-wds --name imagenet1k
    python -m quest.data.make_shards index /datasets/x train='x-train-{000..127}.tar' validation='x-val-*.tar'

``convert``: an ImageFolder to shuffled shards and their _info.json; ``index``: count existing shards into one.
"""
from __future__ import annotations

import argparse
import io
import json
import logging
import tarfile
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import numpy as np

from quest.io import atomic_write, write_text_atomic

from .folder import check_image_folder
from .shard_index import IMAGE_EXTS, INFO_NAMES, load_info, resolve_shards

log = logging.getLogger(__name__)

__all__ = ["convert_image_folder", "write_index", "main"]


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


def _merge_info(out: Path, splits: dict[str, dict[str, Any]], extra: dict[str, Any]) -> Path:
    info, path = load_info(out)
    info.setdefault("splits", {}).update(splits)
    info.update(extra)
    path = path or out / INFO_NAMES[0]
    write_text_atomic(path, json.dumps(info, indent=1) + "\n")
    return path


def convert_image_folder(src: Path, out: Path, splits: Sequence[tuple[str, str]], name: str = "shards",
                         shard_size: int = 1000, seed: int = 0) -> Path:
    """ImageFolder ``src/<folder>/<class>/<image>`` -> ``out/<name>-<split>-NNNN.tar`` + ``_info.json``. Samples
    are shuffled (``seed``) before sharding so that every shard mixes the classes: reading shuffles only the shard
    order and windows of consecutive samples. Class index = sorted class-folder order, as ImageFolder."""
    out.mkdir(parents=True, exist_ok=True)
    classes: list[str] | None = None
    written: dict[str, dict[str, Any]] = {}
    for folder, split in splits:
        root = check_image_folder(src / folder, f"convert {src / folder}")
        found = sorted(p.name for p in root.iterdir() if p.is_dir())
        if classes is not None and found != classes:
            raise ValueError(f"{root} has other class folders than the first split: {sorted(set(found) ^ set(classes))}")
        classes = found
        items = [(p, i) for i, c in enumerate(classes) for p in sorted((root / c).rglob("*"))
                 if p.is_file() and p.suffix[1:].lower() in IMAGE_EXTS]
        if not items:
            raise FileNotFoundError(f"{root} holds no images ({', '.join(IMAGE_EXTS)})")
        items = [items[i] for i in np.random.default_rng(seed).permutation(len(items))]
        count = -(-len(items) // shard_size)
        width = max(4, len(str(count - 1)))
        filenames, lengths = [], []
        for k in range(count):
            part = items[k * shard_size: (k + 1) * shard_size]
            filenames.append(f"{name}-{split}-{k:0{width}d}.tar")
            atomic_write(out / filenames[-1], partial(_write_shard, part, root))
            lengths.append(len(part))
        written[split] = {"name": split, "num_samples": len(items), "filenames": filenames, "shard_lengths": lengths}
        log.info("%s: %d samples in %d shards", split, len(items), count)
    return _merge_info(out, written, {"classes": classes, "num_classes": len(classes or [])})


def write_index(root: Path, splits: dict[str, str]) -> Path:
    """Count the samples of existing shards (``{split: pattern}``) into ``root/_info.json``."""
    written = {}
    for split, pattern in splits.items():
        shards = resolve_shards(root, pattern, count=True)
        written[split] = {"name": split, "num_samples": sum(s.length for s in shards),
                          "filenames": [str(s.path.relative_to(root)) for s in shards],
                          "shard_lengths": [s.length for s in shards]}
    return _merge_info(root, written, {})


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m quest.data.make_shards", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="an ImageFolder to tar shards and _info.json")
    conv.add_argument("src", type=Path, help="the ImageFolder root (holding train/ and val/)")
    conv.add_argument("out", type=Path)
    conv.add_argument("--split", action="append", metavar="FOLDER[:NAME]",
                      help="a split folder and its name in _info.json (default: train, val:validation)")
    conv.add_argument("--name", default="shards", help="shard file prefix, e.g. imagenet1k")
    conv.add_argument("--shard-size", type=int, default=1000)
    conv.add_argument("--seed", type=int, default=0)
    idx = sub.add_parser("index", help="count existing shards into _info.json")
    idx.add_argument("root", type=Path)
    idx.add_argument("splits", nargs="+", metavar="SPLIT=PATTERN")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.command == "convert":
        pairs = [(s.partition(":")[0], s.partition(":")[2] or s) for s in args.split or ["train", "val:validation"]]
        print(convert_image_folder(args.src, args.out, pairs, args.name, args.shard_size, args.seed))
    else:
        print(write_index(args.root, dict(s.split("=", 1) for s in args.splits)))


if __name__ == "__main__":
    main()
