"""What the data benchmarks (bench/data.py, bench/data_draft.py, bench/gpu_apps.py, bench/gpu_loop.py) share:
generated JPEGs of ImageNet's statistics, the DeiT recipe's config and a loader worker's per-image work under a
``data.pipeline``, and the clock that turns a sampler into images per second."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
from PIL import Image


def make_jpegs(folder: Path, count: int, seed: int = 0, size: tuple[int, int] = (500, 375),
               noise: float = 28) -> list[Path]:
    """Photographs' statistics, roughly: smooth gradients and blobs plus fine noise of std ``noise``; ``size``
    (width, height). At 500 x 375 and quality 90 about 110 KB (4.8 bits per pixel, ImageNet's average)."""
    rng = np.random.default_rng(seed)
    paths = []
    yy, xx = np.mgrid[0:size[1], 0:size[0]]
    for i in range(count):
        base = np.stack([np.sin(xx / rng.uniform(20, 80) + rng.uniform(0, 6)) * 90 + 128 for _ in range(3)], -1)
        base += rng.normal(0, noise, size=base.shape)
        img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8))
        path = folder / f"img{size[0]}x{size[1]}n{noise:g}_{i:04d}.JPEG"
        img.save(path, quality=90)
        paths.append(path)
    return paths



def deit_config(pipeline: str = "timm", draft: bool = False):
    from hydra import compose, initialize_config_dir

    from quest.config.hydra_store import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base="1.3"):
        return compose("train", overrides=["recipe=deit", "model=vit_base", "data=imagenet", "data.root=/x",
                                           f"data.pipeline={pipeline}", f"data.draft_decode={str(draft).lower()}"])



def pipeline_worker(pipeline: str, paths: list[Path], draft: bool = False):
    """What a loader worker does per image under ``data.pipeline=<pipeline>`` (and ``data.draft_decode=<draft>``)
    with the DeiT recipe: the pipeline's own transform, reading the file as an image folder does (the pipeline's
    ``read_file``)."""
    from quest.data import build_train_input

    cfg = deit_config(pipeline, draft)
    train_input = build_train_input(cfg.recipe, cfg.data, 224)
    from torchvision.datasets.folder import default_loader  # what an image folder reads with otherwise (PIL)

    transform, read = train_input.transform, train_input.read_file or default_loader
    names = [str(p) for p in paths]
    return lambda i: transform(read(names[i]))



def images_per_second(sample, count: int) -> tuple[float, float]:
    """Images per wall-clock second, and CPU seconds per wall second (above 1: the library used more than one core,
    so its per-core rate is lower than the wall-clock one)."""
    tic, cpu = time.perf_counter(), time.process_time()
    if getattr(sample, "whole_batch", False):
        sample(0)
    else:
        for i in range(count):
            sample(i)
    wall = time.perf_counter() - tic
    return count / wall, (time.process_time() - cpu) / wall
