"""The 19 ImageNet-C corruptions for any image size, working on current NumPy / SciPy / scikit-image.

Ten come unchanged from ``imagecorruptions`` 1.1.2 (Apache-2.0, bethgelab; the ImageNet-C code generalised to any
size). Nine are re-implemented or wrapped here, ported line by line from that package with these changes only:

- ``gaussian_blur``, ``glass_blur``: skimage's ``gaussian(multichannel=True)`` was removed -> ``channel_axis=-1``.
  ``glass_blur``'s pixel loop draws the same random numbers in one call and runs on a flat list (about 8x faster
  at 224 px); it keeps ImageNet-C's exact behaviour, including that its "swap" of two RGB pixels is a copy (numpy
  views).
- ``fog``: ``np.float_`` was removed in NumPy 2 -> ``np.float64``.
- ``impulse_noise``: current scikit-image's ``random_noise`` ignores NumPy's global RNG (a fresh unseeded
  Generator each call, so results were not reproducible); it gets a Generator seeded from the global RNG.
- ``spatter``: when the thresholded liquid layer is empty (common on small images) the package divides 0 by 0
  and returns NaN everywhere; the limit, the image without spatter, is returned instead.
- ``frost``: reads the package's frost images once (no ``pkg_resources``); on images smaller than 224 px the frost
  texture is first shrunk by side/224 (as CIFAR-10-C and Tiny-ImageNet-C shrink it), so a crop shows frost
  crystals rather than one near-uniform patch. From 224 px up: unchanged.
- ``motion_blur``, ``snow``: on images smaller than the blur kernel the package drops the kernel taps that leave
  the image without renormalising, which darkens small images (up to ~28% at 16 px, severity 5); the applied taps
  are renormalised. Identical whenever no tap is dropped (any image of 42 px or more).
- ``zoom_blur``: below 32 px (the package's stated minimum) the package's whole-pixel crop before zooming rounds
  most zoom factors to 1; a sub-pixel zoom about the centre is used there. From 32 px up: unchanged.

All randomness goes through NumPy's global RNG, as in ImageNet-C: :func:`corrupt` seeds it per call and restores
the caller's state afterwards. ``imagecorruptions`` imports ``pkg_resources`` (gone from setuptools >= 81): it is
imported with a stand-in that resolves its package files, removed again right after.
"""
from __future__ import annotations

import importlib.util
import math
import sys
import types
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image

from quest.runtime.extras import require

__all__ = ["CORRUPTIONS", "corrupt", "sample_seed"]

_IMAGENET_C_SIZE = 224


def _package_dir() -> Path:
    spec = importlib.util.find_spec("imagecorruptions")
    if spec is None or spec.origin is None:
        require("imagecorruptions", "eval", "the ImageNet-C corruptions")
    return Path(spec.origin).parent


@lru_cache(maxsize=None)
def _ic() -> types.ModuleType:
    """``imagecorruptions.corruptions``, imported without needing setuptools' ``pkg_resources``."""
    added = "pkg_resources" not in sys.modules
    if added:
        shim = types.ModuleType("pkg_resources")
        shim.resource_filename = lambda package, name: str(_package_dir() / name)  # type: ignore[attr-defined]
        sys.modules["pkg_resources"] = shim
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # scipy.ndimage.interpolation
            return require("imagecorruptions.corruptions", "eval", "the ImageNet-C corruptions")
    finally:
        if added:
            del sys.modules["pkg_resources"]


def impulse_noise(x: Image.Image, severity: int = 1) -> np.ndarray:
    random_noise = require("skimage.util", "eval", "the impulse_noise corruption").random_noise

    c = [0.03, 0.06, 0.09, 0.17, 0.27][severity - 1]
    # scikit-image >= 0.19 draws from a fresh unseeded Generator unless given one; ImageNet-C's version drew from
    # NumPy's global RNG. The Generator is seeded from the global RNG, so the seed of `corrupt` decides everything.
    rng = np.random.default_rng(np.random.randint(0, 2**31 - 1))
    return np.clip(random_noise(np.array(x) / 255.0, mode="s&p", amount=c, rng=rng), 0, 1) * 255


def _gaussian(x: np.ndarray, sigma: float) -> np.ndarray:
    gaussian = require("skimage.filters", "eval", "the blur corruptions").gaussian

    return gaussian(x, sigma=sigma, channel_axis=-1)


def gaussian_blur(x: Image.Image, severity: int = 1) -> np.ndarray:
    c = [1, 2, 3, 4, 6][severity - 1]
    return np.clip(_gaussian(np.array(x) / 255.0, c), 0, 1) * 255


def glass_blur(x: Image.Image, severity: int = 1) -> np.ndarray:
    # sigma, max_delta, iterations
    c = [(0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2)][severity - 1]
    sigma, delta, iterations = c
    img = np.uint8(_gaussian(np.array(x) / 255.0, sigma) * 255)
    h_size, w_size, channels = img.shape
    rows = range(h_size - delta, delta, -1)
    cols = range(w_size - delta, delta, -1)
    # ImageNet-C draws (dx, dy) per pixel with np.random.randint(-delta, delta, size=(2,)); one call of the same
    # total size yields the same numbers in the same order.
    offsets = np.random.randint(-delta, delta, size=(iterations * len(rows) * len(cols), 2)).tolist()
    pixels = [tuple(p) for p in img.reshape(-1, channels).tolist()]
    k = 0
    for _ in range(iterations):
        for h in rows:
            for w in cols:
                dx, dy = offsets[k]
                k += 1
                # ImageNet-C's `x[h, w], x[h', w'] = x[h', w'], x[h, w]` on RGB views copies (h', w') into (h, w)
                # and leaves (h', w') as it was; kept, since ImageNet-C was made this way.
                pixels[h * w_size + w] = pixels[(h + dy) * w_size + (w + dx)]
    img = np.asarray(pixels, dtype=np.uint8).reshape(h_size, w_size, channels)
    return np.clip(_gaussian(img / 255.0, sigma), 0, 1) * 255


def _plasma_fractal(mapsize: int = 256, wibbledecay: float = 3) -> np.ndarray:
    """imagecorruptions' diamond-square height map with np.float64 for the removed np.float_."""
    assert mapsize & (mapsize - 1) == 0
    maparray = np.empty((mapsize, mapsize), dtype=np.float64)
    maparray[0, 0] = 0
    stepsize = mapsize
    wibble = 100.0

    def wibbledmean(array):
        return array / 4 + wibble * np.random.uniform(-wibble, wibble, array.shape)

    def fillsquares():
        cornerref = maparray[0:mapsize:stepsize, 0:mapsize:stepsize]
        squareaccum = cornerref + np.roll(cornerref, shift=-1, axis=0)
        squareaccum += np.roll(squareaccum, shift=-1, axis=1)
        maparray[stepsize // 2:mapsize:stepsize, stepsize // 2:mapsize:stepsize] = wibbledmean(squareaccum)

    def filldiamonds():
        size = maparray.shape[0]
        drgrid = maparray[stepsize // 2:size:stepsize, stepsize // 2:size:stepsize]
        ulgrid = maparray[0:size:stepsize, 0:size:stepsize]
        # sums grouped as in the original, so results are bit-identical
        ltsum = (drgrid + np.roll(drgrid, 1, axis=0)) + (ulgrid + np.roll(ulgrid, -1, axis=1))
        maparray[0:size:stepsize, stepsize // 2:size:stepsize] = wibbledmean(ltsum)
        ttsum = (drgrid + np.roll(drgrid, 1, axis=1)) + (ulgrid + np.roll(ulgrid, -1, axis=0))
        maparray[stepsize // 2:size:stepsize, 0:size:stepsize] = wibbledmean(ttsum)

    while stepsize >= 2:
        fillsquares()
        filldiamonds()
        stepsize //= 2
        wibble /= wibbledecay
    maparray -= maparray.min()
    return maparray / maparray.max()


def fog(x: Image.Image, severity: int = 1) -> np.ndarray:
    c = [(1.5, 2), (2.0, 2), (2.5, 1.7), (2.5, 1.5), (3.0, 1.4)][severity - 1]
    shape = np.array(x).shape
    map_size = 1 << (int(max(shape)) - 1).bit_length()  # next power of two
    img = np.array(x) / 255.0
    max_val = img.max()
    img += c[0] * _plasma_fractal(mapsize=map_size, wibbledecay=c[1])[: shape[0], : shape[1]][..., np.newaxis]
    return np.clip(img * max_val / (max_val + c[0]), 0, 1) * 255


@lru_cache(maxsize=None)
def _frost_textures() -> tuple[np.ndarray, ...]:
    cv2 = require("cv2", "eval", "the ImageNet-C corruptions")

    names = ["frost1.png", "frost2.png", "frost3.png", "frost4.jpg", "frost5.jpg", "frost6.jpg"]
    textures = tuple(cv2.imread(str(_package_dir() / "frost" / n)) for n in names)  # BGR, alpha dropped
    if any(t is None for t in textures):
        raise FileNotFoundError(f"cannot read the frost images in {_package_dir() / 'frost'}")
    return textures


@lru_cache(maxsize=64)
def _frost_texture(idx: int, h: int, w: int) -> np.ndarray:
    """Frost image ``idx`` resized for an h x w image (deterministic, so cached; the crop is drawn per call)."""
    cv2 = require("cv2", "eval", "the ImageNet-C corruptions")

    texture = _frost_textures()[idx]
    shrink = min(1.0, max(h, w) / _IMAGENET_C_SIZE)
    if shrink < 1.0:
        size = (max(1, round(texture.shape[1] * shrink)), max(1, round(texture.shape[0] * shrink)))
        texture = cv2.resize(texture, dsize=size, interpolation=cv2.INTER_AREA)
    # imagecorruptions: make the texture cover the image (x1.1 so the crop has room)
    fh, fw = texture.shape[:2]
    scale = max(1.0, h / fh, w / fw) * 1.1
    return cv2.resize(texture, dsize=(int(np.ceil(fw * scale)), int(np.ceil(fh * scale))),
                      interpolation=cv2.INTER_CUBIC)


def frost(x: Image.Image, severity: int = 1) -> np.ndarray:
    c = [(1, 0.4), (0.8, 0.6), (0.7, 0.7), (0.65, 0.7), (0.6, 0.75)][severity - 1]
    idx = np.random.randint(5)  # ImageNet-C never picks the sixth image
    img = np.array(x)
    h, w = img.shape[:2]
    texture = _frost_texture(idx, h, w)
    top = np.random.randint(0, texture.shape[0] - h)
    left = np.random.randint(0, texture.shape[1] - w)
    texture = texture[top:top + h, left:left + w][..., [2, 1, 0]]
    return np.clip(c[0] * img + c[1] * texture, 0, 255)


def _motion_blur(x: np.ndarray, radius: int, sigma: float, angle: float) -> np.ndarray:
    """imagecorruptions' shifted-copies motion blur, renormalised by the taps that stayed inside the image."""
    ic = _ic()
    width = radius * 2 + 1
    kernel = ic.getMotionBlurKernel(width, sigma)
    point = (width * np.sin(np.deg2rad(angle)), width * np.cos(np.deg2rad(angle)))
    hypot = math.hypot(point[0], point[1])
    blurred = np.zeros_like(x, dtype=np.float32)
    applied = 0.0
    for i in range(width):
        dy = -math.ceil(((i * point[0]) / hypot) - 0.5)
        dx = -math.ceil(((i * point[1]) / hypot) - 0.5)
        if abs(dy) >= x.shape[0] or abs(dx) >= x.shape[1]:
            break  # the motion left the image: the remaining taps would sample nothing
        blurred = blurred + kernel[i] * ic.shift(x, dx, dy)
        applied += kernel[i]
    return blurred if applied >= 1.0 - 1e-6 else blurred / applied


def motion_blur(x: Image.Image, severity: int = 1) -> np.ndarray:
    c = [(10, 3), (15, 5), (15, 8), (15, 12), (20, 15)][severity - 1]
    angle = np.random.uniform(-45, 45)
    return np.clip(_motion_blur(np.array(x), radius=c[0], sigma=c[1], angle=angle), 0, 255)


def snow(x: Image.Image, severity: int = 1) -> np.ndarray:
    cv2 = require("cv2", "eval", "the ImageNet-C corruptions")

    c = [(0.1, 0.3, 3, 0.5, 10, 4, 0.8), (0.2, 0.3, 2, 0.5, 12, 4, 0.7), (0.55, 0.3, 4, 0.9, 12, 8, 0.7),
         (0.55, 0.3, 4.5, 0.85, 12, 8, 0.65), (0.55, 0.3, 2.5, 0.85, 12, 12, 0.55)][severity - 1]
    img = np.array(x, dtype=np.float32) / 255.0
    snow_layer = np.random.normal(size=img.shape[:2], loc=c[0], scale=c[1])
    snow_layer = _ic().clipped_zoom(snow_layer[..., np.newaxis], c[2])
    snow_layer[snow_layer < c[3]] = 0
    snow_layer = np.clip(snow_layer.squeeze(), 0, 1)
    snow_layer = _motion_blur(snow_layer, radius=c[4], sigma=c[5], angle=np.random.uniform(-135, -45))
    snow_layer = np.round(snow_layer * 255).astype(np.uint8) / 255.0
    snow_layer = snow_layer[..., np.newaxis][: img.shape[0], : img.shape[1], :]
    gray = cv2.cvtColor(img, cv2.COLOR_RGB2GRAY).reshape(img.shape[0], img.shape[1], 1)
    img = c[6] * img + (1 - c[6]) * np.maximum(img, gray * 1.5 + 0.5)
    return np.clip(img + snow_layer + np.rot90(snow_layer, k=2), 0, 1) * 255


def _center_zoom(img: np.ndarray, factor: float) -> np.ndarray:
    """Zoom by ``factor`` about the image centre with bilinear sampling, output the same size."""
    h, w = img.shape[:2]
    inv = 1.0 / factor
    offset = [(h - 1) / 2 * (1 - inv), (w - 1) / 2 * (1 - inv), 0.0]
    ndimage = require("scipy.ndimage", "eval", "the zoom_blur corruption")
    return ndimage.affine_transform(img, [inv, inv, 1.0], offset=offset, order=1, mode="nearest")


def zoom_blur(x: Image.Image, severity: int = 1) -> np.ndarray:
    if min(np.array(x).shape[:2]) >= 32:
        return _ic().zoom_blur(x, severity)
    c = [np.arange(1, 1.11, 0.01), np.arange(1, 1.16, 0.01), np.arange(1, 1.21, 0.02), np.arange(1, 1.26, 0.02),
         np.arange(1, 1.31, 0.03)][severity - 1]
    img = (np.array(x) / 255.0).astype(np.float32)
    out = np.zeros_like(img)
    for factor in c:
        out += _center_zoom(img, float(factor))
    return np.clip((img + out) / (len(c) + 1), 0, 1) * 255


def spatter(x: Image.Image, severity: int = 1) -> np.ndarray:
    """The package's spatter, except when the thresholded liquid layer is empty (common on small images): it then
    divides 0 by 0 and returns NaN everywhere; the limit, no spatter, is returned instead."""
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.asarray(_ic().spatter(x, severity))
    if np.isnan(out).any():
        return np.clip(np.array(x, dtype=np.float32) / 255.0, 0, 1) * 255
    return out


def _unchanged(name: str) -> Callable[[Image.Image, int], np.ndarray]:
    def corruption(x: Image.Image, severity: int = 1) -> np.ndarray:
        return getattr(_ic(), name)(x, severity)

    corruption.__name__ = name
    return corruption


_OWN = {f.__name__: f for f in (impulse_noise, gaussian_blur, glass_blur, fog, frost, motion_blur, snow, zoom_blur,
                                 spatter)}
_ORDER = ["gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
          "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate", "jpeg_compression",
          "speckle_noise", "gaussian_blur", "spatter", "saturate"]
#: name -> corruption(PIL RGB image, severity 1..5) -> array in [0, 255] of the image's size
CORRUPTIONS: dict[str, Callable[[Image.Image, int], np.ndarray]] = {
    name: _OWN.get(name) or _unchanged(name) for name in _ORDER
}


def sample_seed(seed: int, corruption: str, severity: int, index: int) -> int:
    """A 32-bit seed from (seed, corruption, severity, sample index): each sample's corruption is reproducible and
    independent of evaluation order, batch size or the number of processes."""
    return int(np.random.SeedSequence([seed, _ORDER.index(corruption), severity, index]).generate_state(1)[0])


def corrupt(image: np.ndarray | Image.Image, name: str, severity: int, seed: int) -> np.ndarray:
    """``image`` (H x W x 3 uint8, or a PIL image) corrupted by ``name`` at ``severity`` with NumPy's global RNG
    seeded by ``seed``; the caller's RNG state is restored. Returns H x W x 3 uint8 (truncated, as ImageNet-C)."""
    if name not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {name!r}; known: {', '.join(_ORDER)}")
    if severity not in (1, 2, 3, 4, 5):
        raise ValueError(f"severity must be 1..5, got {severity}")
    pil = image if isinstance(image, Image.Image) else Image.fromarray(np.asarray(image, dtype=np.uint8))
    pil = pil.convert("RGB")
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        out = np.asarray(CORRUPTIONS[name](pil, severity))
    finally:
        np.random.set_state(state)
    if out.shape[:2] != (pil.height, pil.width):
        raise RuntimeError(f"{name} returned shape {out.shape} for a {pil.width}x{pil.height} image")
    return np.uint8(out)
