"""The looks every quest figure shares: one colour per attention formulation, axis labels with units, and log axes
that read as plain numbers with a labelled tick at both ends of the range (quest.report.plot, quest.toy.plots)."""
from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Sequence
from typing import Any

from quest.runtime.extras import require

require("matplotlib", "report", "quest.report.plot")
from matplotlib import ticker  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.colors import to_hex, to_rgb  # noqa: E402

__all__ = ["FORMULATION_COLORS", "STEP_LABEL", "formulation_color", "axis_label", "plain_log_axis", "plain_linear_axis",
           "shade"]

#: One colour per attention formulation (configs/attention), the same in every figure whatever the order of the runs.
FORMULATION_COLORS = {
    "standard": "#1f77b4", "quest": "#ff7f0e", "qnorm": "#2ca02c", "qknorm": "#d62728", "qknorm_hs": "#9467bd",
    "qknorm_ds": "#8c564b", "elliptical": "#e377c2", "elliptical_quest": "#17becf",
}
# Further colours for other names (a new formulation, a run labelled by its directory), none of them above.
_EXTRA_COLORS = ("#bcbd22", "#7f7f7f", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd",
                 "#e6550d", "#31a354", "#756bb1", "#636363")


def formulation_color(name: str) -> str:
    """The colour of a formulation: fixed for the known ones, else picked from further colours by a hash of the
    name (stable across processes and runs, unlike Python's ``hash``)."""
    if name in FORMULATION_COLORS:
        return FORMULATION_COLORS[name]
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return _EXTRA_COLORS[int.from_bytes(digest[:4], "big") % len(_EXTRA_COLORS)]


def shade(color: str, position: int, count: int) -> str:
    """``color`` darkened (first layer) to lightened (last layer): the layers of one run in one hue."""
    if count <= 1:
        return to_hex(color)
    t = position / (count - 1)  # 0 .. 1
    rgb = to_rgb(color)
    if t < 0.5:
        mixed = tuple(c * (0.6 + 0.8 * t) for c in rgb)  # towards black, at most 40 %
    else:
        mixed = tuple(c + (1 - c) * (t - 0.5) * 1.1 for c in rgb)  # towards white, at most 55 %
    return to_hex(mixed)


# Units of the diagnostics (docs/diagnostics.md): logits are dimensionless (scale * q'.k'), norms are the raw
# projections' l2 norms, entropies natural-log nats.
_LABELS = {
    "max_logit": "max attention logit (unitless)",
    "q_norm_at_max": "‖q‖₂ of the max-logit pair (unitless)",
    "k_norm_at_max": "‖k‖₂ of the max-logit pair (unitless)",
    "q_norm_mean": "mean ‖q‖₂ (unitless)", "q_norm_max": "max ‖q‖₂ (unitless)",
    "k_norm_mean": "mean ‖k‖₂ (unitless)", "k_norm_max": "max ‖k‖₂ (unitless)",
    "entropy_mean": "mean attention entropy (nats)", "entropy_min": "min attention entropy (nats)",
    "low_entropy_head_frac": "share of heads below the entropy threshold (0-1)",
}
STEP_LABEL = "training step (optimizer steps)"


def axis_label(stat: str) -> str:
    """The y-axis label of a statistic, with its unit (``headHH/<stat>`` prefixed by the head)."""
    head = re.match(r"^head(\d+)/(.+)$", stat)
    if head:
        return f"head {head.group(1)}: {axis_label(head.group(2))}"
    return _LABELS.get(stat, stat)


def _plain(value: float, _pos: Any = None) -> str:
    """A tick value as a plain number ('0.01', '300', '20000'); exponent notation only past six digits."""
    return f"{value:.6g}"


def plain_log_axis(ax: Axes, values: Sequence[float]) -> None:
    """Log-scale y with plain-number ticks instead of matplotlib's 10^x labels, chosen by the decades the view
    spans: decades past three, 1-2-5 within three, 1-2-3-5 within two, 1-1.5-2-3-5-7 within one (evenly spaced ticks
    would leave the stretched low end of a log axis unlabelled: 2, 4, 6, 8 on 0.9..8.8), evenly spaced ticks within
    half a decade (where log and linear spacing nearly agree)."""
    ax.set_yscale("log")
    finite = [v for v in values if math.isfinite(v) and v > 0]
    span = math.log10(max(finite) / min(finite)) if finite else 0.0
    low, high = ax.get_ylim()  # the view (with the lines drawn): a constant line gets about a decade around it
    if 0 < low < high:
        span = max(span, math.log10(high / low))
    if span < 0.5:
        ax.yaxis.set_major_locator(ticker.MaxNLocator(nbins=5))
    elif span < 1:
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 1.5, 2.0, 3.0, 5.0, 7.0)))
    elif span < 2:
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    elif span < 3:
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    else:
        ax.yaxis.set_major_locator(ticker.LogLocator(base=10))
    ax.yaxis.set_major_formatter(ticker.FuncFormatter(_plain))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())


def plain_linear_axis(axis: Any) -> None:
    """No offset ('+1e4') and no scientific multiplier on a linear axis."""
    formatter = ticker.ScalarFormatter(useOffset=False, useMathText=False)
    formatter.set_scientific(False)
    axis.set_major_formatter(formatter)
