"""The statistics behind ``python -m quest.report``: mean ± std over seeds, Welch's t-test, metric direction and the
learning-rate sensitivity of Wortsman et al. (2024). Pure functions on plain numbers; definitions in docs/report.md.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["mean_std", "welch_p", "lower_is_better", "init_loss", "capped_loss", "LRSensitivity", "lr_sensitivity"]

# Leaf names of metrics where smaller is better (cross-entropies and corruption errors, e.g. ImageNet-C's mCE).
_LOWER_LEAVES = {"loss", "nll", "mce", "relative_mce"}
# Path parts whose numbers are all errors (eval_results.json: error/<corruption>/<severity>, ce/<corruption>, ...).
_LOWER_PARTS = {"error", "ce", "relative_ce", "corruption_error", "severity_error"}


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (ddof=1); the std is None for a single value."""
    if not values:
        raise ValueError("mean_std of no values")
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else None)


def welch_p(a: Sequence[float], b: Sequence[float]) -> float | None:
    """Two-sided p-value of Welch's t-test (unequal variances) between two samples; None when it is undefined
    (fewer than two values on either side, or both samples constant)."""
    if len(a) < 2 or len(b) < 2:
        return None
    from quest.runtime.extras import require  # scipy is slow to import: only when a test is actually run

    ttest_ind = require("scipy.stats", "report", "the Welch t-test of quest.report").ttest_ind

    p = float(ttest_ind(list(a), list(b), equal_var=False).pvalue)
    return p if math.isfinite(p) else None


def lower_is_better(metric: str) -> bool:
    """True for losses, NLLs and error metrics (mCE, mean_error, ...): judged by the metric's name."""
    parts = metric.split("/")
    leaf = parts[-1]
    return leaf in _LOWER_LEAVES or "error" in leaf or bool(_LOWER_PARTS.intersection(parts[:-1]))


def init_loss(num_classes: int) -> float:
    """The loss at initialisation, taken as the cross-entropy of a uniform prediction over ``num_classes``: ln(C).
    A freshly initialised ViT (small random head) predicts close to uniformly, and this needs no extra run."""
    if num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    return math.log(num_classes)


def capped_loss(loss: float | None, loss0: float) -> float:
    """min(loss, loss0); a diverged run (None) or a non-finite loss counts as loss0, the loss of not learning."""
    if loss is None or not math.isfinite(loss):
        return loss0
    return min(loss, loss0)


@dataclass(frozen=True)
class LRSensitivity:
    loss0: float  # loss at initialisation
    loss_at: dict[float, float]  # lr -> mean over that lr's runs of min(final loss, loss0)
    loss_star: float  # min over the sweep of loss_at
    value: float  # mean over the lrs of (loss_at[lr] - loss_star)

    def gap(self, lr: float) -> float:
        return self.loss_at[lr] - self.loss_star


def lr_sensitivity(losses: Mapping[float, Sequence[float | None]], loss0: float) -> LRSensitivity:
    """Learning-rate sensitivity (Wortsman et al. 2024, "Small-scale proxies for large-scale Transformer training
    instabilities", ICLR): E_lr[min(loss(lr), loss0) - loss*], loss* = min over the sweep.

    ``losses`` maps each lr to the final losses of its runs (seeds), None for a diverged run. With several seeds
    at one lr, loss(lr) is the mean of their capped losses, so one diverged seed in three costs a third.
    """
    if not losses:
        raise ValueError("lr_sensitivity of an empty sweep")
    loss_at = {}
    for lr, runs in losses.items():
        if not runs:
            raise ValueError(f"lr {lr} has no runs")
        loss_at[lr] = statistics.fmean(capped_loss(x, loss0) for x in runs)
    loss_star = min(loss_at.values())
    value = statistics.fmean(v - loss_star for v in loss_at.values())
    return LRSensitivity(loss0, dict(sorted(loss_at.items())), loss_star, value)
