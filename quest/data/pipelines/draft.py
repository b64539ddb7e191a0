"""Decoding a JPEG at reduced size where the training crop allows it (``data.draft_decode``; docs/data.md,
"Decoding at reduced size").

With the setting on, a data set that reads image files hands the training transform the image opened but not
decoded (:func:`open_undecoded`: PIL has read the header only). The crop box is drawn from the full size in that
header with timm's own ``RandomResizedCropAndInterpolation.get_params``, so the draws, their order and their
distribution are those of a full decode. Then libjpeg decodes at the largest DCT scaling 1/2^k (k <= 3, PIL's
``draft``, as FFCV and DALI do) that leaves the crop at least the output size along both axes (:func:`reduction`),
and the crop box, scaled by the same factor, is resampled from the reduced image. Where nothing is reduced (k = 0,
or a file PIL cannot draft: PNG, a multi-tile file) the step is today's exactly: full decode, then timm's crop and
resize. JPEG's scaled IDCT is a different low-pass filter from a full decode followed by the antialiased resize, so
the reduced crops' pixels differ from today's by a measured tolerance (docs/data.md).

:class:`DraftResizedCrop` is the ``timm`` pipeline's crop; ``split``'s is quest.data.pipelines.tensor_input.DraftCropFlip,
which uses :func:`reduction`, :func:`draft_scale`, :func:`decode_rgb_pil` and :func:`resize_box` from here.
"""
from __future__ import annotations

import random
from typing import Any, Callable

from PIL import Image
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision.transforms import Compose
from torchvision.transforms import functional as F

from quest.data.folder import CorruptImageError

__all__ = ["MAX_REDUCTION_LOG2", "open_undecoded", "reduction", "draft_scale", "decode_rgb_pil", "resize_box",
           "DraftResizedCrop", "draft_first"]

MAX_REDUCTION_LOG2 = 3  # libjpeg's DCT scaling: 1/2, 1/4, 1/8 (PIL's draft offers no finer steps)


def open_undecoded(path: str) -> Image.Image:
    """The image at ``path`` with its header read and its pixels not yet decoded (``Image.open``): a data set's
    loader under ``data.draft_decode``. An unreadable header raises here, where the data set's ``bad_images``
    policy catches it; undecodable pixels raise later, in the crop (:func:`decode_rgb_pil`)."""
    return Image.open(path)


def reduction(crop_h: int, crop_w: int, out_h: int, out_w: int) -> int:
    """k of the largest reduction 1/2^k (k <= :data:`MAX_REDUCTION_LOG2`) after which a crop of crop_h x crop_w
    pixels still has at least out_h x out_w pixels: the resize to the output then only shrinks, as it does from a
    full decode of such a crop."""
    k = 0
    while k < MAX_REDUCTION_LOG2 and crop_h >> (k + 1) >= out_h and crop_w >> (k + 1) >= out_w:
        k += 1
    return k


def draft_scale(img: Image.Image, k: int) -> int:
    """Ask PIL to decode ``img`` (opened, not decoded) at 1/2^k; the factor it will decode at: 2^k for a JPEG,
    1 where PIL has no draft for the file (PNG and other formats, an image already decoded) or k = 0."""
    if k == 0:
        return 1
    full_w, full_h = img.size
    # PIL picks the largest of 8, 4, 2, 1 that divides the size into at least the requested one: floor division
    # asks for exactly 2^k (a ceiling would get 2^(k-1) for sizes not divisible by 2^k)
    drafted = img.draft("RGB", (full_w >> k, full_h >> k))
    if drafted is None:
        return 1
    _, box = drafted  # (0, 0, full_w / scale, full_h / scale) in the reduced image's pixels
    return round(full_w / box[2])


def decode_rgb_pil(img: Image.Image) -> Image.Image:
    """``img`` decoded (at the scale its draft set) as RGB, as torchvision's image folder loader converts every
    image; a :class:`CorruptImageError` naming the file when its pixels cannot be decoded."""
    try:
        return img.convert("RGB")
    except Exception as exc:  # PIL raises several types for truncated / damaged files
        img.close()  # the file it opened, not left to the garbage collector
        name = getattr(img, "filename", "") or "an image"
        raise CorruptImageError(f"cannot read image {name}: {exc}. Set data.bad_images=skip to skip such "
                                "files.") from exc


def resize_box(rgb: Image.Image, box: tuple[int, int, int, int], scale: int, size: tuple[int, int],
               resample: int) -> Image.Image:
    """The crop ``box`` (top, left, height, width in full-size pixels) of ``rgb``, decoded at 1/``scale``,
    resampled to ``size`` (height, width): PIL's resize over the box scaled to the reduced image, fractional edges
    kept (a box of the full image rarely falls on the reduced image's pixel grid)."""
    top, left, height, width = box
    scaled = (left / scale, top / scale, (left + width) / scale, (top + height) / scale)
    return rgb.resize((size[1], size[0]), resample, box=scaled)


class DraftResizedCrop(RandomResizedCropAndInterpolation):
    """timm's RandomResizedCropAndInterpolation on an image opened undecoded: its draws in its order (the box from
    ``get_params``, then the interpolation where it is random), then the decode at the reduction the box allows
    (module docstring). Unreduced it returns exactly timm's crop of the full decode."""

    @classmethod
    def like(cls, crop: RandomResizedCropAndInterpolation) -> "DraftResizedCrop":
        """The same crop (size, scale, ratio, interpolation as timm built them) with the decode inside it."""
        draft = cls.__new__(cls)
        draft.__dict__.update(vars(crop))
        return draft

    def __call__(self, img: Any) -> Image.Image:
        top, left, height, width = self.get_params(img, self.scale, self.ratio)  # the header's size
        if isinstance(self.interpolation, (tuple, list)):
            interpolation = random.choice(self.interpolation)
        else:
            interpolation = self.interpolation
        scale = draft_scale(img, reduction(height, width, *self.size))
        rgb = decode_rgb_pil(img)
        if scale == 1:  # timm's own step on the full decode
            return F.resized_crop(rgb, top, left, height, width, list(self.size), interpolation)
        return resize_box(rgb, (top, left, height, width), scale, self.size, F.pil_modes_mapping[interpolation])


def draft_first(transform: Callable) -> Compose:
    """timm's training transform (a Compose whose first step is its RandomResizedCropAndInterpolation) with that
    step decoding at reduced size: :class:`DraftResizedCrop`, the rest unchanged."""
    steps = list(getattr(transform, "transforms", []))
    if not steps or type(steps[0]) is not RandomResizedCropAndInterpolation:
        first = type(steps[0]).__name__ if steps else type(transform).__name__
        raise ValueError("data.draft_decode needs timm's training transform to start with its "
                         f"RandomResizedCropAndInterpolation; it starts with {first}")
    return Compose([DraftResizedCrop.like(steps[0]), *steps[1:]])
