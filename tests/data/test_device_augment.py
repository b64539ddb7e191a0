"""quest.data.pipelines.device_augment against timm's RandAugment: the pixels of each op for fixed levels against timm's own
PIL op functions, the draws' distributions against timm's sampler (two-sample tests, with negative controls that must
be rejected), determinism under torch's global seed, and the refusals."""
from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
import timm.data.auto_augment as timm_aa
import torch
from PIL import Image
from scipy.stats import chi2_contingency, ks_2samp

import quest.data.pipelines.transforms  # noqa: F401  (timm's posterize as Pillow < 13 has it: bits <= 0 gives black)
from quest.data.pipelines.device_augment import _MATRICES, _PIXEL_OPS, DeviceRandAugment, Draws, _affine

MEAN = (0.485, 0.456, 0.406)
FILL = tuple(min(255, round(255 * v)) for v in MEAN)  # the img_mean timm's create_transform passes


def photo(w: int, h: int, seed: int = 0) -> np.ndarray:
    """A photo-like RGB picture: smooth gradients, a disc and a block with hard edges, sensor-like noise."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([255 * xx / w, 255 * yy / h, 128 + 100 * np.sin(xx / 7 + yy / 11)], -1)
    img[(xx - w / 2) ** 2 + (yy - h / 3) ** 2 < (min(w, h) / 4) ** 2] = [250, 30, 60]
    img[int(h * 0.7):, : w // 3] = [10, 200, 240]
    img += rng.normal(0, 6, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


# Level arguments as timm's level functions produce them (both signs where there is one; the ends of the ranges).
LEVELS = {
    "AutoContrast": [None], "Equalize": [None], "Invert": [None],
    "Posterize": [0, 1, 2, 4, 8], "Solarize": [0, 100, 128, 256], "SolarizeAdd": [0, 50, 110],
    "Color": [0.1, 0.55, 1.0, 1.45, 1.9], "Contrast": [0.1, 0.7, 1.3, 1.9], "Brightness": [0.1, 0.55, 1.45, 1.9],
    "Sharpness": [0.1, 0.5, 1.5, 1.9], "Desaturate": [0.5, 0.8, 1.0],
    "Rotate": [-30.0, -13.7, 0.0, 5.0, 27.3], "ShearX": [-0.3, -0.11, 0.27], "ShearY": [-0.3, 0.13],
    "TranslateX": [-100.8, 37.5], "TranslateY": [-20.25, 61.0],
    "TranslateXRel": [-0.45, -0.1, 0.2, 0.405], "TranslateYRel": [-0.3, 0.405],
}
CASES = [(name, level, bicubic) for name, levels in LEVELS.items() for level in levels
         for bicubic in ((True, False) if name in _MATRICES else (True,))]


def batched(name: str, x: torch.Tensor, level, bicubic: bool) -> torch.Tensor:
    w, h = x.shape[-1], x.shape[-2]
    if name in _MATRICES:
        matrices = torch.tensor([_MATRICES[name](level, w, h)], dtype=torch.float64)
        return _affine(x, matrices, bicubic, torch.tensor(FILL, dtype=torch.uint8))
    return _PIXEL_OPS[name](x, torch.tensor([0.0 if level is None else level], dtype=torch.float64))


@pytest.mark.parametrize("size", [(64, 48), (224, 224)], ids=["64x48", "224x224"])
@pytest.mark.parametrize(("name", "level", "bicubic"), CASES)
def test_op_pixels_match_timm_pil_op(name, level, bicubic, size):
    """Every op follows Pillow's C arithmetic (float32 blends, fixed-point luma, SMOOTH's float32 sums, the
    histogram look-up tables, the affine transform's pixel-centre mapping, its a = -1 bicubic and bilinear kernels
    with clamped taps and truncation, fillcolor outside), so the measured difference is 0 for every op, level and
    size here, geometric ops included: the tolerance is exact equality, and any drift in the arithmetic fails it."""
    array = photo(*size)
    resample = Image.Resampling.BICUBIC if bicubic else Image.Resampling.BILINEAR
    args = () if level is None else (level,)
    expected = np.asarray(timm_aa.NAME_TO_OP[name](Image.fromarray(array), *args, fillcolor=FILL, resample=resample))
    got = batched(name, torch.from_numpy(array).permute(2, 0, 1)[None].contiguous(), level, bicubic)
    np.testing.assert_array_equal(got[0].permute(1, 2, 0).numpy(), expected)


def test_batch_with_per_sample_levels_equals_one_at_a_time():
    """Samples in one batch drawing different ops and levels give exactly what each gives alone."""
    augment = DeviceRandAugment("rand-m9-mstd0.5-inc1", 64, MEAN)
    names = [op.name for op in augment.ops]
    pictures = torch.stack([torch.from_numpy(photo(64, 48, seed)).permute(2, 0, 1) for seed in range(8)])
    layers = [("Rotate", 20.0, "SolarizeIncreasing", 30.0), ("Rotate", -7.5, "Equalize", 0.0),
              ("ContrastIncreasing", 1.6, "Rotate", 3.0), ("ContrastIncreasing", 0.3, "ShearX", -0.2),
              ("PosterizeIncreasing", 1.0, "PosterizeIncreasing", 3.0), ("TranslateYRel", 0.31, "Invert", 0.0),
              ("SharpnessIncreasing", 1.8, "TranslateYRel", -0.2), ("Rotate", 20.0, "AutoContrast", 0.0)]
    draws = Draws(op_index=torch.tensor([[names.index(a), names.index(b)] for a, _, b, _ in layers]),
                  applied=torch.tensor([[True, True]] * 7 + [[False, True]]),
                  level=torch.tensor([[la, lb] for _, la, _, lb in layers], dtype=torch.float64),
                  bicubic=torch.tensor([[True, False], [False, True]] * 4))
    together = augment.apply(pictures, draws)
    for i in range(len(layers)):
        alone = augment.apply(pictures[i:i + 1], Draws(*(t[i:i + 1] for t in
                                                         (draws.op_index, draws.applied, draws.level, draws.bicubic))))
        assert torch.equal(together[i:i + 1], alone), layers[i]
    assert torch.equal(together[7], batched("AutoContrast", pictures[7:8], None, True)[0])  # layer 0 not applied


@pytest.mark.parametrize("config", ["rand-m9-mstd0.5-inc1", "rand-m7-mstd0.5", "rand-m12-mmax15-tweights"])
def test_level_functions_equal_timms_for_both_signs(config, monkeypatch):
    """For fixed magnitudes and each sign, the vectorised level function equals timm's own (its int() truncations,
    clamps and the random sign) -- timm's sign comes from random.random() > 0.5, patched here."""
    from quest.data.pipelines import device_augment as da
    augment = DeviceRandAugment(config, 224, MEAN)
    magnitudes = torch.linspace(0, 15, 61, dtype=torch.float64)
    for negate in (False, True):
        monkeypatch.setattr(timm_aa.random, "random", lambda negate=negate: 0.9 if negate else 0.1)
        for op in augment.ops:
            if op.level_fn is None:
                continue
            sign = torch.full_like(magnitudes, -1.0 if negate else 1.0)
            ours = da._LEVELS[op.name](magnitudes, sign, op.hparams).tolist()
            theirs = [float(op.level_fn(m, op.hparams)[0]) for m in magnitudes.tolist()]
            assert ours == theirs, (op.name, negate)


# --- distributions ------------------------------------------------------------------------------------------------
SAMPLES = 3000


def timm_records(config: str, n: int) -> list[list[tuple[str, float]]]:
    """Run timm's RandAugment on n tiny pictures with every op's aug_fn replaced by a recorder: per image, the
    (op name, level argument) of each op it applied."""
    transform = timm_aa.rand_augment_transform(config, dict(translate_const=100, img_mean=FILL,
                                                            interpolation=Image.Resampling.BICUBIC))
    current: list[tuple[str, float]] = []
    for op in transform.ops:
        op.aug_fn = lambda img, *args, _name=op.name, **_: current.append((_name, float(args[0]) if args else 0.)) \
            or img
    random.seed(0)
    np.random.seed(0)
    picture, records = Image.new("RGB", (4, 4)), []
    for _ in range(n):
        current = []
        transform(picture)
        records.append(current)
    return records


def device_records(config: str, n: int) -> list[list[tuple[str, float]]]:
    augment = DeviceRandAugment(config, 224, MEAN)
    torch.manual_seed(0)
    d = augment.draw(n)
    names = [op.name for op in augment.ops]
    return [[(names[k], lv) for k, on, lv in zip(d.op_index[i].tolist(), d.applied[i].tolist(), d.level[i].tolist())
             if on] for i in range(n)]


def compare(theirs, ours) -> dict[str, float]:
    """p-values of two-sample tests: op frequencies and ops per image (chi-square contingency), per op the level
    magnitudes (Kolmogorov-Smirnov) and the share of negative levels (chi-square)."""
    def table(a: Counter, b: Counter) -> np.ndarray:
        keys = sorted(set(a) | set(b))
        return np.array([[a[k] for k in keys], [b[k] for k in keys]])

    flat_t, flat_o = [r for rs in theirs for r in rs], [r for rs in ours for r in rs]
    p = {"op frequency": chi2_contingency(table(Counter(n for n, _ in flat_t), Counter(n for n, _ in flat_o)))[1],
         "ops per image": chi2_contingency(table(Counter(map(len, theirs)), Counter(map(len, ours))))[1]}
    for name in sorted({n for n, _ in flat_t}):
        lt = np.array([v for n, v in flat_t if n == name])
        lo = np.array([v for n, v in flat_o if n == name])
        if len(lo) == 0:
            p[f"{name} present"] = 0.0
            continue
        if np.ptp(np.abs(np.concatenate([lt, lo]))) > 0:
            p[f"{name} magnitude"] = ks_2samp(np.abs(lt), np.abs(lo)).pvalue
        negative = np.array([[(lt < 0).sum(), (lt >= 0).sum()], [(lo < 0).sum(), (lo >= 0).sum()]])
        if negative[:, 0].sum() > 0:
            p[f"{name} sign"] = chi2_contingency(negative)[1]
    return p


# With fixed seeds the p-values are fixed numbers; 1e-4 per statistic over ~45 statistics keeps a false alarm
# unlikely for any seed (~0.5%), while the controls below give p-values far under it.
ALPHA = 1e-4


@pytest.mark.parametrize("config", ["rand-m9-mstd0.5-inc1", "rand-m6-n3-mstd101-p0.7", "rand-m12-mmax15-mstd1-tweights"])
def test_draws_follow_timms_distributions(config):
    theirs, ours = timm_records(config, SAMPLES), device_records(config, SAMPLES)
    p = compare(theirs, ours)
    assert min(p.values()) > ALPHA, {k: v for k, v in p.items() if v <= ALPHA}
    if "tweights" in config:  # timm's weighted choice is without replacement: no op twice in an image
        assert all(len({n for n, _ in r}) == len(r) for r in ours)


@pytest.mark.parametrize("control", ["rand-m8-mstd0.5-inc1", "rand-m9-mstd0-inc1", "rand-m9-mstd0.5-inc1-p1.0",
                                     "rand-m9-mstd0.5-inc0", "rand-m9-n3-mstd0.5-inc1"])
def test_distribution_comparison_rejects_a_different_sampler(control):
    """Negative controls: the same statistics reject a sampler built with another magnitude, no magnitude noise,
    prob 1, the non-increasing op list or three layers, against timm's DeiT sampler."""
    p = compare(timm_records("rand-m9-mstd0.5-inc1", SAMPLES), device_records(control, SAMPLES))
    assert min(p.values()) < ALPHA, p


# --- determinism, devices, refusals -------------------------------------------------------------------------------
def test_seeded_batches_repeat_and_keep_dtype_and_device():
    augment = DeviceRandAugment("rand-m9-mstd0.5-inc1", 48, MEAN)
    images = torch.stack([torch.from_numpy(photo(48, 40, s)).permute(2, 0, 1) for s in range(16)])
    torch.manual_seed(3)
    first = augment(images)
    torch.manual_seed(3)
    second = augment(images)
    assert torch.equal(first, second) and first.dtype == torch.uint8 and first.device == images.device
    assert not torch.equal(first, images)  # 16 pictures, 32 layers at p 0.5: something applied
    assert augment(images[:1]).shape == (1, 3, 40, 48)
    assert augment(images[:0]).shape == (0, 3, 40, 48)


@pytest.mark.cuda  # tests/conftest.py: only under QUEST_TEST_GPU=1, on a machine with CUDA
def test_cuda_equals_cpu():
    augment = DeviceRandAugment("rand-m9-mstd0.5-inc1", 64, MEAN)
    images = torch.stack([torch.from_numpy(photo(64, 48, s)).permute(2, 0, 1) for s in range(32)])
    draws = augment.draw(32)
    on_cuda = augment.apply(images.cuda(), draws)
    assert on_cuda.device.type == "cuda" and torch.equal(on_cuda.cpu(), augment.apply(images, draws))


@pytest.mark.parametrize(("images", "message"), [
    (torch.zeros(2, 3, 8, 8), "uint8"), (torch.zeros(3, 8, 8, dtype=torch.uint8), r"\(N, 3, H, W\)"),
    (torch.zeros(2, 1, 8, 8, dtype=torch.uint8), r"\(N, 3, H, W\)"), (np.zeros((2, 3, 8, 8), np.uint8), "uint8")])
def test_bad_images_are_refused(images, message):
    with pytest.raises(ValueError, match=message):
        DeviceRandAugment("rand-m9-mstd0.5-inc1", 8, MEAN)(images)


@pytest.mark.parametrize(("config", "named"), [
    ("augmix-m5", "augmix"), ("v0", "v0"), ("rand-m9-foo3", "foo3"), ("rand-m9-foo", "foo"),
    ("rand-m9.5", "'m' needs an integer"), ("rand-tfoo", "tfoo"), ("rand-m9-t3a", "GaussianBlur"), (None, "None")])
def test_unsupported_configs_are_refused(config, named):
    with pytest.raises(ValueError, match=named):
        DeviceRandAugment(config, 224, MEAN)


def test_unsupported_interpolation_is_refused():
    with pytest.raises(ValueError, match="nearest"):
        DeviceRandAugment("rand-m9", 224, MEAN, interpolation="nearest")
