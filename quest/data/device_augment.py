"""timm's RandAugment on batches of uint8 images, on any torch device, with a random draw per sample.

``DeviceRandAugment(config_str, img_size, mean)`` builds timm's own ``RandAugment`` from the string (so the parsing,
the op list, ``prob``, the magnitude noise and the choice weights are timm's) and replaces each op's PIL function by
a batched one: for each layer and each op, the samples that drew it are gathered, transformed with their own level
arguments and written back, quantised to uint8 after every op as PIL is. The pixel arithmetic follows Pillow's C code
(the float32 blend of ``Image.blend``, the ITU-R 601 luma of ``convert("L")``, the SMOOTH kernel, the histogram
look-up tables of autocontrast and equalize, and the affine resampling of ``Image.transform``: the source position of
each pixel centre, PIL's bilinear and a = -1 bicubic kernels with clamped taps, truncation to uint8, ``fillcolor``
where the source falls outside the picture).

The random draws come from torch's global generator on the CPU (so ``torch.manual_seed`` makes a batch reproducible
and a checkpoint of the global RNG state resumes exactly), then move to the images' device.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from PIL import Image
from timm.data.auto_augment import rand_augment_transform

__all__ = ["DeviceRandAugment", "Draws", "SUPPORTED_OPS"]

_LEVEL_DENOM = 10.0  # timm's magnitude scale: level = magnitude / 10
_CONFIG_KEYS = ("mstd", "mmax", "inc", "m", "n", "p")  # timm's numeric sections, longest prefix first
_TRANSFORM_SETS = ("weights", "3a", "3aw")  # the names timm's 't' section knows
_INTERPOLATIONS = {"bilinear": (False,), "bicubic": (True,), "random": (False, True)}  # value: bicubic flags drawn


@dataclass(frozen=True)
class Draws:
    """The random part of one batch, per (sample, layer): which op, whether it applies (timm's ``prob``), its level
    argument after timm's level function (random sign included; 0 for ops without one) and, for geometric ops,
    whether it resamples bicubic (else bilinear)."""

    op_index: torch.Tensor  # (n, layers) int64
    applied: torch.Tensor  # (n, layers) bool
    level: torch.Tensor  # (n, layers) float64
    bicubic: torch.Tensor  # (n, layers) bool


def _check_config(config_str: str) -> None:
    """Refuse, naming it, what timm would reject with an assert or silently ignore."""
    if not isinstance(config_str, str) or config_str.split("-")[0] != "rand":
        raise ValueError(f"RandAugment config {config_str!r}: expected a string 'rand-...' (timm's RandAugment, e.g. "
                         "'rand-m9-mstd0.5-inc1'); other policies (AutoAugment 'v0'/'original', 'augmix-...') have "
                         "no batched version")
    for section in config_str.split("-")[1:]:
        if section.startswith("t"):
            if section[1:] not in _TRANSFORM_SETS:
                raise ValueError(f"RandAugment config {config_str!r}: transform set {section!r} is not one of timm's "
                                 f"{['t' + s for s in _TRANSFORM_SETS]}")
            continue
        key = next((k for k in _CONFIG_KEYS if section.startswith(k)), None)
        value = section[len(key):] if key else ""
        if key is None or not re.fullmatch(r"\d.*", value):
            raise ValueError(f"RandAugment config {config_str!r}: section {section!r} is not supported; expected "
                             f"<key><number> with key one of {list(_CONFIG_KEYS)} or 't<set>'")
        try:
            float(value) if key in ("mstd", "p") else int(value)
        except ValueError:
            kind = "a number" if key in ("mstd", "p") else "an integer"
            raise ValueError(f"RandAugment config {config_str!r}: {key!r} needs {kind}, got {value!r}") from None


# --- level functions: timm's LEVEL_TO_ARG, vectorised (magnitude m float64, sign +1/-1) ---------------------------
def _signed(scale: float) -> Callable:
    return lambda m, sign, hp: (m / _LEVEL_DENOM) * scale * sign


_LEVELS: dict[str, Callable] = {
    "AutoContrast": None, "Equalize": None, "Invert": None,
    "Rotate": _signed(30.0),
    "Posterize": lambda m, s, hp: torch.trunc((m / _LEVEL_DENOM) * 4),
    "PosterizeIncreasing": lambda m, s, hp: 4 - torch.trunc((m / _LEVEL_DENOM) * 4),
    "PosterizeOriginal": lambda m, s, hp: torch.trunc((m / _LEVEL_DENOM) * 4) + 4,
    "Solarize": lambda m, s, hp: torch.trunc((m / _LEVEL_DENOM) * 256).clamp(max=256),
    "SolarizeIncreasing": lambda m, s, hp: 256 - torch.trunc((m / _LEVEL_DENOM) * 256).clamp(max=256),
    "SolarizeAdd": lambda m, s, hp: torch.trunc((m / _LEVEL_DENOM) * 110).clamp(max=128),
    "ShearX": _signed(0.3), "ShearY": _signed(0.3),
    "TranslateX": lambda m, s, hp: (m / _LEVEL_DENOM) * float(hp["translate_const"]) * s,
    "TranslateY": lambda m, s, hp: (m / _LEVEL_DENOM) * float(hp["translate_const"]) * s,
    "TranslateXRel": lambda m, s, hp: (m / _LEVEL_DENOM) * hp.get("translate_pct", 0.45) * s,
    "TranslateYRel": lambda m, s, hp: (m / _LEVEL_DENOM) * hp.get("translate_pct", 0.45) * s,
    "Desaturate": lambda m, s, hp: (0.5 + 0.5 * (m / _LEVEL_DENOM)).clamp(0.5, 1.0),
}
for _name in ("Color", "Contrast", "Brightness", "Sharpness"):
    _LEVELS[_name] = lambda m, s, hp: (m / _LEVEL_DENOM) * 1.8 + 0.1
    _LEVELS[_name + "Increasing"] = lambda m, s, hp: (1.0 + (m / _LEVEL_DENOM) * 0.9 * s).clamp(min=0.1)


# --- pixel ops: x uint8 (B, 3, H, W), level float64 (B,) on x's device ----------------------------------------------
def _per_sample(v: torch.Tensor) -> torch.Tensor:
    return v.view(-1, 1, 1, 1)


def _blend(degenerate: torch.Tensor, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """Image.blend(degenerate, x, factor): C float32 arithmetic, in1 + alpha * (in2 - in1), clipped and truncated."""
    alpha = _per_sample(factor.to(torch.float32))
    diff = (x.to(torch.int16) - degenerate.to(torch.int16)).to(torch.float32)
    return (degenerate.to(torch.float32) + alpha * diff).clamp(0, 255).to(torch.uint8)


def _luma(x: torch.Tensor) -> torch.Tensor:
    """convert("L"): ITU-R 601-2 luma in Pillow's 16-bit fixed point, (B, 1, H, W) uint8."""
    r, g, b = x.to(torch.int32).unbind(1)
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).to(torch.uint8).unsqueeze(1)


def _smooth(x: torch.Tensor) -> torch.Tensor:
    """ImageFilter.SMOOTH (3x3 kernel 1 1 1 / 1 5 1 / 1 1 1, divisor 13) as ImagingFilter3x3 computes it: float32
    kernel weights, sums in its order, +0.5 and truncation; the outer rows and columns are copied."""
    if x.shape[-1] < 3 or x.shape[-2] < 3:
        return x
    k1 = torch.tensor(1.0, dtype=torch.float32) / 13.0
    k5 = torch.tensor(5.0, dtype=torch.float32) / 13.0
    f = x.to(torch.float32)

    def row(r: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:  # KERNEL1x3 over columns 1..W-2
        return r[..., :-2] * k1 + r[..., 1:-1] * centre + r[..., 2:] * k1

    ss = torch.full_like(f[..., 1:-1, 1:-1], 0.5) + row(f[..., 2:, :], k1)
    ss = ss + row(f[..., 1:-1, :], k5)
    ss = ss + row(f[..., :-2, :], k1)
    out = x.clone()
    out[..., 1:-1, 1:-1] = ss.clamp(0, 255).to(torch.uint8)
    return out


def _lut(x: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """Per (sample, channel) look-up table (B, 3, 256) applied to x."""
    b, c, h, w = x.shape
    return lut.clamp(0, 255).to(torch.uint8).gather(2, x.reshape(b, c, h * w).long()).view(b, c, h, w)


def _histogram(x: torch.Tensor) -> torch.Tensor:
    b, c, h, w = x.shape
    offset = torch.arange(b * c, device=x.device).view(b, c, 1) * 256
    flat = (x.reshape(b, c, h * w).long() + offset).reshape(-1)
    return torch.bincount(flat, minlength=b * c * 256).view(b, c, 256)


def _autocontrast(x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
    lo = x.amin(dim=(2, 3)).double().unsqueeze(-1)
    hi = x.amax(dim=(2, 3)).double().unsqueeze(-1)
    scale = 255.0 / (hi - lo).clamp(min=1)
    offset = -lo * scale
    i = torch.arange(256, device=x.device, dtype=torch.float64)
    lut = torch.trunc(i * scale + offset)
    return _lut(x, torch.where(hi > lo, lut, i))  # hi <= lo: ImageOps leaves the channel as it is


def _equalize(x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
    """ImageOps.equalize per image and channel: step = (count - count of the last used value) // 255,
    lut[i] = (step // 2 + pixels below i) // step; identity where step is 0 or one value is used."""
    h = _histogram(x)
    idx = torch.arange(256, device=x.device)
    last = torch.where(h > 0, idx, -1).amax(dim=-1, keepdim=True)
    step = (h.sum(-1, keepdim=True) - h.gather(-1, last)) // 255
    below = torch.cumsum(h, -1) - h
    lut = (step // 2 + below) // step.clamp(min=1)
    return _lut(x, torch.where(step > 0, lut, idx))  # one used value gives step 0, hence identity too


def _invert(x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
    return 255 - x


def _posterize(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    # bits >= 8 keeps the image, bits <= 0 masks every bit (quest.data.transforms.posterize: black)
    shift = (8 - bits.long()).clamp(0, 8)
    mask = ((255 << shift) & 255).to(torch.uint8)
    return x & _per_sample(mask)


def _solarize(x: torch.Tensor, thresh: torch.Tensor) -> torch.Tensor:
    return torch.where(x.to(torch.int16) < _per_sample(thresh.to(torch.int16)), x, 255 - x)


def _solarize_add(x: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
    added = (x.to(torch.int16) + _per_sample(add.to(torch.int16))).clamp(max=255).to(torch.uint8)
    return torch.where(x < 128, added, x)


def _color(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return _blend(_luma(x).expand_as(x), x, factor)


def _desaturate(x: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
    return _color(x, (1.0 - level).clamp(0.0, 1.0))


def _contrast(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    luma = _luma(x)
    mean = luma.sum(dim=(1, 2, 3), dtype=torch.int64).double() / luma[0].numel()  # ImageStat's mean
    grey = torch.trunc(mean + 0.5).to(torch.uint8)
    return _blend(_per_sample(grey).expand_as(x), x, factor)


def _brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return _blend(torch.zeros_like(x), x, factor)


def _sharpness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return _blend(_smooth(x), x, factor)


def _cubic(v1, v2, v3, v4, d):
    """Geometry.c's BICUBIC macro (a = -1) with its operations in its order, so float64 gives PIL's bits; in place
    on temporaries (the values are (channels, pixels), d (1, pixels): contiguous, vectorised broadcasting)."""
    p3 = torch.sub(v1, v2).mul_(2).add_(v3).sub_(v4)  # 2 * (v1 - v2) + v3 - v4
    out = torch.sub(v2, v1).sub_(v3).add_(v4)  # -v1 + v2 - v3 + v4
    out.mul_(d).add_(p3).mul_(d).add_(torch.sub(v3, v1)).mul_(d)  # d * (p2 + d * (p3 + d * p4)), p2 = -v1 + v3
    return out.add_(v2)


def _affine(x: torch.Tensor, matrices: torch.Tensor, bicubic: bool, fill: torch.Tensor) -> torch.Tensor:
    """Image.transform(size, AFFINE, matrix, resample, fillcolor=fill) for each sample: output pixel centre
    (x + .5, y + .5) reads the source at matrix @ (x + .5, y + .5, 1); a source outside [0, W) x [0, H) gives
    ``fill``; inside, PIL's bilinear or bicubic kernel over taps clamped to the picture, truncated to uint8."""
    b, c, h, w = x.shape
    rows_m = matrices.tolist()
    # where a direction's fraction is 0 for every pixel (translations and shears along the other axis), PIL's kernel
    # returns its centre tap exactly, so the other taps are skipped: 4 gathers instead of 16
    still_x = all(m[0] == 1 and m[1] == 0 and float(m[2]).is_integer() for m in rows_m)
    still_y = all(m[3] == 0 and m[4] == 1 and float(m[5]).is_integer() for m in rows_m)
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
    planes = x.permute(1, 0, 2, 3).reshape(c, b * h * w)  # (channels, pixels): gathers along contiguous rows

    def interpolate(v: list[torch.Tensor], d: torch.Tensor) -> torch.Tensor:
        if len(v) == 1:
            return v[0]
        return _cubic(*v, d) if bicubic else v[0] + (v[1] - v[0]) * d

    def row_value(t: int) -> torch.Tensor:
        start = base + (fy.long() + t).clamp(0, h - 1) * w
        return interpolate([planes.index_select(1, (start + cols[s]).view(-1)).double() for s in taps_x], dx)

    value = interpolate([row_value(t) for t in taps_y], dy)
    out = value.clamp_(0, 255).to(torch.uint8).view(c, b, h, w).permute(1, 0, 2, 3)
    return torch.where(inside.unsqueeze(1), out, fill.view(1, c, 1, 1)).contiguous()


def _rotate_matrix(degrees: float, w: int, h: int) -> list[float]:
    """Image.rotate's inverse matrix about the centre (w / 2, h / 2), with its rounding to 15 decimals."""
    angle = -math.radians(degrees % 360.0)
    a, b, d, e = (round(math.cos(angle), 15), round(math.sin(angle), 15),
                  round(-math.sin(angle), 15), round(math.cos(angle), 15))
    cx, cy = w / 2, h / 2
    return [a, b, a * -cx + b * -cy + 0.0 + cx, d, e, d * -cx + e * -cy + 0.0 + cy]


_MATRICES: dict[str, Callable[[float, int, int], list[float]]] = {  # timm's matrices for its geometric ops
    "Rotate": _rotate_matrix,
    "ShearX": lambda v, w, h: [1, v, 0, 0, 1, 0],
    "ShearY": lambda v, w, h: [1, 0, 0, v, 1, 0],
    "TranslateX": lambda v, w, h: [1, 0, v, 0, 1, 0],
    "TranslateY": lambda v, w, h: [1, 0, 0, 0, 1, v],
    "TranslateXRel": lambda v, w, h: [1, 0, v * w, 0, 1, 0],
    "TranslateYRel": lambda v, w, h: [1, 0, 0, 0, 1, v * h],
}

_PIXEL_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "AutoContrast": _autocontrast, "Equalize": _equalize, "Invert": _invert,
    "Posterize": _posterize, "PosterizeIncreasing": _posterize, "PosterizeOriginal": _posterize,
    "Solarize": _solarize, "SolarizeIncreasing": _solarize, "SolarizeAdd": _solarize_add,
    "Color": _color, "ColorIncreasing": _color, "Contrast": _contrast, "ContrastIncreasing": _contrast,
    "Brightness": _brightness, "BrightnessIncreasing": _brightness,
    "Sharpness": _sharpness, "SharpnessIncreasing": _sharpness, "Desaturate": _desaturate,
}
SUPPORTED_OPS = tuple(_PIXEL_OPS) + tuple(_MATRICES)


class DeviceRandAugment:
    """timm's RandAugment for a config string, applied to uint8 batches (N, 3, H, W) with per-sample draws."""

    def __init__(self, config_str: str, img_size: int, mean: Sequence[float], interpolation: str = "bicubic"):
        """``img_size``, ``mean`` and ``interpolation`` give the hparams timm's ``create_transform`` passes:
        translate_const = int(img_size * 0.45), img_mean = mean in 0..255 (the fill of geometric ops), and the
        resampling ('bicubic', 'bilinear', or 'random': one of the two per op application)."""
        _check_config(config_str)
        if interpolation not in _INTERPOLATIONS:
            raise ValueError(f"interpolation {interpolation!r}: expected one of {list(_INTERPOLATIONS)} (PIL's "
                             "affine transform offers no other kernel that grid ops here reproduce)")
        if len(mean) != 3:
            raise ValueError(f"mean {tuple(mean)}: expected 3 channel means in 0..1")
        img_mean = tuple(min(255, round(255 * v)) for v in mean)
        hparams = dict(translate_const=int(img_size * 0.45), img_mean=img_mean)
        if interpolation != "random":
            hparams["interpolation"] = Image.Resampling.BICUBIC if interpolation == "bicubic" else \
                Image.Resampling.BILINEAR
        self.timm_transform = rand_augment_transform(config_str, hparams)  # timm parses; the ops are read from it
        self.config_str, self.interpolation = config_str, interpolation
        self.ops = list(self.timm_transform.ops)
        missing = [op.name for op in self.ops if op.name not in SUPPORTED_OPS]
        if missing:
            raise ValueError(f"RandAugment config {config_str!r}: ops {missing} have no batched version here "
                             f"(supported: {list(SUPPORTED_OPS)})")
        self.num_layers = int(self.timm_transform.num_layers)
        weights = self.timm_transform.choice_weights
        self.choice_weights = None if weights is None else torch.as_tensor(weights, dtype=torch.float64)
        if self.choice_weights is not None and self.num_layers > len(self.ops):
            raise ValueError(f"RandAugment config {config_str!r}: n={self.num_layers} ops without replacement "
                             f"from {len(self.ops)}")
        self.fill = torch.tensor(img_mean, dtype=torch.uint8)

    def __repr__(self) -> str:
        return f"DeviceRandAugment({self.config_str!r}, interpolation={self.interpolation!r})"

    def draw(self, n: int) -> Draws:
        """Draw n samples' ops and levels on the CPU from torch's global generator; the same amount of randomness
        whatever is drawn, so a seed fixes the batch."""
        shape = (n, self.num_layers)
        if self.choice_weights is None:  # np.random.choice with replacement, uniform
            op_index = torch.randint(len(self.ops), shape)
        else:  # np.random.choice(replace=False, p): successive draws, which exponential races with rate p give
            race = -torch.log1p(-torch.rand(n, len(self.ops), dtype=torch.float64)) / self.choice_weights
            op_index = race.argsort(dim=1)[:, :self.num_layers]
        u_apply = torch.rand(shape, dtype=torch.float64)
        noise = torch.randn(shape, dtype=torch.float64)
        u_uniform = torch.rand(shape, dtype=torch.float64)
        sign = torch.where(torch.rand(shape, dtype=torch.float64) > 0.5, -1.0, 1.0)  # timm's _randomly_negate
        u_resample = torch.rand(shape, dtype=torch.float64)
        applied = torch.zeros(shape, dtype=torch.bool)
        level = torch.zeros(shape, dtype=torch.float64)
        for k, op in enumerate(self.ops):
            chosen = op_index == k
            applied[chosen] = (u_apply[chosen] <= op.prob) if op.prob < 1.0 else True
            magnitude = torch.full_like(noise[chosen], float(op.magnitude))
            if op.magnitude_std == float("inf"):
                magnitude = u_uniform[chosen] * op.magnitude
            elif op.magnitude_std > 0:
                magnitude = op.magnitude + op.magnitude_std * noise[chosen]
            magnitude = magnitude.clamp(0.0, float(op.magnitude_max or _LEVEL_DENOM))
            if _LEVELS[op.name] is not None:
                level[chosen] = _LEVELS[op.name](magnitude, sign[chosen], op.hparams).to(torch.float64)
        flags = _INTERPOLATIONS[self.interpolation]
        bicubic = flags[0] if len(flags) == 1 else None
        bicubic = torch.full(shape, bicubic) if bicubic is not None else u_resample >= 0.5
        return Draws(op_index, applied, level, bicubic)

    def apply(self, images: torch.Tensor, draws: Draws) -> torch.Tensor:
        """Apply drawn ops to uint8 images (N, 3, H, W); returns a new uint8 tensor on the same device."""
        if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4 \
                or images.shape[1] != 3:
            got = f"{images.dtype} {tuple(images.shape)}" if isinstance(images, torch.Tensor) else type(images)
            raise ValueError(f"images: expected a uint8 tensor (N, 3, H, W), got {got}")
        if draws.op_index.shape != (images.shape[0], self.num_layers):
            raise ValueError(f"draws for {tuple(draws.op_index.shape)} (samples, layers), expected "
                             f"{(images.shape[0], self.num_layers)}")
        out = images.clone()
        h, w = images.shape[-2:]
        fill = self.fill.to(images.device)
        for layer in range(self.num_layers):  # grouping on the CPU draws: no device sync
            for k, op in enumerate(self.ops):
                for bicubic in (False, True):
                    pick = draws.applied[:, layer] & (draws.op_index[:, layer] == k)
                    if op.name in _MATRICES:
                        pick &= draws.bicubic[:, layer] == bicubic
                    elif bicubic:
                        continue
                    idx = pick.nonzero().squeeze(1)
                    if idx.numel() == 0:
                        continue
                    level = draws.level[idx, layer]
                    dev_idx = idx.to(images.device)
                    if op.name in _MATRICES:
                        matrices = torch.tensor([_MATRICES[op.name](v, w, h) for v in level.tolist()],
                                                dtype=torch.float64)
                        result = _affine(out[dev_idx], matrices, bicubic, fill)
                    else:
                        result = _PIXEL_OPS[op.name](out[dev_idx], level.to(images.device))
                    out[dev_idx] = result
        return out

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """Draw for this batch and apply."""
        return self.apply(images, self.draw(images.shape[0] if isinstance(images, torch.Tensor) else 0))
