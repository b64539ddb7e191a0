"""Mixed precision, one place for training and evaluation: which precision a run uses, and its autocast context."""
from __future__ import annotations

from contextlib import nullcontext
from functools import partial
from typing import Any, Callable

import torch

from quest.validation import PRECISIONS

__all__ = ["AUTOCAST_DTYPES", "autocast_for"]

#: precision -> autocast dtype (None: no autocast, float32 throughout)
AUTOCAST_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
assert tuple(AUTOCAST_DTYPES) == PRECISIONS


def autocast_for(precision: str, device: torch.device) -> Callable[[], Any]:
    """A factory of the context that runs forward passes at ``precision`` (fp32 | bf16 | fp16) on ``device``."""
    if precision not in AUTOCAST_DTYPES:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    dtype = AUTOCAST_DTYPES[precision]
    return partial(torch.autocast, device_type=device.type, dtype=dtype) if dtype else nullcontext
