"""timm's RandAugment on batches of uint8 images, on any torch device, with a random draw per sample.

``DeviceRandAugment(config_str, img_size, mean)`` builds timm's own ``RandAugment`` from the string (so the parsing,
the op list, ``prob``, the magnitude noise and the choice weights are timm's) and replaces each op's PIL function by
a batched one: for each layer the batch is sorted by the op each sample drew (one gather), every op runs once on its
contiguous slice with the samples' own level arguments (an empty slice too, so the operators dispatched per batch are
the same whatever its size and draws), and the slices go back in the batch's order (one concatenation, one gather);
quantised to uint8 after every op as PIL is. The pixel arithmetic follows Pillow's C code
(the float32 blend of ``Image.blend``, the ITU-R 601 luma of ``convert("L")``, the SMOOTH kernel, the histogram
look-up tables of autocontrast and equalize, and the affine resampling of ``Image.transform``: the source position of
each pixel centre, PIL's bilinear and a = -1 bicubic kernels with clamped taps, truncation to uint8, ``fillcolor``
where the source falls outside the picture).

The random draws come from torch's global generator on the CPU (so ``torch.manual_seed`` makes a batch reproducible
and a checkpoint of the global RNG state resumes exactly); the sorting, the levels and the affine matrices are
worked out there too and move to the images' device in one copy per batch.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from PIL import Image
from timm.data.auto_augment import rand_augment_transform

from .augment_geometry import MATRICES as _MATRICES
from .augment_geometry import STILL_AXES
from .augment_geometry import affine as _affine

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
    # bits >= 8 keeps the image, bits <= 0 masks every bit (quest.data.pipelines.transforms.posterize: black)
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
    mean = luma.sum(dim=(1, 2, 3), dtype=torch.int64).double() / (luma.shape[-2] * luma.shape[-1])  # ImageStat's mean
    grey = torch.trunc(mean + 0.5).to(torch.uint8)
    return _blend(_per_sample(grey).expand_as(x), x, factor)


def _brightness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return _blend(torch.zeros_like(x), x, factor)


def _sharpness(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    return _blend(_smooth(x), x, factor)


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
        self._fills: dict[str, torch.Tensor] = {}  # the fill colour per device, copied once

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
        device = images.device
        plan, group_counts = self._plan(draws, *images.shape[-2:])
        plan = plan.to(device, non_blocking=True)  # one host-to-device copy
        if str(device) not in self._fills:
            self._fills[str(device)] = self.fill.to(device)
        fill, out = self._fills[str(device)], images
        for layer, counts in enumerate(group_counts):
            order, inverse = plan[layer, :, 0].long(), plan[layer, :, 1].long()
            level, matrices = plan[layer, :, 2], plan[layer, :, 3:]
            grouped, pieces, at = out[order], [], 0  # the batch sorted by the op each image drew
            for (op, bicubic), count in zip(self._groups, counts):  # every group, empty or not: a fixed count
                chunk = grouped[at:at + count]
                if op.name in _MATRICES:
                    pieces.append(_affine(chunk, matrices[at:at + count], bicubic, fill, STILL_AXES[op.name]))
                else:
                    pieces.append(_PIXEL_OPS[op.name](chunk, level[at:at + count]))
                at += count
            pieces.append(grouped[at:])  # the images whose op did not apply (its probability)
            out = torch.cat(pieces)[inverse]
        return out.clone() if out is images else out

    def _plan(self, draws: Draws, h: int, w: int) -> tuple[torch.Tensor, list[list[int]]]:
        """(layers, n, 9) float64 on the CPU: per layer, the order that sorts the batch by group, its inverse, and
        in that order each image's level and affine matrix (zeros for pixel ops); and per layer the images in each
        group (python ints: the device is never asked)."""
        n, groups = draws.op_index.shape[0], len(self._groups)
        plan, counts = torch.zeros(self.num_layers, n, 9, dtype=torch.float64), []
        for layer in range(self.num_layers):
            group = self._group_of(draws, layer, groups)
            counts.append(torch.bincount(group, minlength=groups + 1)[:groups].tolist())
            order = torch.argsort(group, stable=True)
            plan[layer, :, 0] = order.double()
            plan[layer, :, 1] = torch.argsort(order).double()
            plan[layer, :, 2] = draws.level[order, layer]
            # the matrices: python floats as timm computes them (Rotate's rounding to 15 decimals included); host
            # arithmetic over the drawn levels, no tensor operation per image
            ops, levels = draws.op_index[order, layer].tolist(), plan[layer, :, 2].tolist()
            rows = [_MATRICES[self.ops[k].name](v, w, h) if self.ops[k].name in _MATRICES else [0.0] * 6
                    for k, v in zip(ops, levels)]
            plan[layer, :, 3:] = torch.tensor(rows, dtype=torch.float64).view(n, 6)
        return plan, counts

    @property
    def _groups(self) -> list[tuple[object, bool]]:
        """(op, bicubic) for each batched group: a pixel op once, a geometric op once per kernel the draws can pick."""
        kernels = _INTERPOLATIONS[self.interpolation]
        return [(op, b) for op in self.ops for b in (kernels if op.name in _MATRICES else (True,))]

    def _group_of(self, draws: Draws, layer: int, identity: int) -> torch.Tensor:
        """(n,) int64 on the CPU: each image's group index in :attr:`_groups` at this layer; ``identity`` (the number
        of groups) where its op did not apply."""
        kernels = _INTERPOLATIONS[self.interpolation]
        lookup, g = torch.full((len(self.ops), 2), identity, dtype=torch.int64), 0
        for k, op in enumerate(self.ops):
            if op.name in _MATRICES:  # one group per kernel, in the order of _groups
                for j, b in enumerate(kernels):
                    lookup[k, int(b)] = g + j
                g += len(kernels)
            else:  # the kernel flag means nothing to a pixel op
                lookup[k] = g
                g += 1
        group = lookup[draws.op_index[:, layer], draws.bicubic[:, layer].long()]
        return torch.where(draws.applied[:, layer], group, identity)

    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        """Draw for this batch and apply."""
        return self.apply(images, self.draw(images.shape[0] if isinstance(images, torch.Tensor) else 0))
