"""ImageNet-C: the corruption/severity/wnid tree, and mCE / relative mCE against numbers worked out by hand."""
from __future__ import annotations

from fractions import Fraction

import pytest
from torchvision import transforms as T

from quest.evaluation.mce import ALEXNET_CLEAN_ERROR, ALEXNET_MEAN_ERROR, IMAGENET_C_CORRUPTIONS, IMAGENET_C_EXTRA, mce
from quest.evaluation.suites.imagenet_c import imagenet_c
from quest.evaluation.transforms import imagenet_c_transform

from ..eval_helpers import make_run, oracle_target, settings, write_wnid_tree

ALEX = [0.886428, 0.894468, 0.922640, 0.819880, 0.826268, 0.785948, 0.798360, 0.866816, 0.826572, 0.819324, 0.564592,
        0.853204, 0.646056, 0.717840, 0.606500]  # evaluation.md, in the order of the 15 corruptions
ALEX_CLEAN = 1 - 0.56522  # torchvision AlexNet (IMAGENET1K_V1) top-1 56.522%: clean error 0.43478


def test_alexnet_normalisers_are_the_published_ones():
    assert list(ALEXNET_MEAN_ERROR) == IMAGENET_C_CORRUPTIONS and list(ALEXNET_MEAN_ERROR.values()) == ALEX
    assert ALEXNET_CLEAN_ERROR == pytest.approx(0.43478, abs=1e-12)


def test_mce_and_relative_mce_exactly_by_hand():
    """Errors from counts (of 7 images), worked out with exact fractions: each reported number is the float nearest
    to the exact value (one rounding), not an accumulation of float rounding."""
    errors = {c: {s: Fraction(3, 7) for s in range(1, 6)} for c in IMAGENET_C_CORRUPTIONS}  # sum over s: 15/7
    errors["fog"] = {1: Fraction(0), 2: Fraction(1, 7), 3: Fraction(2, 7), 4: Fraction(4, 7), 5: Fraction(6, 7)}
    clean = Fraction(1, 7)
    out = mce(errors, clean_error=clean)
    alex = [Fraction(str(a)) for a in ALEX]
    alex_clean = 1 - Fraction("0.56522")
    sums = [Fraction(13, 7) if c == "fog" else Fraction(15, 7) for c in IMAGENET_C_CORRUPTIONS]
    ce = [e / (5 * a) for e, a in zip(sums, alex)]
    rel = [(e - 5 * clean) / (5 * (a - alex_clean)) for e, a in zip(sums, alex)]
    assert out["ce"]["fog"] == float(100 * Fraction(13, 7) / (5 * Fraction("0.819324")))
    assert out["mce"] == float(100 * sum(ce) / 15)
    assert out["relative_mce"] == float(100 * sum(rel) / 15)
    # brightness by hand: (15/7 - 5/7) / (5 * (0.564592 - 0.43478)) = (10/7) / 0.64906
    assert out["relative_ce"]["brightness"] == float(100 * Fraction(10, 7) / Fraction("0.64906"))
    assert out["relative_ce"]["brightness"] == pytest.approx(100 * (10 / 7) / 0.64906, rel=1e-12)


def test_mce_by_hand():
    errors = {c: {s: 0.5 for s in range(1, 6)} for c in IMAGENET_C_CORRUPTIONS}
    errors["gaussian_noise"] = {1: 0.5, 2: 0.6, 3: 0.7, 4: 0.8, 5: 0.9}
    out = mce(errors, clean_error=0.2)
    # CE(gaussian_noise) = (0.5 + 0.6 + 0.7 + 0.8 + 0.9) / (5 * 0.886428) = 3.5 / 4.43214
    assert out["ce"]["gaussian_noise"] == pytest.approx(100 * 3.5 / 4.43214)
    # CE(brightness) = 2.5 / (5 * 0.564592)
    assert out["ce"]["brightness"] == pytest.approx(100 * 2.5 / 2.82296)
    expected = (3.5 / 4.43214 + sum(2.5 / (5 * a) for a in ALEX[1:])) / 15 * 100
    assert out["mce"] == pytest.approx(expected)
    # relative: (sum_s E_cs - 5 * 0.2) / (5 * (alex_c - 0.43478))
    rel_gauss = (3.5 - 1.0) / (5 * (0.886428 - ALEX_CLEAN))
    assert out["relative_ce"]["gaussian_noise"] == pytest.approx(100 * rel_gauss)
    expected_rel = (rel_gauss + sum((2.5 - 1.0) / (5 * (a - ALEX_CLEAN)) for a in ALEX[1:])) / 15 * 100
    assert out["relative_mce"] == pytest.approx(expected_rel)


def test_mce_needs_all_15_corruptions_at_all_severities():
    errors = {c: {s: 0.5 for s in range(1, 6)} for c in IMAGENET_C_CORRUPTIONS[:-1]}
    errors.update({c: {s: 0.1 for s in range(1, 6)} for c in IMAGENET_C_EXTRA})  # 18 corruptions: still no mCE
    assert mce(errors)["mce"] is None and "jpeg_compression" in mce(errors)["note"]
    errors["jpeg_compression"] = {1: 0.5, 2: 0.5, 3: 0.5, 4: 0.5}
    assert mce(errors)["mce"] is None


def test_imagenet_c_transform_does_not_resize_again():
    steps = imagenet_c_transform(oracle_target()).transforms
    assert [type(t) for t in steps] == [T.CenterCrop, T.ToTensor, T.Normalize]


def _wrong(i: int, s: int) -> bool:
    """The designed mistakes: in corruption i at severity s, the second image shows the wrong class."""
    return (i + s) % 3 == 0


def test_imagenet_c_tree_errors_and_mce(tmp_path):
    names = IMAGENET_C_CORRUPTIONS + IMAGENET_C_EXTRA
    a, b = 1, 2
    for i, c in enumerate(names):
        for s in range(1, 6):
            write_wnid_tree(tmp_path / "c" / c / str(s), [(a, a, "x.JPEG"), (b, a if _wrong(i, s) else b, "y.JPEG")])
    write_wnid_tree(tmp_path / "val", [(a, a, "1.JPEG"), (a, a, "2.JPEG"), (b, b, "3.JPEG"), (b, a, "4.JPEG")])
    run = make_run(oracle_target(), settings(roots__c=str(tmp_path / "c"), roots__val=str(tmp_path / "val")))
    result = imagenet_c(run, run.settings.imagenet_c)
    # by hand: error 0.5 where a mistake was designed, else 0; clean error 1/4
    err = {c: {s: 0.5 if _wrong(i, s) else 0.0 for s in range(1, 6)} for i, c in enumerate(names)}
    for c in names:
        for s in range(1, 6):
            assert result["error"][c][s] == pytest.approx(100 * err[c][s]), (c, s)
    ce = [sum(err[c].values()) / (5 * ALEX[k]) for k, c in enumerate(IMAGENET_C_CORRUPTIONS)]
    rel = [(sum(err[c].values()) - 5 * 0.25) / (5 * (ALEX[k] - ALEX_CLEAN))
           for k, c in enumerate(IMAGENET_C_CORRUPTIONS)]
    assert result["mce"] == pytest.approx(100 * sum(ce) / 15)
    assert result["relative_mce"] == pytest.approx(100 * sum(rel) / 15)
    assert result["clean_error"] == pytest.approx(25.0)
    mean15 = sum(sum(err[c].values()) / 5 for c in IMAGENET_C_CORRUPTIONS) / 15
    mean4 = sum(sum(err[c].values()) / 5 for c in IMAGENET_C_EXTRA) / 4
    assert result["mean_error"] == pytest.approx(100 * mean15)
    assert result["extra_mean_error"] == pytest.approx(100 * mean4)
    for s in range(1, 6):
        expected = sum(err[c][s] for c in IMAGENET_C_CORRUPTIONS) / 15
        assert result["severity_error"][s] == pytest.approx(100 * expected)
    assert set(result["ce"]) == set(IMAGENET_C_CORRUPTIONS)  # no normalised CE for the extra four


def test_imagenet_c_missing_severity_names_path_and_layout(tmp_path):
    write_wnid_tree(tmp_path / "c" / "gaussian_noise" / "1", [(1, 1, "x.JPEG")])
    run = make_run(oracle_target(), settings(roots__c=str(tmp_path / "c")))
    with pytest.raises(FileNotFoundError) as info:
        imagenet_c(run, run.settings.imagenet_c)
    message = str(info.value)
    assert str(tmp_path / "c" / "gaussian_noise" / "2") in message and "<corruption>/<severity 1..5>/<wnid>" in message
