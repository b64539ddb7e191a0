"""The device's share of data.pipeline=device and split as whole-batch operations: RandomResizedCrop + flip of
differently sized images in one resampling, and timm's random erasing on a batch (decoding a list of JPEGs in one
call is quest.data.pipelines.tensor_input.decode_batch).

Each step dispatches a fixed number of operators whatever the batch size (tests/data/test_batch_input.py counts them at
the dispatcher). What stays per image is host-side Python that dispatches nothing: the crop and erasing boxes, drawn
with python's ``random`` exactly as timm draws them (timm's ``get_params`` and ``RandomErasing._erase``), so the
batches follow timm's distributions draw for draw.

The crop: the decoded images are concatenated into one flat buffer, every image's crop box is gathered into a
zero-padded (N, 3, h_max, w_max) batch, and the antialiased resize is two batched matrix products with per-image
weight matrices (N, S, h_max) and (N, S, w_max) built as ATen's antialiased ``interpolate`` builds its weights (the
same support, kernel and normalisation; zero beyond each image's box), the flip folded into the column weights. In
float32: the images' own precision where the pixels allow (docs/data.md, "The device's work per batch").
"""
from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch

__all__ = ["crop_boxes", "resized_crop_batch", "BatchErasing"]

def crop_boxes(images: Sequence[torch.Tensor], scale: Sequence[float], ratio: Sequence[float]) -> torch.Tensor:
    """timm's RandomResizedCrop draw (``get_params``, python's ``random``) for each image in turn: (N, 4) int64
    (top, left, height, width) on the CPU. Reads only the images' shapes."""
    from timm.data.transforms import RandomResizedCropAndInterpolation

    get_params = RandomResizedCropAndInterpolation.get_params
    return torch.tensor([get_params(image, tuple(scale), tuple(ratio)) for image in images], dtype=torch.int64)


def _filter(x: torch.Tensor, mode: str) -> torch.Tensor:
    """ATen's antialiasing kernels: bicubic with a = -0.5 (as PIL's resize), bilinear the triangle."""
    x = x.abs()
    if mode == "bilinear":
        return (1 - x).clamp(min=0)
    a = -0.5
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = (((x - 5) * x + 8) * x - 4) * a
    return torch.where(x < 1, near, torch.where(x < 2, far, torch.zeros_like(x)))


def _support(mode: str) -> float:
    return 2.0 if mode == "bicubic" else 1.0  # half of ATen's interp_size (bilinear 2, bicubic 4)


def _taps(extents: torch.Tensor, out_size: int, mode: str) -> int:
    """The longest window any output pixel of these crops reads (host arithmetic on the CPU's crop sizes)."""
    if mode == "nearest":
        return 1
    scale = max(float(extents.max()) / out_size, 1.0)
    return int(math.ceil(2 * _support(mode) * scale)) + 2


def _weights(extent: torch.Tensor, out_size: int, span: int, mode: str, taps: int) -> torch.Tensor:
    """Per-image resampling matrices (N, out_size, span): output pixel i of an image whose crop is ``extent`` pixels
    long reads source pixel j of the crop with this weight; zero for j >= extent. ATen's antialiased weights
    (``_compute_indices_min_size_weights_aa``: centre scale * (i + .5), support scaled when downsampling, the window
    truncated as its integer casts do, weights normalised to sum 1), or its legacy nearest index. Computed on each
    window's ``taps`` pixels (float64, as ATen computes the weights of its uint8 path), then scattered into the
    dense matrix."""
    device = extent.device
    length = extent.to(torch.float64).view(-1, 1, 1)
    scale = length / out_size
    i = torch.arange(out_size, device=device, dtype=torch.float64).view(1, -1, 1)
    t = torch.arange(taps, device=device, dtype=torch.float64).view(1, 1, -1)
    if mode == "nearest":  # floor(i * scale) in float32, as ATen's nearest_idx
        src = torch.floor(i.float() * scale.float()).double().minimum(length - 1)
        j, w = src + t, torch.ones_like(src + t)
    else:
        support = _support(mode) * scale.clamp(min=1.0)
        invscale = 1.0 / scale.clamp(min=1.0)
        centre = scale * (i + 0.5)
        lo = torch.trunc(centre - support + 0.5).clamp(min=0)
        hi = torch.minimum(torch.trunc(centre + support + 0.5), length)
        j = lo + t  # (N, out_size, taps)
        w = torch.where(j < hi, _filter((j - centre + 0.5) * invscale, mode), torch.zeros_like(j))
        total = w.sum(-1, keepdim=True)
        w = w / torch.where(total != 0, total, torch.ones_like(total))
    dense = torch.zeros(extent.shape[0], out_size, span, device=device, dtype=torch.float32)
    # a window's unused taps (weight 0) may point past the span: clamped, they add 0 there
    return dense.scatter_add_(2, j.long().clamp(max=span - 1), w.to(torch.float32))


def resized_crop_batch(images: Sequence[torch.Tensor], boxes: torch.Tensor, flips: torch.Tensor, size: int,
                       mode: str) -> torch.Tensor:
    """Crop each image (3, H_i, W_i) to its box (top, left, height, width), resize it to size x size (antialiased
    ``mode``: bicubic, bilinear, or nearest), flip it where ``flips`` is true: (N, 3, size, size) uint8 on the
    images' device, in a fixed number of operations whatever N. ``boxes`` and ``flips`` are CPU tensors."""
    if not images:
        raise ValueError("resized_crop_batch: expected at least one image")
    device = images[0].device
    dims = torch.tensor([image.shape for image in images], dtype=torch.int64)  # (N, 3): shapes, no device work
    if dims[:, 0].ne(3).any():
        raise ValueError(f"expected RGB images (3, H, W), got channel counts {sorted(set(dims[:, 0].tolist()))}")
    h_max, w_max = int(boxes[:, 2].max()), int(boxes[:, 3].max())
    plane = dims[:, 1] * dims[:, 2]
    start = torch.cumsum(plane, 0) - plane
    # every per-image number the device needs, in one host-to-device copy
    geometry = torch.stack([start, dims[:, 1], dims[:, 2], *boxes.unbind(1), flips.to(torch.int64)], 1)
    start, height, width, top, left, crop_h, crop_w, flip = geometry.to(device, non_blocking=True).unbind(1)
    # one copy: each channel of every image end to end, (3, total pixels). reshape(3, -1) is a view both of a
    # contiguous (3, H, W) and of the CPU decoder's (H, W, 3) seen as (3, H, W), so nothing is copied per image
    flat = torch.cat([image.reshape(3, -1) for image in images], 1)
    rows = (top.view(-1, 1) + torch.arange(h_max, device=device)).minimum(height.view(-1, 1) - 1)
    cols = (left.view(-1, 1) + torch.arange(w_max, device=device)).minimum(width.view(-1, 1) - 1)
    pixel = (start.view(-1, 1) + rows * width.view(-1, 1)).view(-1, h_max, 1) + cols.view(-1, 1, w_max)
    # (3, N, h_max, w_max): every box gathered; beyond an image's box its weights are zero
    crops = flat[:, pixel].to(torch.float32)
    weights_y = _weights(crop_h, size, h_max, mode, _taps(boxes[:, 2], size, mode))
    weights_x = _weights(crop_w, size, w_max, mode, _taps(boxes[:, 3], size, mode))
    weights_x = torch.where(flip.view(-1, 1, 1).bool(), weights_x.flip(1), weights_x)  # output column S-1-i
    # PIL's order and rounding: the horizontal pass first, rounded and clipped to 0..255 as PIL stores it in uint8,
    # then the vertical pass
    rows_done = (crops @ weights_x.transpose(1, 2)).clamp_(0, 255).round_()  # (3, N, h_max, size)
    out = (weights_y @ rows_done).clamp_(0, 255).round_()  # (3, N, size, size)
    return out.to(torch.uint8).transpose(0, 1).contiguous()


class BatchErasing:
    """timm's ``RandomErasing(probability, mode, max_count)`` on a normalised batch (N, C, H, W), in place: the boxes
    drawn with python's ``random`` exactly as timm's ``_erase`` draws them image by image, the fill (zeros for
    ``const``, a normal colour per box for ``rand``, normal noise per pixel for ``pixel``) drawn in one call for the
    whole batch, from a generator seeded by torch's CPU generator, and written with one masked pass per box slot
    (``max_count`` of them)."""

    def __init__(self, probability: float, mode: str = "const", max_count: int = 1):
        from timm.data.random_erasing import RandomErasing

        self.timm = RandomErasing(probability, mode=mode, max_count=max_count, device="cpu")  # its parameters
        self.max_count = int(self.timm.max_count)
        self._generators: dict[str, torch.Generator] = {}

    def draw(self, n: int, height: int, width: int) -> list[list[tuple[int, int, int, int]]]:
        """Each image's boxes (top, left, h, w), in timm's order of python ``random`` calls."""
        t, area, boxes = self.timm, height * width, []
        for _ in range(n):
            mine: list[tuple[int, int, int, int]] = []
            boxes.append(mine)
            if random.random() > t.probability:
                continue
            count = t.min_count if t.min_count == t.max_count else random.randint(t.min_count, t.max_count)
            for _ in range(count):
                for _attempt in range(10):
                    target_area = random.uniform(t.min_area, t.max_area) * area / count
                    aspect_ratio = math.exp(random.uniform(*t.log_aspect_ratio))
                    h = int(round(math.sqrt(target_area * aspect_ratio)))
                    w = int(round(math.sqrt(target_area / aspect_ratio)))
                    if w < width and h < height:
                        mine.append((random.randint(0, height - h), random.randint(0, width - w), h, w))
                        break
        return boxes

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        n, chan, height, width = images.shape
        boxes = self.draw(n, height, width)
        rows = [[0] * 6 for _ in range(n * self.max_count)]  # top, left, h, w, used, offset of its fill
        total = 0
        for i, mine in enumerate(boxes):  # host-side bookkeeping of the drawn boxes: no tensor operation per image
            for slot, (top, left, h, w) in enumerate(mine):
                rows[i * self.max_count + slot] = [top, left, h, w, 1, total]
                total += chan * h * w if self.timm.per_pixel else chan if self.timm.rand_color else 0
        table = torch.tensor(rows, dtype=torch.int64).view(n, self.max_count, 6)
        return self._fill(images, table, total)

    def _fill(self, images: torch.Tensor, table: torch.Tensor, total: int) -> torch.Tensor:
        n, chan, height, width = images.shape
        device = images.device
        top, left, h, w, used, offset = table.to(device, non_blocking=True).unbind(-1)  # (N, K) each
        noise = None
        if self.timm.per_pixel or self.timm.rand_color:
            # from a generator of the images' device seeded from torch's CPU generator: the fill follows the CPU's
            # draws (which checkpoints hold and quest.data.pipelines.prefetch keeps in order), never the device's own stream
            key = str(device)
            if key not in self._generators:
                self._generators[key] = torch.Generator(device)
            generator = self._generators[key]
            generator.manual_seed(int(torch.randint(0, 2**62, (1,))))
            noise = torch.empty(max(total, 1), dtype=images.dtype, device=device).normal_(generator=generator)
        ys = torch.arange(height, device=device).view(1, 1, -1, 1)
        xs = torch.arange(width, device=device).view(1, 1, 1, -1)
        cs = torch.arange(chan, device=device).view(1, -1, 1, 1)
        for slot in range(self.max_count):  # a later box overwrites an earlier one, as timm's writes do
            t, lf, hh, ww = (v[:, slot].view(-1, 1, 1, 1) for v in (top, left, h, w))
            inside = (used[:, slot].view(-1, 1, 1, 1) > 0) & (ys >= t) & (ys < t + hh) & (xs >= lf) & (xs < lf + ww)
            if noise is None:
                fill = torch.zeros((), dtype=images.dtype, device=device)
            elif self.timm.per_pixel:
                at = offset[:, slot].view(-1, 1, 1, 1) + (cs * hh + (ys - t)) * ww + (xs - lf)
                fill = noise[at.clamp(0, noise.numel() - 1)]
            else:
                fill = noise[(offset[:, slot].view(-1, 1, 1, 1) + cs).clamp(0, noise.numel() - 1)]
            images.copy_(torch.where(inside, fill, images))
        return images
