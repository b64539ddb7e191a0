"""The geometric ops of quest.data.pipelines.device_augment (Rotate, ShearX/Y, TranslateX/Y and their relative versions) as
Pillow's ``Image.transform(size, AFFINE, matrix, resample, fillcolor)`` computes them, on batches.

Float64: Geometry.c's bicubic and bilinear filters compute in double and truncate to uint8, so a value a hair below
an integer truncates one level lower; float32's rounding moves such values across the integer (docs/data.md, "The
device's work per batch", gives how often), float64 reproduces Pillow's bits.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

__all__ = ["affine", "MATRICES", "STILL_AXES", "cubic"]

def cubic(v1, v2, v3, v4, d):
    """Geometry.c's BICUBIC macro (a = -1) with its operations in its order, so float64 gives PIL's bits; in place
    on temporaries (the values are (channels, pixels), d (1, pixels): contiguous, vectorised broadcasting)."""
    p3 = torch.sub(v1, v2).mul_(2).add_(v3).sub_(v4)  # 2 * (v1 - v2) + v3 - v4
    out = torch.sub(v2, v1).sub_(v3).add_(v4)  # -v1 + v2 - v3 + v4
    out.mul_(d).add_(p3).mul_(d).add_(torch.sub(v3, v1)).mul_(d)  # d * (p2 + d * (p3 + d * p4)), p2 = -v1 + v3
    return out.add_(v2)


def affine(x: torch.Tensor, matrices: torch.Tensor, bicubic: bool, fill: torch.Tensor,
           still: tuple[bool, bool] = (False, False)) -> torch.Tensor:
    """Image.transform(size, AFFINE, matrix, resample, fillcolor=fill) for each sample: output pixel centre
    (x + .5, y + .5) reads the source at matrix @ (x + .5, y + .5, 1); a source outside [0, W) x [0, H) gives
    ``fill``; inside, PIL's bilinear or bicubic kernel over taps clamped to the picture, truncated to uint8.
    ``still`` (x, y): the op moves no pixel by a fraction along that axis (:data:`STILL_AXES`), where PIL's kernel
    returns its centre tap exactly, so the other taps are skipped (4 gathers instead of 16); decided by the op, not
    by the batch's values, so the operations dispatched do not depend on the draws."""
    b, c, h, w = x.shape
    still_x, still_y = still
    m = matrices.to(x.device, torch.float64).view(b, 6, 1, 1)
    ys = torch.arange(h, device=x.device, dtype=torch.float64).view(1, h, 1) + 0.5
    xs = torch.arange(w, device=x.device, dtype=torch.float64).view(1, 1, w) + 0.5
    sx = m[:, 0] * xs + m[:, 1] * ys + m[:, 2]
    sy = m[:, 3] * xs + m[:, 4] * ys + m[:, 5]
    inside = (sx >= 0) & (sx < w) & (sy >= 0) & (sy < h)
    sx, sy = sx - 0.5, sy - 0.5
    fx, fy = torch.floor(sx), torch.floor(sy)
    dx, dy = (sx - fx).view(1, -1), (sy - fy).view(1, -1)  # (1, pixels): broadcast over the channels
    all_taps = (-1, 0, 1, 2) if bicubic else (0, 1)
    taps_x, taps_y = ((0,) if still_x else all_taps), ((0,) if still_y else all_taps)
    cols = {t: (fx.long() + t).clamp(0, w - 1) for t in taps_x}
    base = torch.arange(b, device=x.device).view(b, 1, 1) * (h * w)
    # (channels, pixels): gathers along contiguous rows. Copied always (a reshape would copy or not depending on
    # the group's size), so the operations dispatched do not depend on how many images drew the op
    planes = torch.empty((c, b * h * w), dtype=x.dtype, device=x.device)
    planes.view(c, b, h, w).copy_(x.transpose(0, 1))

    def interpolate(v: list[torch.Tensor], d: torch.Tensor) -> torch.Tensor:
        if len(v) == 1:
            return v[0]
        return cubic(*v, d) if bicubic else v[0] + (v[1] - v[0]) * d

    def row_value(t: int) -> torch.Tensor:
        start = base + (fy.long() + t).clamp(0, h - 1) * w
        return interpolate([planes.index_select(1, (start + cols[s]).view(-1)).double() for s in taps_x], dx)

    value = interpolate([row_value(t) for t in taps_y], dy)
    out = value.clamp_(0, 255).to(torch.uint8).view(c, b, h, w).permute(1, 0, 2, 3)
    result = torch.empty_like(x, memory_format=torch.contiguous_format)
    return torch.where(inside.unsqueeze(1), out, fill.view(1, c, 1, 1), out=result)


def _rotate_matrix(degrees: float, w: int, h: int) -> list[float]:
    """Image.rotate's inverse matrix about the centre (w / 2, h / 2), with its rounding to 15 decimals."""
    angle = -math.radians(degrees % 360.0)
    a, b, d, e = (round(math.cos(angle), 15), round(math.sin(angle), 15),
                  round(-math.sin(angle), 15), round(math.cos(angle), 15))
    cx, cy = w / 2, h / 2
    return [a, b, a * -cx + b * -cy + 0.0 + cx, d, e, d * -cx + e * -cy + 0.0 + cy]


MATRICES: dict[str, Callable[[float, int, int], list[float]]] = {  # timm's matrices for its geometric ops
    "Rotate": _rotate_matrix,
    "ShearX": lambda v, w, h: [1, v, 0, 0, 1, 0],
    "ShearY": lambda v, w, h: [1, 0, 0, v, 1, 0],
    "TranslateX": lambda v, w, h: [1, 0, v, 0, 1, 0],
    "TranslateY": lambda v, w, h: [1, 0, 0, 0, 1, v],
    "TranslateXRel": lambda v, w, h: [1, 0, v * w, 0, 1, 0],
    "TranslateYRel": lambda v, w, h: [1, 0, 0, 0, 1, v * h],
}

#: (x, y): the axes along which an op's matrix moves every pixel by a whole number of pixels, for every level (the
#: shears and translations along the other axis); the integer translations of an unlucky level are not singled out
#: (the full kernel gives the same pixels there, its fraction being 0)
STILL_AXES: dict[str, tuple[bool, bool]] = {
    "Rotate": (False, False), "ShearX": (False, True), "TranslateX": (False, True), "TranslateXRel": (False, True),
    "ShearY": (True, False), "TranslateY": (True, False), "TranslateYRel": (True, False),
}
