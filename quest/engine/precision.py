"""Mixed precision, one place for training and evaluation: which precision a run uses, and its autocast context."""
from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Any, Callable

import torch

from quest.config_checks import PRECISIONS

__all__ = ["AUTOCAST_DTYPES", "autocast_for", "resolve_precision"]

#: precision -> autocast dtype (None: no autocast, float32 throughout)
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(AUTOCAST_DTYPES) == PRECISIONS


def autocast_for(precision: str, device: torch.device) -> Callable[[], Any]:
    """A factory of the context that runs forward passes at ``precision`` (fp32 | bf16 | fp16) on ``device``."""
    if precision not in AUTOCAST_DTYPES:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    dtype = AUTOCAST_DTYPES[precision]
    return partial(torch.autocast, device_type=device.type, dtype=dtype) if dtype else nullcontext


def resolve_precision(trainer_precision: str, recipe_precision: str | None, device: torch.device) -> str:
    """``auto``: on CUDA what the recipe's authors trained with (DeiT / DeiT-III: fp16 with a loss scaler), else
    bf16; fp32 on CPU. An explicit trainer.precision wins (fp16 on CPU works, slowly: for tests of the scaler path)."""
    if trainer_precision != "auto":
        return trainer_precision
    if device.type != "cuda":
        return "fp32"
    return recipe_precision or "bf16"
