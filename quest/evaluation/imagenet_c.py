"""ImageNet-C: per-corruption, per-severity errors, the AlexNet-normalised mCE and relative mCE (Hendrycks &
Dietterich 2019), and the shared summary used for on-the-fly corruptions too.

Errors are fractions internally and percentages in every reported number (keys say ``_pct`` or are documented as
percent); the mCE is taken over exactly the 15 standard corruptions at all 5 severities, never over the 19.
"""
from __future__ import annotations

from typing import Any, Mapping

from .config import IMAGENET_C_CORRUPTIONS, IMAGENET_C_EXTRA
from .imagenet_data import ImageList, imagenet_wnids, require_dir, wnid_samples, LAYOUTS
from .metrics import EvalRun, classify
from .transforms import describe, imagenet_c_transform

__all__ = ["ALEXNET_MEAN_ERROR", "ALEXNET_CLEAN_ERROR", "mce", "corruption_summary", "imagenet_c"]

# AlexNet's error on each of the 15 corruptions, averaged over the 5 severities (evaluation.md, Hendrycks' repo).
ALEXNET_MEAN_ERROR = dict(zip(IMAGENET_C_CORRUPTIONS, [
    0.886428, 0.894468, 0.922640, 0.819880, 0.826268, 0.785948, 0.798360, 0.866816, 0.826572, 0.819324, 0.564592,
    0.853204, 0.646056, 0.717840, 0.606500,
]))
ALEXNET_CLEAN_ERROR = 0.4348
SEVERITIES = (1, 2, 3, 4, 5)

Errors = Mapping[str, Mapping[int, float]]  # corruption -> severity -> error (fraction)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def mce(errors: Errors, clean_error: float | None = None) -> dict[str, Any]:
    """mCE = 100 * mean over the 15 corruptions of CE_c, CE_c = sum_s E_cs / sum_s E^AlexNet_cs; relative mCE uses
    (E_cs - E_clean) in numerator and denominator. None (with the reason) unless all 15 x 5 errors are present."""
    missing = [f"{c}/{s}" for c in IMAGENET_C_CORRUPTIONS for s in SEVERITIES if s not in errors.get(c, {})]
    if missing:
        more = "..." if len(missing) > 5 else ""
        reason = f"mCE needs all 15 corruptions x severities 1-5; missing {missing[:5]}{more}"
        return {"mce": None, "relative_mce": None, "ce": {}, "relative_ce": {}, "note": reason}
    # sum over severities of AlexNet's errors = 5 x its mean error
    ce = {c: sum(errors[c][s] for s in SEVERITIES) / (5 * ALEXNET_MEAN_ERROR[c]) for c in IMAGENET_C_CORRUPTIONS}
    out: dict[str, Any] = {"mce": 100 * _mean(list(ce.values())), "ce": {c: 100 * v for c, v in ce.items()},
                           "relative_mce": None, "relative_ce": {}}
    if clean_error is not None:
        rel = {c: sum(errors[c][s] - clean_error for s in SEVERITIES)
               / (5 * (ALEXNET_MEAN_ERROR[c] - ALEXNET_CLEAN_ERROR)) for c in IMAGENET_C_CORRUPTIONS}
        out["relative_mce"] = 100 * _mean(list(rel.values()))
        out["relative_ce"] = {c: 100 * v for c, v in rel.items()}
    return out


def corruption_summary(errors: Errors, standard: list[str], extra: list[str],
                       clean_error: float | None) -> dict[str, Any]:
    """Per corruption and severity errors (percent) for everything evaluated, means over the standard corruptions
    and, apart, over the extra ones, and the errors relative to the clean error of the same model (E_cs - E_clean)."""
    pct = {c: {int(s): 100 * e for s, e in by_s.items()} for c, by_s in errors.items()}
    std = [c for c in standard if c in errors]
    ext = [c for c in extra if c in errors]
    severities = sorted({s for by_s in errors.values() for s in by_s})
    out: dict[str, Any] = {
        "units": "percent",
        "error": pct,
        "corruption_error": {c: _mean(list(v.values())) for c, v in pct.items()},
        "severity_error": {s: _mean([pct[c][s] for c in std if s in pct[c]]) for s in severities if std},
        "mean_error": _mean([_mean(list(pct[c].values())) for c in std]) if std else None,
        "extra_mean_error": _mean([_mean(list(pct[c].values())) for c in ext]) if ext else None,
        "clean_error": None if clean_error is None else 100 * clean_error,
    }
    if clean_error is not None:
        out["relative_mean_error"] = (_mean([_mean([100 * (e - clean_error) for e in errors[c].values()])
                                             for c in std]) if std else None)
        out["extra_relative_mean_error"] = (_mean([_mean([100 * (e - clean_error) for e in errors[c].values()])
                                                   for c in ext]) if ext else None)
    return out


def _clean_error(run: EvalRun) -> tuple[float | None, str]:
    """The model's clean ImageNet val error: from imagenet_val of this run, else measured when roots.val is set."""
    if "imagenet_val" in run.results:
        return 1 - run.results["imagenet_val"]["top1"] / 100, "imagenet_val of this run"
    if run.settings.roots.val is not None:
        from .imagenet_suites import imagenet_val

        val = imagenet_val(run, None)
        run.results.setdefault("imagenet_val", val)
        return 1 - val["top1"] / 100, "imagenet_val (measured for the relative mCE)"
    return None, "eval.roots.val not set: relative mCE not computed"


def imagenet_c(run: EvalRun, section: Any) -> dict[str, Any]:
    if run.target.num_classes != 1000:
        raise ValueError(f"imagenet_c needs a 1000-class ImageNet classifier; this model has {run.target.num_classes}")
    root = require_dir(run.settings.roots.c, "c", "imagenet_c")
    transform = imagenet_c_transform(run.target)
    corruptions = list(section.corruptions) + list(section.extra_corruptions)
    for c in corruptions:
        for s in section.severities:
            if not (root / c / str(s)).is_dir():
                hint = " (or eval.imagenet_c.extra_corruptions=[] without ImageNet-C's extra set)" \
                    if c in IMAGENET_C_EXTRA else ""
                raise FileNotFoundError(f"imagenet_c: {root / c / str(s)} does not exist; expected layout "
                                        f"{LAYOUTS['c']}{hint}")
    errors: dict[str, dict[int, float]] = {}
    grid = run.progress("imagenet_c", len(corruptions) * len(section.severities), unit="corruption x severity")
    for c in corruptions:
        for s in section.severities:
            samples = wnid_samples(root / c / str(s), imagenet_wnids(), "c", f"imagenet_c {c}/{s}")
            top1 = classify(run, ImageList(samples, transform), 1000, what=f"imagenet_c {c}/{s}", nested=True)["top1"]
            errors.setdefault(c, {})[int(s)] = 1 - top1 / 100
            grid.update(extra=f"{c} severity {s}: error {100 - top1:.2f}%")
    clean_error, clean_source = _clean_error(run)
    result = corruption_summary(errors, list(section.corruptions), list(section.extra_corruptions), clean_error)
    result.update(mce(errors, clean_error))
    result.update({"clean_error_source": clean_source, "root": str(root), "transform": describe(transform),
                   "normaliser": "AlexNet mean errors over severities (evaluation.md); AlexNet clean error 0.4348"})
    return result
