"""The DeiT training input pipeline, per data-loader worker, against what a GPU consumes (issue: GPU readiness).

JPEGs of ImageNet's typical size (500 x 375, about 110 KB) are generated once; then, in one process (one worker's
share: a DataLoader worker runs exactly this per sample), rounds alternate the stages:

  decode        PIL open + convert("RGB")
  decode_tv     torchvision.io.decode_jpeg on the file's bytes (libjpeg-turbo through torchvision)
  crop_flip     decode + RandomResizedCrop(224, bicubic) + flip + to-tensor + normalise
  deit          the full DeiT training transform of configs/recipe/deit.yaml (timm create_transform: crop, flip,
                RandAugment rand-m9-mstd0.5-inc1, normalise, random erasing 0.25)
  deit_draft    the same with PIL's JPEG draft mode (decode at a reduced scale when the crop allows it)
  deit_prefetch the same up to a uint8 array (timm's PrefetchLoader normalises and erases on the GPU)
  shards        reading + decoding the same images from WebDataset tar shards (quest.data.shards, data=imagenet_wds)
                instead of one file each: the I/O pattern a shared file system prefers, at the same decode cost
  mixup         timm Mixup/CutMix on a batch of 128 already-transformed images (per image; on the GPU in training)

Medians over rounds of images/s per worker, and the workers one GPU needs at a given consumption rate.

    python bench/data.py [--images 64] [--rounds 5] [--gpu-img-per-s 450]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_jpegs(folder: Path, count: int, seed: int = 0) -> list[Path]:
    """Photographs' statistics, roughly: smooth gradients and blobs plus fine noise, at quality 90 about 110 KB."""
    rng = np.random.default_rng(seed)
    paths = []
    yy, xx = np.mgrid[0:375, 0:500]
    for i in range(count):
        base = np.stack([np.sin(xx / rng.uniform(20, 80) + rng.uniform(0, 6)) * 90 + 128 for _ in range(3)], -1)
        base += rng.normal(0, 28, size=base.shape)
        img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
        path = folder / f"img{i:04d}.JPEG"
        img.save(path, quality=90)
        paths.append(path)
    return paths


def deit_transform():
    """quest's own training transform of configs/recipe/deit.yaml (quest.data.build_transforms)."""
    from hydra import compose, initialize_config_dir

    from quest.config_store import register_configs
    from quest.data import build_transforms

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base="1.3"):
        cfg = compose("train", overrides=["recipe=deit", "model=vit_base", "data=imagenet", "data.root=/x"])
    return build_transforms(cfg.recipe, cfg.data, 224)[0]


def deit_prefetcher_transform():  # quest.data.transforms is imported by deit_transform (RandAugment's posterize)
    """What stays on a worker with timm's PrefetchLoader: the same transform up to a uint8 array; normalisation and
    random erasing move to the GPU."""
    from timm.data import create_transform

    return create_transform(224, is_training=True, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3), hflip=0.5,
                            color_jitter=0.3, auto_augment="rand-m9-mstd0.5-inc1", interpolation="bicubic",
                            re_prob=0.25, re_mode="pixel", re_count=1, use_prefetcher=True)


def crop_flip_transform():
    from timm.data import create_transform

    return create_transform(224, is_training=True, scale=(0.08, 1.0), hflip=0.5, color_jitter=None,
                            interpolation="bicubic")


def open_draft(path: Path) -> Image.Image:
    img = Image.open(path)
    img.draft("RGB", (320, 320))  # JPEG DCT scaling: decode at 1/2 when the image is at least twice this size
    return img.convert("RGB")


def _shard_reader(tmp: Path, paths: list[Path]):
    """The JPEGs as an ImageFolder, converted to tar shards (python -m quest.data.make_shards convert)."""
    import shutil

    from quest.data.make_shards import convert_image_folder
    from quest.data.shards import WdsDataset, resolve_shards

    folder = tmp / "folder" / "train" / "n00000000"
    folder.mkdir(parents=True)
    for p in paths:
        shutil.copy(p, folder / p.name)
    convert_image_folder(tmp / "folder", tmp / "shards", [("train", "train")], shard_size=16)
    return WdsDataset(resolve_shards(tmp / "shards", "train"), train=False, num_classes=1)


def _next_sample(dataset, it: list) -> None:
    """One decoded sample of the shard stream, restarting it at its end."""
    if it[0] is None:
        it[0] = iter(dataset)
    try:
        next(it[0])
    except StopIteration:
        it[0] = iter(dataset)
        next(it[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--gpu-img-per-s", type=float, default=450.0,
                        help="what one GPU consumes (default: ViT-B/16 224 px on an A100, 3,583 img/s on 8 GPUs in "
                        "PaddlePaddle PLSC's published benchmark; bench/gpu.py measures it on the lent GPU)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # a worker's view: data-loader workers run single-threaded
    from timm.data import Mixup
    from torchvision.io import decode_jpeg

    with tempfile.TemporaryDirectory() as tmp:
        paths = make_jpegs(Path(tmp), args.images)
        sizes = [p.stat().st_size for p in paths]
        raw = [p.read_bytes() for p in paths]
        deit, crop_flip, deit_pf = deit_transform(), crop_flip_transform(), deit_prefetcher_transform()
        stages = {
            "decode": lambda i: Image.open(paths[i]).convert("RGB"),
            "decode_tv": lambda i: decode_jpeg(torch.frombuffer(bytearray(raw[i]), dtype=torch.uint8)),
            "crop_flip": lambda i: crop_flip(Image.open(paths[i]).convert("RGB")),
            "deit": lambda i: deit(Image.open(paths[i]).convert("RGB")),
            "deit_draft": lambda i: deit(open_draft(paths[i])),
            "deit_prefetch": lambda i: deit_pf(Image.open(paths[i]).convert("RGB")),
        }
        shards = _shard_reader(Path(tmp), paths)
        stages["shards"] = lambda i, it=[None]: _next_sample(shards, it)
        mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
        batch = torch.randn(128, 3, 224, 224)
        targets = torch.randint(0, 1000, (128,))
        rates: dict[str, list[float]] = {k: [] for k in [*stages, "mixup"]}
        for _ in range(args.rounds):
            for name, stage in stages.items():
                tic = time.perf_counter()
                for i in range(len(paths)):
                    stage(i)
                rates[name].append(len(paths) / (time.perf_counter() - tic))
            tic = time.perf_counter()
            mixup(batch.clone(), targets)
            rates["mixup"].append(128 / (time.perf_counter() - tic))
    print(f"{args.images} JPEGs of 500 x 375, median {statistics.median(sizes) / 1e3:.0f} KB; {args.rounds} rounds; "
          f"load average {__import__('os').getloadavg()[0]:.2f}")
    print("| stage | images/s per worker | workers for one GPU at %.0f img/s |" % args.gpu_img_per_s)
    print("|---|---|---|")
    for name, values in rates.items():
        rate = statistics.median(values)
        workers = "(on the GPU)" if name == "mixup" else f"{args.gpu_img_per_s / rate:.1f}"
        print(f"| {name} | {rate:.0f} | {workers} |")


if __name__ == "__main__":
    main()
