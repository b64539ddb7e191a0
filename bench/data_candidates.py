"""Candidate DeiT training inputs that bench/data.py times against today's (issue: input pipeline, item 1).

Each builder returns a function of a sample index that produces one training sample of the kind the row names:
"float" is the finished 3 x 224 x 224 tensor (normalised, erased: what today's transform returns), "uint8" is a
3 x 224 x 224 uint8 tensor whose remaining steps (normalise, random erasing, and for the (d) rows RandAugment) the
device does on whole batches. A builder whose package is missing returns None with the reason, and the bench skips
that row with a one-line note.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from PIL import Image

Sample = Callable[[int], object]
SCALE, RATIO, SIZE = (0.08, 1.0), (3 / 4, 4 / 3), 224
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def make_capped(paths: list[Path], folder: Path, short_side: int) -> list[Path]:
    """(b') FFCV-style resolution-capped storage as `quest-data cap` writes it (quest.tools.capped.cap_image: short
    side at most `short_side`, PIL's antialiased bicubic, JPEG quality 90; smaller images copied unchanged)."""
    from quest.tools.capped import cap_image

    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for path in paths:
        target = folder / path.name
        target.write_bytes(cap_image(path.read_bytes(), short_side, 90)[0])
        out.append(target)
    return out


def tv2_uint8(paths: list[Path], rand_augment: bool) -> Sample:
    """(a) uint8 tensors throughout: torchvision.io.decode_jpeg on the file's bytes, transforms.v2 RandomResizedCrop
    (bicubic, antialias), flip and, with rand_augment, v2.RandAugment(2 ops, magnitude 9 of 10). Normalise and random
    erasing are left to the device. v2.RandAugment is not timm's rand-m9-mstd0.5-inc1 (always applies its two ops, no
    magnitude noise, its own op list): it stands for the cost of uint8 tensor ops, not for the distribution."""
    from torchvision.io import decode_jpeg, read_file
    from torchvision.transforms import v2

    steps = [v2.RandomResizedCrop(SIZE, scale=SCALE, ratio=RATIO, interpolation=v2.InterpolationMode.BICUBIC,
                                  antialias=True), v2.RandomHorizontalFlip()]
    if rand_augment:
        steps.append(v2.RandAugment(num_ops=2, magnitude=9, num_magnitude_bins=11))
    transform = v2.Compose(steps)
    names = [str(p) for p in paths]
    return lambda i: transform(decode_jpeg(read_file(names[i])))


def pil_crop_uint8(paths: list[Path]) -> Sample:
    """(d) RandAugment and random erasing moved to the device: what stays on the CPU is today's decode, crop and flip
    (the same timm objects, so the same distribution) up to a uint8 tensor."""
    from timm.data.transforms import RandomResizedCropAndInterpolation
    from torchvision.transforms import Compose, PILToTensor, RandomHorizontalFlip

    transform = Compose([RandomResizedCropAndInterpolation(SIZE, scale=SCALE, ratio=RATIO, interpolation="bicubic"),
                         RandomHorizontalFlip(), PILToTensor()])
    return lambda i: transform(Image.open(paths[i]).convert("RGB"))


def bytes_only(paths: list[Path]) -> Sample:
    """(e) everything on the device: the CPU's share is reading the JPEG's bytes into a tensor; the device would
    decode them in batches (torchvision.io.decode_jpeg(device="cuda") or DALI's "mixed" decoder, both nvJPEG) and do the
    crop, flip, RandAugment, normalise and erasing. That device share is for bench/gpu.py."""
    from torchvision.io import read_file

    names = [str(p) for p in paths]
    return lambda i: read_file(names[i])


def dali_cpu(paths: list[Path], fused_decode: bool, rand_augment: bool) -> tuple[Sample | None, str]:
    """(c) NVIDIA DALI's CPU operators, one thread, one batch of all the images per call: file reader, decode,
    RandomResizedCrop (cubic, antialias), flip + normalise to float CHW (crop_mirror_normalize). fused_decode uses
    decoders.image_random_crop (decodes only the crop's region of interest) + resize. DALI has no random erasing with
    per-pixel noise (fn.erase fills a constant), so none of its rows erase."""
    try:
        from nvidia.dali import fn, pipeline_def, types
    except ImportError:
        return None, "nvidia-dali not installed (pip install nvidia-dali-cuda120; CI does not)"
    files = [str(p) for p in paths]

    @pipeline_def(batch_size=len(files), num_threads=1, device_id=None, exec_async=False, exec_pipelined=False,
                  prefetch_queue_depth=1, seed=0, enable_conditionals=rand_augment)
    def pipe():
        jpegs, _ = fn.readers.file(files=files, labels=list(range(len(files))), random_shuffle=False)
        if fused_decode:
            images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB, random_area=SCALE,
                                                   random_aspect_ratio=RATIO)
            images = fn.resize(images, size=[SIZE, SIZE], interp_type=types.INTERP_CUBIC, antialias=True)
        else:
            images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
            images = fn.random_resized_crop(images, size=[SIZE, SIZE], random_area=SCALE, random_aspect_ratio=RATIO,
                                            interp_type=types.INTERP_CUBIC, antialias=True)
        if rand_augment:
            from nvidia.dali.auto_aug import rand_augment as ra

            images = ra.rand_augment(images, n=2, m=9, num_magnitude_bins=11)  # m9 of 10, as timm
        return fn.crop_mirror_normalize(images, mirror=fn.random.coin_flip(probability=0.5), dtype=types.FLOAT,
                                        output_layout="CHW", mean=[m * 255 for m in MEAN],
                                        std=[s * 255 for s in STD])

    try:
        built = pipe()
        built.build()
        built.run()
    except Exception as err:  # an operator this DALI version lacks on the CPU: report it, time the rest
        return None, f"DALI CPU pipeline failed to build/run: {str(err).splitlines()[0][:160]}"

    def batch(i: int):  # one call produces the whole batch; the bench calls it once per round (see data.py)
        return built.run()

    return batch, ""
