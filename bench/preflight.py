"""The cost of the data pre-flight (docs/data.md) on a generated image folder, extrapolated to ImageNet-1k.

Generates (once) ``--images`` JPEGs of 500x375 px at quality 90 under ``--root`` (outside the repository), in
``--classes`` class folders, with smooth structure plus noise so that a file weighs about what an ImageNet training
JPEG does (~110 KB); then, for each worker count, times:

- the first pre-flight (``check_image_folder_files``: every file fully decoded with Pillow; the cache removed first),
- the second, cached run (the folder's fingerprint -- a stat of every file -- matches the cached result),
- the header-only shard check (``check_shard_split``) on the same images converted to tar shards.

Each figure is extrapolated linearly to ImageNet-1k's 1,281,167 training files (an extrapolation: it assumes the
same per-file cost, files in the page cache or on a disk as fast as this one, and the same cores). The load average
is printed before and after, since other jobs share the machine.

    python bench/preflight.py --root /tmp/quest-preflight-bench --images 2000 --workers 1 2
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import time
from pathlib import Path

import numpy as np
from PIL import Image

from quest.data.preflight import _cache_paths, check_image_folder_files
from quest.data.shard_preflight import check_shard_split
from quest.tools.make_shards import convert_image_folder

IMAGENET_TRAIN_FILES = 1_281_167


def generate(root: Path, images: int, classes: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    h, w = 375, 500
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    for i in range(images):
        d = root / "train" / f"n{i % classes:08d}"
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"img_{i:06d}.JPEG"
        if path.exists():
            continue
        f = rng.uniform(0.005, 0.05, size=(3, 2))
        phase = rng.uniform(0, 6.3, size=3)
        base = np.stack([127 + 100 * np.sin(f[c, 0] * xx + f[c, 1] * yy + phase[c]) for c in range(3)], axis=-1)
        noisy = base + rng.normal(0, 24, size=(h, w, 3))  # texture: sets the JPEG size near ImageNet's
        Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8)).save(path, "JPEG", quality=90)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/quest-preflight-bench"))
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    generate(args.root, args.images, args.classes)
    split = args.root / "train"
    files = sorted(p for p in split.rglob("*") if p.is_file() and not p.name.startswith("."))
    sizes = np.array([p.stat().st_size for p in files])
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; load average before: "
          f"{_load()}")
    print(f"{len(files)} files, {sizes.sum() / 2**20:.1f} MiB, mean {sizes.mean() / 1e3:.0f} KB (500x375 JPEG q90)")
    scale = IMAGENET_TRAIN_FILES / len(files)
    rows = []
    for workers in args.workers:
        for cache in _cache_paths(split):
            cache.unlink(missing_ok=True)
        t0 = time.perf_counter()
        report = check_image_folder_files(split, workers=workers)
        first = time.perf_counter() - t0
        assert not report.cached and report.images == len(files), report.describe()
        t0 = time.perf_counter()
        again = check_image_folder_files(split, workers=workers)
        cached = time.perf_counter() - t0
        assert again.cached
        rows.append((f"image folder, full decode, {workers} worker(s)", first))
        rows.append((f"image folder, cached second run ({workers} worker(s))", cached))
    shards = args.root / "shards"
    if not (shards / "_info.json").exists():
        convert_image_folder(args.root, shards, [("train", "train")], name="bench", shard_size=1000)
    for workers in args.workers:
        t0 = time.perf_counter()
        report = check_shard_split(shards, "train", args.classes, workers=workers)
        rows.append((f"shards, headers and labels, {workers} worker(s)", time.perf_counter() - t0))
        assert report.images == len(files) and not report.problems, report.describe()
    print(f"| what | {len(files)} files, s | files/s | extrapolated to {IMAGENET_TRAIN_FILES:,} files |")
    print("|---|---|---|---|")
    for what, seconds in rows:
        ext = seconds * scale
        print(f"| {what} | {seconds:.2f} | {len(files) / seconds:,.0f} | "
              f"{ext / 60:.1f} min |" if ext >= 60 else f"| {what} | {seconds:.2f} | {len(files) / seconds:,.0f} | "
              f"{ext:.0f} s |")
    print(f"load average after: {_load()}")
    if os.environ.get("QUEST_BENCH_CLEANUP") == "1":
        shutil.rmtree(args.root)


if __name__ == "__main__":
    main()
