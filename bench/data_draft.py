"""``data.draft_decode`` off against on, per loader core (issue 47, item 3; docs/benchmarks.md, "Decoding at reduced
size"): ``python bench/data.py --draft-decode [--images 32] [--rounds 5]``.

For each image kind (:data:`IMAGES`: ImageNet's typical 500 x 375, then 1024 x 768 and 2048 x 1536, the larger
photographs ImageNet also holds, each at two densities) the bench generates JPEGs (bench/data.py's make_jpegs) and
times, in interleaved rounds (every row once
per round, so load drifts hit all rows alike), what a loader worker does per image with the DeiT recipe under
``data.pipeline=timm`` and ``split``, each with the setting off (today) and on: quest's own transform objects,
reading the file as an image folder does. One thread. Printed per image kind and pipeline: the medians of images/s per
core, their ratio, the median of the per-round ratios, and which share of DeiT's crops decode at 1/2, 1/4 and 1/8
at that size (from 20,000 draws of timm's own get_params: what the speed-up depends on).
"""
from __future__ import annotations

import os
import random
import statistics
import tempfile
from pathlib import Path

from PIL import Image

#: (width, height, noise std): ImageNet's typical size and bits per pixel (4.8), and larger photographs at that
#: density and at a lower one (smoother content, about 1.9 bits per pixel): entropy decoding, which DCT scaling does
#: not shorten, grows with the bytes, the IDCT and colour conversion it does shorten with the pixels
IMAGES = ((500, 375, 28), (1024, 768, 28), (1024, 768, 6), (2048, 1536, 28), (2048, 1536, 6))
PIPELINES = ("timm", "split")
SCALE, RATIO, OUT = (0.08, 1.0), (3 / 4, 4 / 3), 224  # configs/recipe/deit.yaml's crop at 224 px


def reduced_shares(size: tuple[int, int], draws: int = 20000, seed: int = 0) -> list[float]:
    """The share of DeiT's RandomResizedCrop draws on an image of ``size`` (width, height) decoded at 1/2, 1/4 and
    1/8 (quest.data.pipelines.draft.reduction on timm's own get_params)."""
    from timm.data.transforms import RandomResizedCropAndInterpolation

    from quest.data.pipelines.draft import MAX_REDUCTION_LOG2, reduction

    header = Image.new("L", size)  # get_params reads the size only
    state = random.getstate()
    random.seed(seed)
    counts = [0] * (MAX_REDUCTION_LOG2 + 1)
    try:
        for _ in range(draws):
            _, _, h, w = RandomResizedCropAndInterpolation.get_params(header, SCALE, RATIO)
            counts[reduction(h, w, OUT, OUT)] += 1
    finally:
        random.setstate(state)
    return [c / draws for c in counts[1:]]


def draft_bench(images: int, rounds: int) -> dict[tuple[int, int, float, str, bool], float]:
    """Time every (image kind, pipeline, setting) row in ``rounds`` interleaved rounds over ``images`` JPEGs per size; print
    the table; return the median images/s per core of each row."""
    from bench.data_inputs import images_per_second, make_jpegs, pipeline_worker

    load_before = os.getloadavg()
    rows, bits = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for width, height, noise in IMAGES:
            paths = make_jpegs(Path(tmp), images, size=(width, height), noise=noise)
            bits[(width, height, noise)] = statistics.median(p.stat().st_size for p in paths) * 8 / (width * height)
            for pipeline in PIPELINES:
                for draft in (False, True):
                    rows[(width, height, noise, pipeline, draft)] = pipeline_worker(pipeline, paths, draft)
        rates: dict[tuple, list[float]] = {key: [] for key in rows}
        for _ in range(rounds):
            for key, sample in rows.items():
                rates[key].append(images_per_second(sample, images)[0])
    load_after = os.getloadavg()
    median = {key: statistics.median(values) for key, values in rates.items()}
    print(f"{images} generated JPEGs per size (quality 90), {rounds} interleaved rounds, one thread; load average "
          f"(1, 5, 15 min) {', '.join(f'{v:.2f}' for v in load_before)} before, "
          f"{', '.join(f'{v:.2f}' for v in load_after)} after")
    print("| image | bits per pixel | data.pipeline | off: img/s per core | on: img/s per core | on / off (medians) | "
          "median of per-round on / off | crops at 1/2, 1/4, 1/8 |")
    print("|---|---|---|---|---|---|---|---|")
    for image in IMAGES:
        shares = ", ".join(f"{100 * s:.0f}%" for s in reduced_shares(image[:2]))
        for pipeline in PIPELINES:
            off, on = (*image, pipeline, False), (*image, pipeline, True)
            per_round = statistics.median(b / a for a, b in zip(rates[off], rates[on]))
            print(f"| {image[0]} x {image[1]} | {bits[image]:.1f} | {pipeline} | {median[off]:.0f} | "
                  f"{median[on]:.0f} | {median[on] / median[off]:.2f} | {per_round:.2f} | {shares} |")
    return median


def pixel_differences(paths: list[Path], draws: int = 200) -> None:
    """How far data.draft_decode's reduced crops are from today's (timm's crop of the full decode), per file: the
    mean absolute difference in uint8 levels of each reduced crop among ``draws`` DeiT crops at 224 px (same seeds
    both ways), its least, median and largest over the crops, the largest single pixel, and the share of pixels
    within 2 levels. ``python bench/data_draft.py photo.jpg ...`` (a file that is not a JPEG is re-encoded as one
    at quality 90 beside a temporary copy)."""
    import numpy as np
    from timm.data.transforms import RandomResizedCropAndInterpolation

    from quest.data.pipelines.draft import DraftResizedCrop, reduction

    crop = RandomResizedCropAndInterpolation(OUT, SCALE, RATIO, interpolation="bicubic")
    draft = DraftResizedCrop.like(crop)
    print("| file | size | reduced crops | mean difference per crop: least / median / largest (levels) | largest "
          "pixel | pixels within 2 levels |\n|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for path in paths:
            name = Path(path).name
            if Image.open(path).format != "JPEG":
                Image.open(path).convert("RGB").save(Path(tmp) / "copy.jpg", quality=90)
                path = Path(tmp) / "copy.jpg"
            means, worst, close = [], 0.0, []
            for seed in range(draws):
                random.seed(seed)
                _, _, h, w = crop.get_params(Image.open(path), SCALE, RATIO)
                if reduction(h, w, OUT, OUT) == 0:
                    continue
                random.seed(seed)
                full = np.asarray(crop(Image.open(path).convert("RGB")), dtype=np.float64)
                random.seed(seed)
                diff = np.abs(np.asarray(draft(Image.open(path)), dtype=np.float64) - full)
                means.append(diff.mean())
                worst, close = max(worst, diff.max()), [*close, (diff <= 2).mean()]
            shown = (f"{min(means):.2f} / {statistics.median(means):.2f} / {max(means):.2f} | {worst:.0f} | "
                     f"{100 * statistics.mean(close):.1f}%") if means else "- | - | -"
            print(f"| {name} | {Image.open(path).size} | {len(means)} of {draws} | {shown} |")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    pixel_differences([Path(p) for p in sys.argv[1:]])
