"""Figures of the toy study: success-rate heatmaps (paper Figure 3 / A1), key-norm trajectories (Figure 4 / A4) and
the sensitivity study's panels. Each formulation keeps its colour of every other figure (quest.report.plot)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from quest.runtime.extras import require

matplotlib = require("matplotlib", "report", "the toy study's figures")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from quest.report.plot import formulation_color  # noqa: E402
from quest.store.files import save_figure  # noqa: E402

__all__ = ["plot_heatmaps", "plot_key_norms", "key_norms_figure", "plot_sensitivity"]

GROUPS = ("biased answer tokens", "unbiased answer tokens", "other tokens")


def _panels(n: int, size: tuple[float, float], cols: int = 3,
            sharey: bool = False) -> tuple[plt.Figure, list[plt.Axes]]:
    """Up to ``cols`` panels a row; unused ones are hidden."""
    cols = min(cols, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows + 0.6), squeeze=False,
                             sharey=sharey)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _finish(fig: plt.Figure, axes: list[plt.Axes], ylabel: str | None, title: str, path: Path,
            cols: int = 3) -> None:
    if ylabel:
        for ax in axes[::cols]:  # the first panel of each row
            ax.set_ylabel(ylabel, fontsize=8)
    fig.suptitle(title, fontsize=10)
    save_figure(fig, path, dpi=130, bbox_inches="tight")  # a long title or label widens the image, never clipped
    plt.close(fig)


def plot_heatmaps(rates: Sequence[Mapping[str, Any]], grid: Mapping[str, Any], path: Path,
                  labels: Mapping[str, str] | None = None, subtitle: str = "") -> None:
    """One panel per formulation: share of correct runs (%) per learning rate (rows) x weight decay (columns), every
    cell annotated with its rate and run count, and one colour bar for all panels."""
    labels = labels or {}
    attentions = list(dict.fromkeys(r["attention"] for r in rates))
    lrs, wds = list(grid["lrs"]), list(grid["weight_decays"])
    fig, axes = _panels(len(attentions), (2.2 + 0.35 * len(wds), 1.4 + 0.3 * len(lrs)))
    image = None
    for ax, attention in zip(axes, attentions):
        cells = {(r["lr"], r["weight_decay"]): r for r in rates if r["attention"] == attention and r["lr"] != "all"}
        overall = next(r for r in rates if r["attention"] == attention and r["lr"] == "all")
        values = np.array([[100 * cells[(lr, wd)]["success_rate"] for wd in wds] for lr in lrs])
        runs = cells[(lrs[0], wds[0])]["runs"]
        image = ax.imshow(values, vmin=0, vmax=100, cmap="viridis", aspect="auto")
        for i, j in np.ndindex(values.shape):
            ax.text(j, i, f"{values[i, j]:.0f}", ha="center", va="center", fontsize=7,
                    color="white" if values[i, j] < 50 else "black")
        ax.set_xticks(range(len(wds)), [f"{w:g}" for w in wds], fontsize=7)
        ax.set_yticks(range(len(lrs)), [f"{lr:g}" for lr in lrs], fontsize=7)
        ax.set_xlabel("weight decay", fontsize=8)
        ax.set_title(f"{labels.get(attention, attention)}: {100 * overall['success_rate']:.0f}% "
                     f"of {overall['runs']} (cells: {runs} runs)", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.9, 0.95))
    bar = fig.colorbar(image, ax=axes, fraction=0.04, pad=0.03)
    bar.set_label("runs that learn the correct solution (%)", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    title = "Toy study: share of runs that learn the correct solution (%)" + (f", {subtitle}" if subtitle else "")
    _finish(fig, axes, "learning rate", title, path)


def plot_key_norms(rows: Sequence[Mapping[str, Any]], norms: Mapping[str, torch.Tensor], path: Path,
                   labels: Mapping[str, str] | None = None) -> None:
    """Per formulation: median raw key norm per epoch of biased answer / unbiased answer / other tokens, for the runs
    that ended biased (solid; the paper's "failed trainings") and for those that ended correct (dashed)."""
    fig, axes = key_norms_figure(rows, norms, labels)
    _finish(fig, axes, "median raw key norm ‖k‖₂ (unitless)",
            "Toy study: key norms during training (biased runs solid, correct runs dashed)", path)


def key_norms_figure(rows: Sequence[Mapping[str, Any]], norms: Mapping[str, torch.Tensor],
                     labels: Mapping[str, str] | None = None) -> tuple[plt.Figure, list[plt.Axes]]:
    """The panels of :func:`plot_key_norms` on one y-scale (formulations compare at a glance), each titled with its
    run counts, and one legend below the panels (never over the data). Only what is drawn gets a legend entry."""
    from matplotlib.lines import Line2D

    labels = labels or {}
    attentions = list(norms)
    fig, axes = _panels(len(attentions), (4.0, 3.0), sharey=True)
    colors = ("tab:red", "tab:blue", "tab:gray")
    styles = {"biased": "-", "correct": "--"}
    drawn_groups: set[int] = set()
    drawn_outcomes: set[str] = set()
    for ax, attention in zip(axes, attentions):
        outcomes = [r["outcome"] for r in rows if r["attention"] == attention]
        traj = norms[attention].numpy()  # (runs, epochs + 1, 3)
        counts = []
        for outcome, style in styles.items():
            pick = np.array([o == outcome for o in outcomes], dtype=bool)
            counts.append(f"{outcome} n={pick.sum()}")
            if not pick.any():
                continue
            for g, color in enumerate(colors):
                values = traj[pick, :, g]
                if np.isnan(values).all():
                    continue
                with np.errstate(all="ignore"):
                    curve = np.nanmedian(values, axis=0)
                ax.plot(np.arange(len(curve)), curve, style, color=color, lw=1.2)
                drawn_groups.add(g)
                drawn_outcomes.add(outcome)
        ax.set_title(f"{labels.get(attention, attention)} ({', '.join(counts)})", fontsize=9)
        ax.set_xlabel("epoch", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        if not ax.lines:
            ax.text(0.5, 0.5, "no biased or correct runs", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    handles = [Line2D([], [], color=colors[g], lw=1.2, label=GROUPS[g]) for g in sorted(drawn_groups)]
    handles += [Line2D([], [], color="black", ls=styles[o], lw=1.2, label=f"{o} runs (median)")
                for o in styles if o in drawn_outcomes]
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    if handles:
        # below the figure's panels; the tight bounding box of the saved image takes it in
        fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=min(len(handles), 5),
                   fontsize=7, frameon=False)
    return fig, axes


def _errorbar(ax: plt.Axes, x, rows: Sequence[Mapping[str, Any]], **kwargs) -> None:
    y = np.array([100 * r["success_rate"] for r in rows])
    lo = y - np.array([100 * r["ci_low"] for r in rows])
    hi = np.array([100 * r["ci_high"] for r in rows]) - y
    ax.errorbar(x, y, yerr=[lo, hi], capsize=2, lw=1.2, ms=3.5, **kwargs)


def plot_sensitivity(table: Sequence[Mapping[str, Any]], cfg: Mapping[str, Any], chosen: int, path: Path,
                     labels: Mapping[str, str] | None = None) -> None:
    """The sensitivity study in four panels: success rate (95% Wilson intervals) against the training-set size, against
    QKNorm's scale, against the test set's biased fraction, and the outcome shares under both rule sets."""
    labels = labels or {}
    st = cfg["study"]
    sizes = [int(s) for s in st["train_sizes"]]
    attentions = list(cfg["attentions"])
    runs = next(r["runs"] for r in table if r["axis"] == "train_size")
    fig, axes = plt.subplots(2, 2, figsize=(13, 9.5))
    (a, b), (c, d) = axes

    def pick(axis: str, **match) -> list[Mapping[str, Any]]:
        return [r for r in table if r["axis"] == axis and all(r[k] == v for k, v in match.items())]

    # (a) training-set size: every formulation, QKNorm's other scales dashed
    extra = [v for v in st["scale_variants"] if v not in attentions]
    for name in attentions + extra:
        rows = sorted(pick("train_size", attention=name), key=lambda r: r["train_size"])
        variant = name in extra
        _errorbar(a, [r["train_size"] for r in rows], rows, marker="o", ls="--" if variant else "-",
                  color=formulation_color("qknorm") if variant else formulation_color(name),
                  alpha=0.55 if variant else 1.0, label=labels.get(name, name))
    a.set_xscale("log", base=2)
    a.set_xticks(sizes, [f"{s:,}" for s in sizes])
    a.minorticks_off()
    a.axvline(chosen, color="0.6", ls=":", lw=1)
    a.set_xlabel("training-set size (samples; 50 epochs, batch 32)", fontsize=8)
    a.set_title("(a) training-set size", fontsize=9)
    a.legend(fontsize=6, ncol=2, loc="upper left")

    # (b) QKNorm's scale: one line per training-set size
    variants = list(st["scale_variants"])
    shades = plt.cm.Reds(np.linspace(0.35, 0.95, len(sizes)))
    for size, shade in zip(sizes, shades):
        rows = [pick("qknorm_scale", attention=v, train_size=size)[0] for v in variants]
        _errorbar(b, np.arange(len(variants)), rows, marker="o", color=shade, label=f"{size:,} samples")
    b.set_xticks(range(len(variants)), [labels.get(v, v).replace("QKNorm, ", "") for v in variants], fontsize=7)
    b.set_xlabel("QKNorm's scale g (learnable from its initial value, or fixed)", fontsize=8)
    b.set_title("(b) QKNorm's scale in this study", fontsize=9)
    b.legend(fontsize=6, loc="upper right")

    # (c) the test set's biased fraction, at the chosen size
    fractions = [float(f) for f in st["test_biased_fractions"]]
    for name in attentions:
        rows = sorted(pick("test_biased_fraction", attention=name, train_size=chosen),
                      key=lambda r: r["test_biased_fraction"])
        _errorbar(c, [r["test_biased_fraction"] for r in rows], rows, marker="o", color=formulation_color(name),
                  label=labels.get(name, name))
    c.set_xticks(fractions, [f"{f:g}" for f in fractions])
    c.set_xlabel("share of biased samples in the test set (training set: 0.5)", fontsize=8)
    c.set_title(f"(c) the test set, {chosen:,} training samples", fontsize=9)
    c.legend(fontsize=6, loc="best")

    # (d) outcome shares under this project's partition and the paper's ranges, at the chosen size
    colors = {"correct": "#2ca02c", "biased": "#d62728", "degenerate": "#7f7f7f", "other": "#f0c419"}
    width = 0.38
    for i, name in enumerate(attentions):
        for j, rule_set in enumerate(("project", "paper")):
            row = pick("outcome_rules", attention=name, train_size=chosen, value=rule_set)[0]
            bottom = 0.0
            for outcome, color in colors.items():
                share = 100 * row[outcome] / row["runs"]
                d.bar(i + (j - 0.5) * width, share, width * 0.95, bottom=bottom, color=color,
                      hatch="//" if rule_set == "paper" else None, edgecolor="white", lw=0.5,
                      label=(outcome if outcome != "other" else "other / unclassified") if i == 0 and j == 0 else None)
                bottom += share
    d.set_xticks(range(len(attentions)), [labels.get(n, n) for n in attentions], fontsize=7)
    d.set_ylim(0, 100)
    d.set_ylabel("share of runs (%)", fontsize=8)
    d.set_title(f"(d) outcome rules, {chosen:,} training samples: this project's (left) and the paper's ranges "
                "(right, hatched)", fontsize=8)
    d.legend(fontsize=6, loc="upper right", ncol=4)
    for ax in (a, b, c):
        ax.set_ylim(-2, 102)
        ax.set_ylabel("success rate (% of runs correct; bars: 95% interval)", fontsize=8)
    for ax in axes.flat:
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.25, lw=0.5)
    fig.suptitle(f"Toy study, sensitivity to what the paper leaves open ({runs} runs per point: every lr x weight "
                 f"decay {{{', '.join(f'{w:g}' for w in cfg['grid']['weight_decays'])}}} x "
                 f"{len(cfg['grid']['data_seeds'])} data x {len(cfg['grid']['init_seeds'])} initialisations; "
                 f"dotted: the size the stopping rule picks)", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    save_figure(fig, path, dpi=130, bbox_inches="tight")  # a long title or label widens the image, never clipped
    plt.close(fig)
