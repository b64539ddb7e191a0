"""Train and eval transforms from the recipe, built with timm's ``create_transform``."""
from __future__ import annotations

from typing import Any, Callable

import timm.data.auto_augment as timm_aa
from PIL import Image, ImageOps
from timm.data import create_transform

__all__ = ["build_transforms", "posterize"]


def posterize(img: Image.Image, bits_to_keep: int, **_: Any) -> Image.Image:
    """timm's posterize as it behaves with Pillow < 13: keeping 0 bits gives a black image. RandAugment's
    increasing posterize (DeiT's ``rand-m9-mstd0.5-inc1``) asks for 0 bits at magnitude 10, which a magnitude drawn
    around 9 with std 0.5 reaches for about 2% of its draws; Pillow 13 refuses bits = 0 with a ValueError, which
    would stop a DeiT run at a random step."""
    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)  # every bit masked off: Pillow < 13's lookup table maps all to 0
    return ImageOps.posterize(img, bits_to_keep)


for _name, _op in list(timm_aa.NAME_TO_OP.items()):  # RandAugment / AutoAugment ops look their function up here
    if _op is timm_aa.posterize:
        timm_aa.NAME_TO_OP[_name] = posterize


def build_transforms(recipe: Any, data: Any, img_size: int) -> tuple[Callable, Callable]:
    mean, std = tuple(data.mean), tuple(data.std)
    train = create_transform(
        img_size,
        is_training=True,
        scale=tuple(recipe.scale),
        ratio=tuple(recipe.ratio),
        hflip=recipe.hflip,
        color_jitter=recipe.color_jitter if recipe.color_jitter is not None else 0.0,
        auto_augment=recipe.auto_augment,
        interpolation=recipe.train_interpolation,
        mean=mean,
        std=std,
        re_prob=recipe.reprob,
        re_mode=recipe.remode,
        re_count=recipe.recount,
    )
    val = create_transform(
        img_size,
        is_training=False,
        interpolation=recipe.eval_interpolation,
        mean=mean,
        std=std,
        crop_pct=recipe.crop_pct,
    )
    return train, val
