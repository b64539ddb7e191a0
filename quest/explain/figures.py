"""Figure-1-style grids: images (rows) x maps (columns: methods of one model, or one method of several runs), each
map overlaid on its image with the ground-truth boxes outlined."""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from quest.runtime.extras import require
from quest.store.files import save_figure
from quest.store.tree import make_dirs

from .maps_file import read_maps

__all__ = ["DPI", "compare_figure", "compare_runs", "explanation_grid", "grid_figure"]

DPI = 110  # of the saved grids


def explanation_grid(images: torch.Tensor, columns: Sequence[tuple[str, torch.Tensor]], out: str | Path,
                     boxes: Sequence[np.ndarray] | None = None, row_labels: Sequence[str] | None = None,
                     title: str | None = None, row_key: str | None = None) -> Path:
    """``images``: (K, 3, H, W) in [0, 1]; ``columns``: (title, (K, H, W) maps in [0, 1]) each; writes a PNG.
    ``row_key``: one line under the grid saying how to read the row labels."""
    fig = grid_figure(images, columns, boxes, row_labels, title, row_key)
    out = Path(out)
    make_dirs(out.parent)
    save_figure(fig, out, dpi=DPI)
    return out


def grid_figure(images: torch.Tensor, columns: Sequence[tuple[str, torch.Tensor]],
                boxes: Sequence[np.ndarray] | None = None, row_labels: Sequence[str] | None = None,
                title: str | None = None, row_key: str | None = None):
    """The matplotlib Figure of :func:`explanation_grid`."""
    require("matplotlib", "report", "the explanation figures")
    from matplotlib import patches
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    k, ncol = images.shape[0], 1 + len(columns)
    fig = Figure(figsize=(1.6 * ncol, 1.6 * k + (0.4 if title else 0.0)), constrained_layout=True)
    FigureCanvasAgg(fig)
    axes = np.asarray(fig.subplots(k, ncol, squeeze=False))
    pictures = images.permute(0, 2, 3, 1).clamp(0, 1).numpy()
    for r in range(k):
        for c in range(ncol):
            ax = axes[r, c]
            ax.imshow(pictures[r], interpolation="nearest")
            if c:
                ax.imshow(columns[c - 1][1][r].float().numpy(), cmap="jet", alpha=0.5, vmin=0.0, vmax=1.0,
                          interpolation="bilinear")
            for x0, y0, x1, y1 in (boxes[r] if boxes is not None else []):
                ax.add_patch(patches.Rectangle((x0 - 0.5, y0 - 0.5), x1 - x0 + 1, y1 - y0 + 1, fill=False,
                                               edgecolor="white", linewidth=1.0))
            ax.set_xticks([])
            ax.set_yticks([])
            if r == 0:
                ax.set_title("image" if c == 0 else columns[c - 1][0], fontsize=8)
            if c == 0 and row_labels is not None:
                ax.set_ylabel(row_labels[r], fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    if row_key and row_labels is not None:
        fig.supxlabel(row_key, fontsize=7)  # a figure-level label: constrained layout keeps room for it
    return fig


def load_maps(run_dir: str | Path, suite: str | None = None) -> tuple[Path, dict]:
    """A run's ``eval/<suite>/<checkpoint>-<weights>/explain_maps.pt`` (``last-model`` first), loaded safely and
    checked (:class:`~quest.store.damage.DamagedFile` naming the file and the field)."""
    run_dir = Path(run_dir)
    found = sorted(run_dir.glob(f"eval/{suite or '*'}/*/explain_maps.pt"),
                   key=lambda p: (p.parent.name != "last-model", str(p)))
    if not found:
        raise FileNotFoundError(f"{run_dir}: no eval/{suite or '<suite>'}/<checkpoint>-<weights>/explain_maps.pt; run "
                                f"python eval.py checkpoint={run_dir}/checkpoints/last.pt eval=explain first")
    return found[0], read_maps(found[0])  # every field checked (quest.explain.maps_file)


def compare_runs(run_dirs: Sequence[str | Path], out: str | Path, method: str = "agcam",
                 suite: str | None = None) -> Path:
    """Images (rows) x runs (columns): one method's maps of each run on the same images, written to ``out``."""
    out = Path(out)
    make_dirs(out.parent)
    save_figure(compare_figure(run_dirs, method, suite), out, dpi=DPI)
    return out


def compare_figure(run_dirs: Sequence[str | Path], method: str = "agcam", suite: str | None = None) -> Any:
    """:func:`compare_runs`' figure (a ValueError or FileNotFoundError naming what is missing, before any is drawn)."""
    loaded = [(Path(d), *load_maps(d, suite)) for d in run_dirs]
    first = loaded[0][2]
    for run_dir, path, maps in loaded:
        if maps["indices"] != first["indices"]:
            raise ValueError(f"{path} shows other images than {loaded[0][1]} (indices {maps['indices']} vs "
                             f"{first['indices']}): evaluate every run with the same eval.explain settings")
        if method not in maps["maps"]:
            raise ValueError(f"{path} has no {method!r} maps (it has {sorted(maps['maps'])})")
    # the run's name wrapped (at a Hydra sweep's commas), never cut: a panel is about 24 characters of its font
    columns = [(f"{maps.get('attention') or '?'}\n" + textwrap.fill(run_dir.name.replace(",", ", "), 24),
                maps["maps"][method].float())
               for run_dir, _, maps in loaded]
    images = first["images"].float() / 255.0
    rows = [f"#{i} {lab}" for i, lab in zip(first["indices"], first["labels"])]
    boxes = [b.numpy() for b in first["boxes"]]
    return grid_figure(images, columns, boxes, rows, title=f"{method} maps", row_key="row label: #sample index, true class")
