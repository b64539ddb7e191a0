"""The DeiT training input pipeline, per data-loader worker, against what a GPU consumes (issue: GPU readiness).

JPEGs of ImageNet's typical size (500 x 375, about 110 KB) are generated once; then, in one process (one worker's
share: a DataLoader worker runs exactly this per sample), rounds alternate the stages:

  decode        PIL open + convert("RGB")
  decode_tv     torchvision.io.decode_jpeg on the file's bytes (libjpeg-turbo through torchvision)
  crop_flip     decode + RandomResizedCrop(224, bicubic) + flip + to-tensor + normalise
  today         (a row of the candidates' table) the full DeiT training transform of configs/recipe/deit.yaml (timm
                create_transform: crop, flip, RandAugment rand-m9-mstd0.5-inc1, normalise, random erasing 0.25)
  deit_draft    the same with PIL's JPEG draft mode (decode at a reduced scale when the crop allows it)
  deit_prefetch the same up to a uint8 array (timm's PrefetchLoader normalises and erases on the GPU)
  shards        reading + decoding the same images from WebDataset tar shards (quest.data.shards, data=imagenet_wds)
                instead of one file each: the I/O pattern a shared file system prefers, at the same decode cost
  mixup         timm Mixup/CutMix on a batch of 128 already-transformed images (per image; on the GPU in training)

Then the candidates for a faster DeiT input (bench/data_candidates.py), each against today's transform in the same
rounds: (a) uint8 tensors with decode_jpeg + transforms.v2, (b) JPEG DCT-scaled decode chosen from the drawn crop,
(b') resolution-capped storage (short side <= 256 / 320) under today's transform, (c) NVIDIA DALI's CPU operators
(skipped with a note where the package is missing), (d) RandAugment and random erasing moved to the device.

quest's own pipelines are rows too: pipeline_split and pipeline_device are what a loader worker does per image under
data.pipeline=split and data.pipeline=device (quest/data/pipelines/tensor_input.py) with the DeiT recipe.

Medians over rounds of images/s per core (one thread), the ratio to today's, and the workers one GPU needs at a given
consumption rate. The line before the last names the fastest candidate that decodes on the CPU and its ratio to
today's; the last line gives today's (data.pipeline=timm) and quest's two new pipelines side by side with their ratios.

    python bench/data.py [--images 64] [--rounds 5] [--quick] [--no-dali] [--gpu-rates vit_ti=2294,vit_s=1053,vit_b=391]

``--device-share`` measures instead what split and device hand to the device, on this CPU (one thread): img/s of a
batch of 128 at 224 px (``--batch``, ``--size``) and the operators one batch dispatches at 8 and at 128 images
(counted at the dispatcher: on a GPU, kernel launches).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.data_inputs import deit_config, images_per_second, make_jpegs, pipeline_worker  # noqa: E402


def deit_transform():
    """quest's own training transform of configs/recipe/deit.yaml (quest.data.build_transforms)."""
    from quest.data import build_transforms

    cfg = deit_config()
    return build_transforms(cfg.recipe, cfg.data, 224)[0]


def deit_prefetcher_transform():  # quest.data.pipelines.transforms is imported by deit_transform (RandAugment's posterize)
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
    """The JPEGs as an ImageFolder, converted to tar shards (python -m quest.tools.make_shards convert)."""
    import shutil

    from quest.data.shard_index import resolve_shards
    from quest.data.shards import WdsDataset
    from quest.tools.make_shards import convert_image_folder

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


# What one GPU consumes in AMP training at 224 px: timm's published training benchmark (results/benchmark-train-amp-
# nchw-pt112-cu113-rtx3090.csv: vit_tiny/small/base_patch16_224 on one RTX 3090, PyTorch 1.12, AMP). Assumptions until
# bench/gpu.py measures them on the lent GPU; an A100/H100 consumes more (docs/benchmarks.md).
BYTES = "JPEG bytes, device: everything"  # the CPU's share of a device-decode path, left out of "best"
GPU_RATES = "vit_ti=2294,vit_s=1053,vit_b=391"


def parse_rates(text: str) -> dict[str, float]:
    try:
        rates = {k.strip(): float(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise SystemExit(f"--gpu-rates: expected name=img_per_s[,name=img_per_s...], got {text!r}") from None
    if not rates or min(rates.values()) <= 0:
        raise SystemExit(f"--gpu-rates: every rate must be > 0, got {text!r}")
    return rates


def candidates(tmp: Path, paths: list[Path], deit, dali: bool) -> tuple[list[tuple[str, str, str, object]], list[str]]:
    """(name, what, output, sample function) per candidate, today's first; and the notes of skipped ones."""
    from bench import data_candidates as dc  # the checkout on sys.path (above): run as a script or imported

    capped = {side: dc.make_capped(paths, tmp / f"capped{side}", side) for side in (256, 320)}
    to_dev, ra_to_dev = "uint8, device: norm/erase", "uint8, device: RA/norm/erase"
    rows = [
        ("today", "PIL decode + timm DeiT transform (quest build_transforms, recipe=deit)", "float",
         lambda i: deit(Image.open(paths[i]).convert("RGB"))),
        ("pipeline_split", "data.pipeline=split's worker: decode_jpeg + timm crop draw + antialiased resize + flip",
         "uint8, device: RA/norm/erase", pipeline_worker("split", paths)),
        ("pipeline_device", "data.pipeline=device's worker: the file's bytes (the device does the rest)", BYTES,
         pipeline_worker("device", paths)),
        ("pipeline_split_cap256", "data.pipeline=split's worker on a copy capped at 256 (quest-data cap)",
         "uint8, device: RA/norm/erase", pipeline_worker("split", capped[256])),
        ("a_tv2_uint8", "(a) decode_jpeg + v2 RRC(bicubic, antialias) + flip + v2.RandAugment(2, m9)", to_dev,
         dc.tv2_uint8(paths, rand_augment=True)),
        ("b_draft_crop", "(b) data.draft_decode=true: crop drawn on full size, DCT-scaled decode (crop >= 224 px), "
         "today's rest", "float", pipeline_worker("timm", paths, draft=True)),
        ("b'_cap256", "(b') today's transform on storage capped at short side 256", "float",
         lambda i: deit(Image.open(capped[256][i]).convert("RGB"))),
        ("b'_cap320", "(b') today's transform on storage capped at short side 320", "float",
         lambda i: deit(Image.open(capped[320][i]).convert("RGB"))),
        ("d_pil_crop_uint8", "(d) today's decode + RRC + flip to uint8; RandAugment + erase on device", ra_to_dev,
         dc.pil_crop_uint8(paths)),
        ("d_tv2_crop_uint8", "(d)+(a) decode_jpeg + v2 RRC + flip; RandAugment + erase on device", ra_to_dev,
         dc.tv2_uint8(paths, rand_augment=False)),
        ("d_cap256_uint8", "(d)+(b') today's crop + flip on capped-256 storage; RA + erase on device", ra_to_dev,
         dc.pil_crop_uint8(capped[256])),
        ("d_tv2_cap256_uint8", "(d)+(a)+(b') decode_jpeg + v2 RRC + flip on capped-256 storage", ra_to_dev,
         dc.tv2_uint8(capped[256], rand_augment=False)),
        ("d_tv2_cap320_uint8", "(d)+(a)+(b') decode_jpeg + v2 RRC + flip on capped-320 storage", ra_to_dev,
         dc.tv2_uint8(capped[320], rand_augment=False)),
        ("e_bytes_only", "(e) CPU reads the file's bytes; the device decodes (nvJPEG) and does all the rest", BYTES,
         dc.bytes_only(paths)),
    ]
    notes = []
    dali_rows = [("c_dali", "(c) DALI CPU: decode + random_resized_crop + flip/normalise", False, False),
                 ("c_dali_roi", "(c) DALI CPU: ROI decode (image_random_crop) + resize + flip/normalise", True, False),
                 ("c_dali_ra", "(c) DALI CPU: decode + random_resized_crop + rand_augment(2, m9) + flip/normalise", False, True)]
    if not dali:
        return rows, ["skipped the DALI rows (c): --no-dali"]
    for name, what, fused, augment in dali_rows:
        sample, note = dc.dali_cpu(paths, fused_decode=fused, rand_augment=augment)
        if sample is None:
            notes.append(f"skipped {name}: {note}")
        else:
            sample.whole_batch = True  # one call returns every image: timed once per round
            rows.append((name, what + ", no erasing", "float (no erase)", sample))
    return rows, notes


def main(argv: list[str] | None = None) -> None:
    """The command (``argv``: default sys.argv[1:]); prints the tables and the two closing lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="16 images, 3 rounds (a smoke run: well under a minute)")
    parser.add_argument("--no-dali", action="store_true", help="leave out the DALI rows even where it is installed")
    parser.add_argument("--gpu-rates", default=GPU_RATES,
                        help="img/s one GPU consumes per model, name=rate,... (default: timm's published RTX 3090 AMP "
                        "training benchmark, an assumption until bench/gpu.py measures the lent GPU)")
    parser.add_argument("--device-share", action="store_true", help="time the device's share of split and device")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--draft-decode", action="store_true", help="data.draft_decode off against on, timm and "
                        "split, on JPEGs of 500 x 375 to 2048 x 1536 (bench/data_draft.py)")
    args = parser.parse_args(argv)
    if args.device_share:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            device_share(args.batch, args.size, args.rounds)
        finally:
            torch.set_num_threads(threads)
        return
    if args.quick:
        args.images, args.rounds = 16, 3
    if args.images < 1 or args.rounds < 1:
        raise SystemExit(f"--images and --rounds must be >= 1, got {args.images} and {args.rounds}")
    gpu_rates = parse_rates(args.gpu_rates)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a worker's view: data-loader workers run single-threaded
    try:
        if args.draft_decode:
            from bench.data_draft import draft_bench

            draft_bench(args.images, args.rounds)
        else:
            bench(args.images, args.rounds, not args.no_dali, gpu_rates)
    finally:  # a caller in this process (a test) keeps its own setting
        torch.set_num_threads(threads)


def bench(images: int, rounds: int, dali: bool, gpu_rates: dict[str, float]) -> None:
    """Time every row and stage over ``images`` generated JPEGs in ``rounds`` rounds and print the tables."""
    from timm.data import Mixup
    from torchvision.io import decode_jpeg

    with tempfile.TemporaryDirectory() as tmp:
        paths = make_jpegs(Path(tmp), images)
        sizes = [p.stat().st_size for p in paths]
        raw = [p.read_bytes() for p in paths]
        deit, crop_flip, deit_pf = deit_transform(), crop_flip_transform(), deit_prefetcher_transform()
        stages = {
            "decode": lambda i: Image.open(paths[i]).convert("RGB"),
            "decode_tv": lambda i: decode_jpeg(torch.frombuffer(bytearray(raw[i]), dtype=torch.uint8)),
            "crop_flip": lambda i: crop_flip(Image.open(paths[i]).convert("RGB")),
            "deit_draft": lambda i: deit(open_draft(paths[i])),
            "deit_prefetch": lambda i: deit_pf(Image.open(paths[i]).convert("RGB")),
        }
        shards = _shard_reader(Path(tmp), paths)
        stages["shards"] = lambda i, it=[None]: _next_sample(shards, it)
        rows, notes = candidates(Path(tmp), paths, deit, dali=dali)
        timed = {**{name: sample for name, _, _, sample in rows}, **stages}
        mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=1000)
        batch = torch.randn(128, 3, 224, 224)
        targets = torch.randint(0, 1000, (128,))
        rates: dict[str, list[float]] = {k: [] for k in [*timed, "mixup"]}
        cores: dict[str, list[float]] = {k: [] for k in timed}
        for _ in range(rounds):  # every row once per round, today's first: load drifts hit all alike
            for name, sample in timed.items():
                rate, busy = images_per_second(sample, len(paths))
                rates[name].append(rate)
                cores[name].append(busy)
            tic = time.perf_counter()
            mixup(batch.clone(), targets)
            rates["mixup"].append(128 / (time.perf_counter() - tic))
    median = {name: statistics.median(values) for name, values in rates.items()}
    today = median["today"]
    print(f"{images} JPEGs of 500 x 375, median {statistics.median(sizes) / 1e3:.0f} KB; {rounds} rounds; "
          f"one thread; load average {os.getloadavg()[0]:.2f}")
    for note in notes:
        print(note)
    models = list(gpu_rates)
    print("| candidate | what | output | images/s per core | x today | CPU s per wall s | "
          + " | ".join(f"workers for {m} ({gpu_rates[m]:.0f} img/s)" for m in models) + " |")
    print("|---" * (6 + len(models)) + "|")
    for name, what, output, _ in rows:
        workers = " | ".join(f"{gpu_rates[m] / median[name]:.1f}" for m in models)
        print(f"| {name} | {what} | {output} | {median[name]:.0f} | {median[name] / today:.2f} | "
              f"{statistics.median(cores[name]):.2f} | {workers} |")
    print("| stage | images/s per core |\n|---|---|")
    for name in [*stages, "mixup"]:
        print(f"| {name} | {median[name]:.0f} |")
    best = max((r for r in rows if r[0] != "today" and r[2] != BYTES), key=lambda r: median[r[0]])
    print(f"best candidate that decodes on the CPU: {best[0]} ({best[2]}) {median[best[0]]:.0f} images/s per core "
          f"vs today's {today:.0f}: "
          f"ratio {median[best[0]] / today:.2f}")
    split, device, capped = median["pipeline_split"], median["pipeline_device"], median["pipeline_split_cap256"]
    print(f"per core, today's (data.pipeline=timm) {today:.0f} images/s; data.pipeline=split {split:.0f}: ratio "
          f"{split / today:.2f}; data.pipeline=device {device:.0f}: ratio {device / today:.2f}; data.pipeline=split "
          f"on a copy capped at 256 {capped:.0f}: ratio {capped / today:.2f}")


def device_share(batch: int, size: int, rounds: int) -> dict[str, dict[str, float]]:
    """data.pipeline=split's device share (RandAugment rand-m9-mstd0.5-inc1, normalise, pixel erasing 0.25 from
    uint8 crops) and data.pipeline=device's (the same from JPEG bytes: decode, crop, flip first) run on this CPU:
    img/s (median of ``rounds``) and the operators one batch dispatches at 8 and at ``batch`` images."""
    import random

    from omegaconf import OmegaConf

    from bench.dispatch_proxy import DispatchCost
    from quest.data.pipelines.tensor_input import CropFlip, DeviceFinish, decode_rgb

    recipe = OmegaConf.create({"auto_augment": "rand-m9-mstd0.5-inc1", "reprob": 0.25, "remode": "pixel",
                               "recount": 1, "train_interpolation": "bicubic"})
    data = OmegaConf.create({"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]})
    crop = CropFlip(size, (0.08, 1.0), (3 / 4, 4 / 3), "bicubic", 0.5)
    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        encoded = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8)
                   for p in make_jpegs(Path(tmp), batch)]
    random.seed(0), torch.manual_seed(0)
    crops = torch.stack([crop(decode_rgb(e)) for e in encoded])
    stages = {"split": (DeviceFinish(recipe, data, size), crops),
              "device": (DeviceFinish(recipe, data, size, crop=crop), encoded)}
    results = {}
    for name, (finish, images) in stages.items():
        ops = []
        for n in (8, batch):
            with DispatchCost() as cost:
                finish(images[:n], cpu)
            ops.append(cost.launches)
        times = []
        for _ in range(rounds):
            tic = time.perf_counter()
            finish(images, cpu)
            times.append(time.perf_counter() - tic)
        results[name] = {"img_per_s": batch / statistics.median(times), "ops_8": ops[0], f"ops_{batch}": ops[1]}
        print(f"{name}: {results[name]['img_per_s']:.0f} img/s on one CPU thread (batch {batch}, {size} px); "
              f"operators per batch: {ops[0]} at 8 images, {ops[1]} at {batch}")
    return results


if __name__ == "__main__":
    main()
