"""The 19 corruptions on current NumPy / scikit-image: every one runs on small and 224 px images, is deterministic
under a seed, leaves the caller's RNG alone; the re-implementations match ImageNet-C where they should."""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from skimage.filters import gaussian

from quest.evaluation.corruption_fns import CORRUPTIONS, _ic, corrupt, sample_seed
from quest.evaluation.mce import IMAGENET_C_CORRUPTIONS, IMAGENET_C_EXTRA
from quest.evaluation.suites.corruptions import corruptions

from ..eval_helpers import digits_target, linear_digits_model, make_run, random_images, settings

ALL = IMAGENET_C_CORRUPTIONS + IMAGENET_C_EXTRA


def test_all_19_are_there():
    assert list(CORRUPTIONS) == ALL and len(ALL) == 19


@pytest.mark.parametrize("name", ALL)
def test_runs_on_small_and_224_images_and_is_deterministic(name):
    np.random.seed(123)
    before = np.random.get_state()[1].copy()
    for size, severities in ((16, (1, 2, 3, 4, 5)), (8, (5,)), (224, (3,))):
        image = random_images(1, size, seed=size)[0]
        for severity in severities:
            out = corrupt(image, name, severity, seed=7)
            assert out.shape == (size, size, 3) and out.dtype == np.uint8
            np.testing.assert_array_equal(out, corrupt(image, name, severity, seed=7))
    np.testing.assert_array_equal(np.random.get_state()[1], before)  # global RNG restored


def test_random_corruptions_depend_on_the_seed():
    image = random_images(1, 16)[0]
    for name in ("gaussian_noise", "shot_noise", "impulse_noise", "glass_blur", "motion_blur", "snow", "frost", "fog",
                 "elastic_transform", "speckle_noise"):
        assert not np.array_equal(corrupt(image, name, 5, 1), corrupt(image, name, 5, 2)), name


def test_sample_seed_is_stable_and_distinct():
    assert sample_seed(0, "fog", 3, 17) == sample_seed(0, "fog", 3, 17)
    seeds = {sample_seed(0, c, s, i) for c in ("fog", "snow") for s in (1, 2) for i in range(50)}
    assert len(seeds) == 200


def _reference_glass_blur(x, severity):
    """ImageNet-C's glass_blur with only `multichannel=True` replaced by `channel_axis=-1`."""
    c = [(0.7, 1, 2), (0.9, 2, 1), (1, 2, 3), (1.1, 3, 2), (1.5, 4, 2)][severity - 1]
    x = np.uint8(gaussian(np.array(x) / 255., sigma=c[0], channel_axis=-1) * 255)
    for _ in range(c[2]):
        for h in range(x.shape[0] - c[1], c[1], -1):
            for w in range(x.shape[1] - c[1], c[1], -1):
                dx, dy = np.random.randint(-c[1], c[1], size=(2,))
                h_prime, w_prime = h + dy, w + dx
                x[h, w], x[h_prime, w_prime] = x[h_prime, w_prime], x[h, w]
    return np.clip(gaussian(x / 255., sigma=c[0], channel_axis=-1), 0, 1) * 255


@pytest.mark.parametrize("severity", [1, 5])
def test_glass_blur_matches_imagenet_c(severity):
    image = Image.fromarray(random_images(1, 40)[0])
    np.random.seed(3)
    expected = _reference_glass_blur(image, severity)
    np.random.seed(3)
    np.testing.assert_array_equal(CORRUPTIONS["glass_blur"](image, severity), expected)


def test_fog_matches_imagenet_c(monkeypatch):
    monkeypatch.setattr(np, "float_", np.float64, raising=False)  # what the package needs to run at all
    image = Image.fromarray(random_images(1, 40)[0])
    for severity in (1, 5):
        np.random.seed(4)
        expected = _ic().fog(image, severity)
        np.random.seed(4)
        np.testing.assert_array_equal(CORRUPTIONS["fog"](image, severity), expected)


@pytest.mark.parametrize("name", ["frost", "motion_blur", "snow", "zoom_blur"])
def test_small_image_fixes_leave_224_unchanged(name):
    image = Image.fromarray(random_images(1, 224)[0])
    np.random.seed(5)
    expected = getattr(_ic(), name)(image, 4)
    np.random.seed(5)
    np.testing.assert_allclose(CORRUPTIONS[name](image, 4), expected, rtol=0, atol=1e-4)


def test_motion_blur_keeps_the_brightness_of_small_images():
    grey = np.full((16, 16, 3), 128, dtype=np.uint8)
    assert abs(corrupt(grey, "motion_blur", 5, 0).mean() - 128) < 1.5  # the package's version gives about 92


def test_spatter_without_liquid_returns_the_image():
    # a seed whose thresholded liquid layer is empty on a 16 px image: the package returns NaN there
    image = random_images(1, 16)[0]
    for seed in range(40):
        out = corrupt(image, "spatter", 1, seed)
        assert not np.isnan(out.astype(float)).any()
    np.random.seed(0)
    hits = [s for s in range(40) if np.isnan(_nan_spatter(image, s)).any()]
    assert hits, "no seed hits the empty-liquid case; the test no longer covers it"
    np.testing.assert_array_equal(corrupt(image, "spatter", 1, hits[0]), image)


def _nan_spatter(image, seed):
    np.random.seed(seed)
    with np.errstate(invalid="ignore"):
        return np.asarray(_ic().spatter(Image.fromarray(image), 1), dtype=float)


def test_corruption_suite_on_digits_is_seeded_and_summarised():
    cfg = settings(corruptions__corruptions=["gaussian_noise", "glass_blur"],
                   corruptions__extra_corruptions=["spatter"], corruptions__severities=[1, 5],
                   corruptions__max_samples=12, batch_size=5)
    run = make_run(digits_target(linear_digits_model()), cfg)
    first = corruptions(run, cfg.corruptions)
    again = corruptions(run, cfg.corruptions)
    assert first["error"] == again["error"]
    assert first["subset"]["samples"] == 12 and first["resolution"] == 16
    assert set(first["error"]) == {"gaussian_noise", "glass_blur", "spatter"}
    e = first["error"]
    assert first["mean_error"] == pytest.approx((sum(e["gaussian_noise"].values()) + sum(e["glass_blur"].values())) / 4)
    assert first["extra_mean_error"] == pytest.approx(sum(e["spatter"].values()) / 2)
    clean = first["clean_error"]
    assert clean == pytest.approx(100 - first["clean"]["top1"])
    assert first["relative_mean_error"] == pytest.approx(first["mean_error"] - clean)
