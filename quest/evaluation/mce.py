"""Corruption errors and their summaries: the AlexNet-normalised mCE and relative mCE of ImageNet-C (Hendrycks &
Dietterich 2019), and the means over corruptions and severities that ImageNet-C and the on-the-fly corruptions
report alike.

Errors are exact fractions internally (:class:`fractions.Fraction` of integer counts, and of the published decimal
normalisers), so every mean, CE and mCE is rounded once, when it is written out as a float64 percentage; keys say
``_pct`` or are documented as percent. The mCE is taken over exactly the 15 standard corruptions at all 5
severities, never over the 19.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any, Mapping

__all__ = ["IMAGENET_C_CORRUPTIONS", "IMAGENET_C_EXTRA", "SEVERITIES", "ALEXNET_MEAN_ERROR", "ALEXNET_TOP1",
           "ALEXNET_CLEAN_ERROR", "mce", "corruption_summary"]

# ImageNet-C: the 15 corruptions of the mCE, in the paper's order, and the 4 extra ("validation") corruptions that
# have no AlexNet normaliser and are reported apart.
IMAGENET_C_CORRUPTIONS = [
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate", "jpeg_compression",
]
IMAGENET_C_EXTRA = ["speckle_noise", "gaussian_blur", "spatter", "saturate"]

# AlexNet's error on each of the 15 corruptions, averaged over the 5 severities (Hendrycks' ImageNet-C repository;
# docs/evaluation.md), as the exact decimals published.
ALEXNET_MEAN_ERROR = dict(zip(IMAGENET_C_CORRUPTIONS, [
    0.886428, 0.894468, 0.922640, 0.819880, 0.826268, 0.785948, 0.798360, 0.866816, 0.826572, 0.819324, 0.564592,
    0.853204, 0.646056, 0.717840, 0.606500,
]))
# AlexNet's clean ImageNet val error, the denominator offset of the relative mCE: 1 - 0.56522 = 0.43478, the top-1
# of torchvision's AlexNet weights (alexnet-owt-4df8aa71.pth, AlexNet_Weights.IMAGENET1K_V1: acc@1 56.522), the
# network hendrycks/robustness ImageNet-C/test.py loads (its clean-error pass is commented out there, so the value is
# torchvision's published accuracy). The 0.4348 often quoted is this number rounded to 4 digits.
ALEXNET_TOP1 = Fraction("0.56522")
ALEXNET_CLEAN_ERROR = float(1 - ALEXNET_TOP1)
SEVERITIES = (1, 2, 3, 4, 5)

Number = Fraction | float | int
Errors = Mapping[str, Mapping[int, Number]]  # corruption -> severity -> error (fraction of the samples)


def _exact(value: Number) -> Fraction:
    """A Fraction as it is; a float by its shortest decimal repr (0.886428 -> 886428/10^6, the number published,
    not the nearest binary double)."""
    if isinstance(value, Fraction):
        return value
    if isinstance(value, float):
        return Fraction(repr(value))
    return Fraction(value)


def _mean(values: list[Fraction]) -> Fraction:
    return sum(values, Fraction(0)) / len(values)


def _pct(value: Fraction) -> float:
    return float(100 * value)


def mce(errors: Errors, clean_error: Number | None = None) -> dict[str, Any]:
    """mCE = 100 * mean over the 15 corruptions of CE_c, CE_c = sum_s E_cs / sum_s E^AlexNet_cs; relative mCE uses
    (E_cs - E_clean) in the numerator and (E^AlexNet_cs - 0.43478) in the denominator. None (with the reason) unless
    all 15 x 5 errors are present. Computed exactly, rounded once per reported number."""
    missing = [f"{c}/{s}" for c in IMAGENET_C_CORRUPTIONS for s in SEVERITIES if s not in errors.get(c, {})]
    if missing:
        more = "..." if len(missing) > 5 else ""
        reason = f"mCE needs all 15 corruptions x severities 1-5; missing {missing[:5]}{more}"
        return {"mce": None, "relative_mce": None, "ce": {}, "relative_ce": {}, "note": reason}
    alex = {c: _exact(ALEXNET_MEAN_ERROR[c]) for c in IMAGENET_C_CORRUPTIONS}
    # sum over severities of AlexNet's errors = 5 x its mean error
    ce = {c: sum((_exact(errors[c][s]) for s in SEVERITIES), Fraction(0)) / (5 * alex[c])
          for c in IMAGENET_C_CORRUPTIONS}
    out: dict[str, Any] = {"mce": _pct(_mean(list(ce.values()))), "ce": {c: _pct(v) for c, v in ce.items()},
                           "relative_mce": None, "relative_ce": {}}
    if clean_error is not None:
        clean, alex_clean = _exact(clean_error), 1 - ALEXNET_TOP1
        rel = {c: sum((_exact(errors[c][s]) - clean for s in SEVERITIES), Fraction(0)) / (5 * (alex[c] - alex_clean))
               for c in IMAGENET_C_CORRUPTIONS}
        out["relative_mce"] = _pct(_mean(list(rel.values())))
        out["relative_ce"] = {c: _pct(v) for c, v in rel.items()}
    return out


def corruption_summary(errors: Errors, standard: list[str], extra: list[str],
                       clean_error: Number | None) -> dict[str, Any]:
    """Per corruption and severity errors (percent) for everything evaluated, means over the standard corruptions
    and, apart, over the extra ones, and the errors relative to the clean error of the same model (E_cs - E_clean)."""
    exact = {c: {int(s): _exact(e) for s, e in by_s.items()} for c, by_s in errors.items()}
    std = [c for c in standard if c in exact]
    ext = [c for c in extra if c in exact]
    severities = sorted({s for by_s in exact.values() for s in by_s})
    clean = None if clean_error is None else _exact(clean_error)

    def mean_over(names: list[str], offset: Fraction = Fraction(0)) -> float | None:
        return _pct(_mean([_mean([e - offset for e in exact[c].values()]) for c in names])) if names else None

    out: dict[str, Any] = {
        "units": "percent",
        "error": {c: {s: _pct(e) for s, e in by_s.items()} for c, by_s in exact.items()},
        "corruption_error": {c: _pct(_mean(list(by_s.values()))) for c, by_s in exact.items()},
        "severity_error": {s: _pct(_mean([exact[c][s] for c in std if s in exact[c]])) for s in severities if std},
        "mean_error": mean_over(std),
        "extra_mean_error": mean_over(ext),
        "clean_error": None if clean is None else _pct(clean),
    }
    if clean is not None:
        out["relative_mean_error"] = mean_over(std, clean)
        out["extra_relative_mean_error"] = mean_over(ext, clean)
    return out
