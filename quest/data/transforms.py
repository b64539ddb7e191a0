"""Train and eval transforms from the recipe, built with timm's ``create_transform``."""
from __future__ import annotations

from typing import Any, Callable

from timm.data import create_transform

__all__ = ["build_transforms"]


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
