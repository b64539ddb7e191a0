"""The device's share of data.pipeline=split and device as whole-batch work (quest/data/pipelines/batch_input.py,
quest.data.pipelines.device_augment): the operators one batch dispatches, counted at the dispatcher on the CPU (what each
would launch on a GPU), do not grow with the batch size, so no Python loop runs over the images of a batch; the
batched crop gives each image what cropping it alone gives, whatever the other images' sizes."""
from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as F

from bench.dispatch_proxy import DispatchCost
from quest.data.pipelines import tensor_input
from quest.data.pipelines.batch_input import crop_boxes, resized_crop_batch
from quest.data.pipelines.tensor_input import CropFlip, DeviceFinish, decode_batch

from .test_prefetch import FakeCuda

DEIT = OmegaConf.create(dict(auto_augment="rand-m9-mstd0.5-inc1", reprob=0.25, remode="pixel", recount=1,
                             train_interpolation="bicubic", scale=[0.08, 1.0], ratio=[0.75, 1.3333333333], hflip=0.5,
                             color_jitter=None))
DATA = OmegaConf.create({"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]})
SIZE = 16  # small: the counts do not depend on the image size, the test's time does


def _jpeg(width: int, height: int, seed: int) -> torch.Tensor:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _launches(run) -> tuple[int, dict[str, int]]:
    random.seed(0), torch.manual_seed(0)
    with DispatchCost() as cost:
        run()
    return cost.launches, cost.by_op


def test_the_operators_one_batch_dispatches_do_not_grow_with_the_batch():
    """DeiT's device share (RandAugment rand-m9-mstd0.5-inc1, normalise, pixel erasing 0.25) from uint8 crops
    (split), and the whole input from JPEG bytes (device): the same count for a batch of 8 and of 128. Before
    (per-image crop, per-group RandAugment that skipped empty groups, timm's per-image erasing), at 64 px: split
    636 -> 1,874, device 1,121 -> 2,472. The CPU's JPEG decoder is torchvision's, one call per image (on CUDA
    decode_jpeg takes the list in one nvJPEG call: the next test); it is the only operator counted per image."""
    split = DeviceFinish(DEIT, DATA, SIZE)
    device = DeviceFinish(DEIT, DATA, SIZE, crop=CropFlip(SIZE, DEIT.scale, DEIT.ratio, "bicubic", DEIT.hflip))
    counts = {}
    for n in (8, 128):
        crops = torch.randint(0, 256, (n, 3, SIZE, SIZE), dtype=torch.uint8)
        files = [_jpeg(SIZE + 3 + i % 9, SIZE + i % 5, i) for i in range(n)]
        counts[n] = (_launches(lambda: split(crops, torch.device("cpu"))),
                     _launches(lambda: device(files, torch.device("cpu"))))
    (split_8, _), (device_8, ops_8) = counts[8]
    (split_128, _), (device_128, ops_128) = counts[128]
    assert split_8 == split_128, (split_8, split_128)
    decoder = "image.decode_image.default"
    assert (ops_8[decoder], ops_128[decoder]) == (8, 128)
    assert device_8 - 8 == device_128 - 128, (device_8, device_128)
    assert {k: v for k, v in ops_8.items() if k != decoder} == {k: v for k, v in ops_128.items() if k != decoder}


def test_jpegs_decode_in_one_call_on_cuda_and_the_rest_one_by_one(monkeypatch):
    """On CUDA every JPEG of the batch goes to torchvision's decode_jpeg as one list (one nvJPEG call), in the
    batch's order; an image nvJPEG refuses sends each image its own way (quest.data.pipelines.tensor_input.decode_rgb)."""
    calls = []

    def fake_decode_jpeg(images, mode, device):
        calls.append((len(images), device.type))
        return [torch.full((3, 2, 2), int(i.numel() % 251), dtype=torch.uint8) for i in images]

    FakeCuda(monkeypatch)
    monkeypatch.setattr(tensor_input, "_DECODE_STREAMS", {})
    monkeypatch.setattr(tensor_input, "decode_jpeg", fake_decode_jpeg)
    files = [_jpeg(8 + i, 8, i) for i in range(5)]
    out = decode_batch(files, torch.device("cuda"))  # nothing is allocated on the GPU: the decoder is the fake's
    assert calls == [(5, "cuda")] and [int(o[0, 0, 0]) for o in out] == [f.numel() % 251 for f in files]


def test_on_cuda_the_decoder_allocates_on_its_own_stream_and_the_caller_waits_for_it(monkeypatch):
    """torchvision's CUDA decode_jpeg allocates its outputs on the current stream and writes them on a private stream
    that waits for nothing, so decoding while the prefetch side stream is current could overwrite memory the
    previous batch's queued augmentation still reads. With the streams faked: the decode runs while a stream of the
    decoder's own is current (one per device, made once), never the caller's; afterwards the caller's stream waits
    for it and every decoded image is recorded as used by the caller's stream, so the allocator gives its memory
    out again only after the caller's work has run."""
    cuda = FakeCuda(monkeypatch)
    monkeypatch.setattr(tensor_input, "_DECODE_STREAMS", {})
    current_at_decode = []

    def fake_decode_jpeg(images, mode, device):
        current_at_decode.append(torch.cuda.current_stream(device).name)
        cuda.log.append("decode")
        return [torch.zeros(3, 2, 2, dtype=torch.uint8) for _ in images]

    monkeypatch.setattr(tensor_input, "decode_jpeg", fake_decode_jpeg)
    files = [_jpeg(8 + i, 8, i) for i in range(3)]
    side = torch.cuda.Stream(torch.device("cuda"))  # finish_ahead's: stream1
    with torch.cuda.stream(side):
        first = decode_batch(files, torch.device("cuda"))
        second = decode_batch(files[:2], torch.device("cuda"))
    assert [s.name for s in cuda.made] == ["stream1", "stream2"] and current_at_decode == ["stream2", "stream2"]
    assert cuda.log == ["decode", "stream1 waits for stream2", *["record on stream1"] * 3,
                        "decode", "stream1 waits for stream2", *["record on stream1"] * 2]
    assert len(cuda.recorded) == 5 and all(t is d for (t, _), d in zip(cuda.recorded, [*first, *second]))


@pytest.mark.parametrize("mode", ["bicubic", "bilinear", "nearest"])
def test_a_batch_of_differently_sized_images_crops_each_as_alone(mode):
    """The padding of the batched crop leaks nothing: each image of a batch of different sizes and crop boxes gives
    bit for bit what cropping it alone gives; nearest equals torchvision's resized_crop exactly, bilinear and
    bicubic are within 1 level of torchvision's uint8 resampler (which rounds between its passes, as this does)."""
    images = [torch.from_numpy(np.random.default_rng(i).integers(0, 256, (3, 20 + 7 * i, 45 - 4 * i),
                                                                   dtype=np.uint8)) for i in range(6)]
    random.seed(1)
    boxes = crop_boxes(images, (0.08, 1.0), (3 / 4, 4 / 3))
    flips = torch.tensor([True, False] * 3)
    batch = resized_crop_batch(images, boxes, flips, 12, mode)
    alone = torch.cat([resized_crop_batch([im], b[None], f[None], 12, mode) for im, b, f in zip(images, boxes, flips)])
    assert batch.shape == (6, 3, 12, 12) and batch.dtype == torch.uint8 and torch.equal(batch, alone)
    interpolation = {"bicubic": InterpolationMode.BICUBIC, "bilinear": InterpolationMode.BILINEAR,
                     "nearest": InterpolationMode.NEAREST}[mode]
    reference = torch.stack([
        (lambda r: r.flip(-1) if f else r)(F.resized_crop(im, *b.tolist(), [12, 12], interpolation=interpolation,
                                                          antialias=mode != "nearest"))
        for im, b, f in zip(images, boxes, flips)])
    difference = (batch.int() - reference.int()).abs()
    assert difference.max() <= (0 if mode == "nearest" else 1), difference.max()
    assert mode == "nearest" or (difference == 0).float().mean() > 0.9


def test_the_flips_are_the_draws_of_one_torch_rand_per_image():
    """CropFlip.batch draws the flips as torch.rand(n): the values n calls of torch.rand(1) give, so the batch sees
    the flips the per-image CropFlip (data.pipeline=split's worker step) draws under the same seed."""
    torch.manual_seed(4)
    one_by_one = torch.cat([torch.rand(1) for _ in range(300)])
    torch.manual_seed(4)
    assert torch.equal(torch.rand(300), one_by_one)
