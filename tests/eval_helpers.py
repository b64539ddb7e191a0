"""Shared pieces of the evaluation tests: an oracle model whose predictions are known, tiny fixtures in the real
on-disk layouts, and the objects the suites take."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn as nn
from omegaconf import OmegaConf
from PIL import Image

from quest.evaluation.config import eval_settings_schema
from quest.evaluation.context import EvalRun
from quest.evaluation.target import EvalTarget
from quest.runtime.distributed import DistContext
from quest.train.compute import autocast_for

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
IMG = 40  # fixture image side; the oracle's input is 32 (Resize(36) + CenterCrop(32) at crop_pct 0.875)


def class_colour(c: int) -> tuple[int, int, int]:
    """Class c in 0..999 as three decimal digits, one per channel, each far (>= 12 levels) from its neighbours."""
    return tuple(12 + 25 * d for d in (c // 100, (c // 10) % 10, c % 10))


def write_image(path: Path, c: int, size: int = IMG) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), class_colour(c)).save(path, quality=95)
    return path


class PixelCodeModel(nn.Module):
    """Reads the class encoded in the image colour: logits = 10 at that class plus a small descending ramp, so the
    top-5 is [c, 0, 1, 2, 3] (without c). ``distractor``: a class that always gets the largest logit (20)."""

    def __init__(self, num_classes: int = 1000, distractor: int | None = None):
        super().__init__()
        self.num_classes, self.distractor = num_classes, distractor
        self.register_buffer("mean", torch.tensor(MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(STD).view(1, 3, 1, 1))

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        pixels = ((x * self.std + self.mean) * 255).mean(dim=(2, 3))  # (N, 3) in 0..255
        digits = ((pixels - 12) / 25).round().clamp(0, 9).long()
        return digits[:, 0] * 100 + digits[:, 1] * 10 + digits[:, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = -1e-3 * torch.arange(self.num_classes, dtype=torch.float32, device=x.device).expand(len(x), -1)
        logits = logits.clone()
        logits[torch.arange(len(x)), self.decode(x)] = 10.0
        if self.distractor is not None:
            logits[:, self.distractor] = 20.0
        return logits


def oracle_target(model: nn.Module | None = None, num_classes: int = 1000) -> EvalTarget:
    return EvalTarget(model or PixelCodeModel(num_classes), num_classes, 32, MEAN, STD, 0.875, "bilinear", None,
                      {"source": "test", "model": "oracle", "attention": "none"})


def digits_target(model: nn.Module) -> EvalTarget:
    data = OmegaConf.create({"name": "digits", "val_fraction": 0.2, "split_seed": 0, "num_classes": 10,
                             "mean": [0.5] * 3, "std": [0.5] * 3})
    return EvalTarget(model.eval(), 10, 16, (0.5,) * 3, (0.5,) * 3, 1.0, "bicubic", data,
                      {"source": "test", "model": "linear", "attention": "none"})


def settings(**overrides: Any):
    """A typed eval settings node, as eval.py composes it, with dotted-key overrides."""
    cfg = OmegaConf.structured(eval_settings_schema()(name="test", run=[]))
    for key, value in overrides.items():
        OmegaConf.update(cfg, key.replace("__", "."), value, merge=False)
    return cfg


def make_run(target: EvalTarget, cfg, ctx: DistContext | None = None) -> EvalRun:
    ctx = ctx or DistContext()
    return EvalRun(target, ctx, cfg, autocast_for("fp32", ctx.device))


def wnid(c: int) -> str:
    from quest.evaluation.imagenet_data import imagenet_wnids

    return imagenet_wnids()[c]


def write_wnid_tree(root: Path, images: Sequence[tuple[int, int, str]]) -> Path:
    """images: (folder class, encoded class, file name) -> root/<wnid of folder class>/<file name>."""
    for folder, encoded, name in images:
        write_image(root / wnid(folder) / name, encoded)
    return root


def linear_digits_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 16 * 16, 10))


def random_images(n: int, size: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(n)]
