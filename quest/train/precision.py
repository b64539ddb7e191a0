"""Mixed precision, one place for training and evaluation: which precision a run uses, and its autocast context."""
from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Any, Callable

import torch

from quest.config.checks import MATMUL_PRECISIONS, PRECISIONS

__all__ = ["AUTOCAST_DTYPES", "autocast_for", "resolve_precision", "set_matmul_precision"]

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


def set_matmul_precision(level: str) -> dict[str, Any]:
    """Run float32 matmuls and convolutions at ``level`` (trainer.matmul_precision) and return what is now in force,
    as torch reports it, for the run's records.

    One setting for both kinds of kernel: torch's own defaults differ (matmuls IEEE float32, cuDNN convolutions TF32),
    so a "float32" ViT's patch embedding would otherwise run TF32 while its attention and MLPs do not. ``highest``
    (quest's default) keeps float32 what its name says; ``high`` lets Ampere and later GPUs use TF32 tensor cores
    (10-bit mantissa, several times the float32 rate); ``medium`` also allows bfloat16 passes. Only float32 work is
    affected: under bf16 / fp16 autocast the matmuls already run in the autocast dtype. The legacy setters are used
    on purpose: torch refuses a mix of them and the newer ``fp32_precision`` attributes, and the MFU peak
    (quest.train.telemetry) reads the legacy ``allow_tf32``."""
    if level not in MATMUL_PRECISIONS:
        raise ValueError(f"trainer.matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, got {level!r}")
    torch.set_float32_matmul_precision(level)
    torch.backends.cudnn.allow_tf32 = level != "highest"
    return {"float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cuda_matmul_allow_tf32": bool(torch.backends.cuda.matmul.allow_tf32),
            "cudnn_allow_tf32": bool(torch.backends.cudnn.allow_tf32)}
