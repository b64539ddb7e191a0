"""Figures of the toy study: success-rate heatmaps (paper Figure 3 / A1) and key-norm trajectories (Figure 4 / A4)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

__all__ = ["plot_heatmaps", "plot_key_norms"]

GROUPS = ("biased answer tokens", "unbiased answer tokens", "other tokens")


def _panels(n: int, size: tuple[float, float]) -> tuple[plt.Figure, list[plt.Axes]]:
    """Up to three panels a row; unused ones are hidden."""
    cols = min(3, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(size[0] * cols, size[1] * rows + 0.5), squeeze=False)
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _finish(fig: plt.Figure, axes: list[plt.Axes], ylabel: str, title: str, path: Path) -> None:
    for ax in axes[::3]:  # the first panel of each row
        ax.set_ylabel(ylabel, fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_heatmaps(rates: Sequence[Mapping[str, Any]], grid: Mapping[str, Any], path: Path) -> None:
    """One panel per formulation: share of correct runs (%) per learning rate (rows) x weight decay (columns)."""
    attentions = list(dict.fromkeys(r["attention"] for r in rates))
    lrs, wds = list(grid["lrs"]), list(grid["weight_decays"])
    fig, axes = _panels(len(attentions), (3.0, 3.0))
    for ax, attention in zip(axes, attentions):
        cells = {(r["lr"], r["weight_decay"]): r for r in rates if r["attention"] == attention and r["lr"] != "all"}
        overall = next(r for r in rates if r["attention"] == attention and r["lr"] == "all")
        values = np.array([[100 * cells[(lr, wd)]["success_rate"] for wd in wds] for lr in lrs])
        ax.imshow(values, vmin=0, vmax=100, cmap="viridis", aspect="auto")
        for i, j in np.ndindex(values.shape):
            ax.text(j, i, f"{values[i, j]:.0f}", ha="center", va="center", fontsize=7,
                    color="white" if values[i, j] < 50 else "black")
        ax.set_xticks(range(len(wds)), [f"{w:g}" for w in wds], fontsize=7)
        ax.set_yticks(range(len(lrs)), [f"{lr:g}" for lr in lrs], fontsize=7)
        ax.set_xlabel("weight decay", fontsize=8)
        ax.set_title(f"{attention}: {100 * overall['success_rate']:.0f}%", fontsize=9)
    _finish(fig, axes, "learning rate", "Toy study: share of runs that learn the correct solution (%)", path)


def plot_key_norms(rows: Sequence[Mapping[str, Any]], norms: Mapping[str, torch.Tensor], path: Path) -> None:
    """Per formulation: median raw key norm per epoch of biased answer / unbiased answer / other tokens, for the runs
    that ended biased (solid; the paper's "failed trainings") and for those that ended correct (dashed)."""
    attentions = list(norms)
    fig, axes = _panels(len(attentions), (4.0, 3.0))
    colors = ("tab:red", "tab:blue", "tab:gray")
    for ax, attention in zip(axes, attentions):
        outcomes = [r["outcome"] for r in rows if r["attention"] == attention]
        traj = norms[attention].numpy()  # (runs, epochs + 1, 3)
        for outcome, style in (("biased", "-"), ("correct", "--")):
            pick = np.array([o == outcome for o in outcomes])
            if not pick.any():
                continue
            for g, (name, color) in enumerate(zip(GROUPS, colors)):
                curve = np.nanmedian(traj[pick, :, g], axis=0)
                ax.plot(curve, style, color=color, lw=1.2, label=f"{name} ({outcome}, n={pick.sum()})")
        ax.set_title(attention, fontsize=9)
        ax.set_xlabel("epoch", fontsize=8)
        ax.tick_params(labelsize=7)
        if ax.lines:
            ax.legend(fontsize=5, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no biased or correct runs", ha="center", va="center", transform=ax.transAxes, fontsize=8)
    _finish(fig, axes, "median raw key norm",
            "Toy study: key norms during training (biased runs solid, correct runs dashed)", path)
