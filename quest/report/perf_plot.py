"""``quest-plot perf RUN_DIR ... --out FILE.png``: where each run's time went, over training: the data wait and the
images/s per device of every log interval (metrics.jsonl's ``perf/`` rows, docs/training.md), one line per run."""
from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from quest.runtime.extras import require
from quest.store.files import save_figure
from quest.store.tree import make_dirs

require("matplotlib", "report", "quest-plot perf")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from .axes import STEP_LABEL, formulation_color, plain_linear_axis  # noqa: E402
from .run_metrics import PlotInputError, load_metrics, run_formulation, run_label  # noqa: E402

__all__ = ["PERF_PANELS", "perf_figure", "plot_perf"]

#: (metrics.jsonl key, panel title, y-axis label, scale of the values)
PERF_PANELS = (("perf/data_wait", "time waiting for data", "share of the interval (%)", 100.0),
               ("perf/img_per_s_per_device", "throughput", "images/s per device", 1.0))


def perf_figure(run_dirs: Sequence[str | Path]) -> Figure:
    """Two panels against step (data wait, images/s per device), a line per run coloured by its formulation."""
    runs = []
    for run_dir in map(Path, run_dirs):
        rows = [r for r in load_metrics(run_dir) if PERF_PANELS[0][0] in r]
        if not rows:
            raise PlotInputError(f"{run_dir}/metrics.jsonl has no perf/ rows (written by quest's training since its "
                                 "telemetry; docs/training.md)")
        runs.append((run_dir, rows))
    if not runs:
        raise PlotInputError("no run directories given")
    fig = Figure(figsize=(10.0, 3.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(PERF_PANELS))
    for ax, (key, title, unit, scale) in zip(axes, PERF_PANELS):
        for run_dir, rows in runs:
            color = formulation_color(run_formulation(run_dir) or run_dir.resolve().name)
            ax.plot([r["step"] for r in rows], [scale * r[key] for r in rows], label=run_label(run_dir),
                    color=color, linewidth=1.4, marker="o", markersize=3)
        ax.set_title(title)
        ax.set_xlabel(STEP_LABEL)
        ax.set_ylabel(unit)
        plain_linear_axis(ax.xaxis)
        plain_linear_axis(ax.yaxis)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle("where the training time went")
    return fig


def plot_perf(run_dirs: Sequence[str | Path], out: str | Path) -> Path:
    out = Path(out)
    make_dirs(out.parent)
    save_figure(perf_figure(run_dirs), out, dpi=120)
    return out
