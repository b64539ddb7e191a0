"""``quest-plot perf RUN_DIR ... --out FILE.png``: where each run's time went, over training: the data wait and the
images/s per device of every log interval (metrics.jsonl's ``perf/`` rows, docs/training.md), one line per run."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from quest.runtime.extras import require
from quest.store.damage import DamagedFile
from quest.store.files import save_figure
from quest.store.records import bounded, check_fields, described, stored_as
from quest.store.tree import make_dirs

require("matplotlib", "report", "quest-plot perf")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from .axes import STEP_LABEL, formulation_color, plain_linear_axis  # noqa: E402
from .run_metrics import PlotInputError, load_metrics, run_formulation, run_label  # noqa: E402

__all__ = ["PERF_PANELS", "PerfRow", "perf_figure", "plot_perf"]


def _perf(key: str, low: float, high: float, words: str) -> Any:
    return field(default=None, metadata=stored_as(key, **bounded(low, high), **described(words)))


@dataclass
class PerfRow:
    """A metrics.jsonl row's telemetry (quest.train.telemetry), each key with what it means and so the range it can
    hold: a share of the interval in [0, 1], a rate, a time or a memory that is never negative, and beyond which no
    machine goes (a number past it was not measured)."""

    data_wait: float | None = _perf("perf/data_wait", 0, 1, "the share of the interval spent waiting for data, 0..1")
    step_s: float | None = _perf("perf/step_s", 0, 1e7, "seconds per step, 0..1e7")
    img_per_s: float | None = _perf("perf/img_per_s", 0, 1e9, "images per second, 0..1e9")
    img_per_s_per_device: float | None = _perf("perf/img_per_s_per_device", 0, 1e9,
                                               "images per second per device, 0..1e9")
    tflops_per_device: float | None = _perf("perf/tflops_per_device", 0, 1e6, "TFLOP/s per device, 0..1e6")
    mfu: float | None = _perf("perf/mfu", 0, 1, "the share of the device's peak FLOP/s, 0..1")
    peak_mem_gib: float | None = _perf("perf/peak_mem_gib", 0, 1e5, "GiB of device memory, 0..1e5")
    compile_s: float | None = _perf("perf/compile_s", 0, 1e7, "seconds, 0..1e7")
    compile_steps: int | None = _perf("perf/compile_steps", 0, 1e9, "a count of steps, 0..1e9")
    loader_start_s: float | None = _perf("perf/loader_start_s", 0, 1e7, "seconds, 0..1e7")
    extra_values: ClassVar[Any] = Any  # the other keys of the row: quest.store.run_files.MetricsRow's


def _checked(run_dir: Path, row: dict[str, Any]) -> dict[str, Any]:
    """``row`` when every perf/ key holds a number its meaning allows (:class:`PerfRow`), else PlotInputError naming
    the file, the step and the key."""
    try:
        check_fields(PerfRow, row, f"{run_dir / 'metrics.jsonl'} (step {row.get('step')})")
    except DamagedFile as exc:
        raise PlotInputError(str(exc)) from None
    return row

#: (metrics.jsonl key, panel title, y-axis label, scale of the values)
PERF_PANELS = (("perf/data_wait", "time waiting for data", "share of the interval (%)", 100.0),
               ("perf/img_per_s_per_device", "throughput", "images/s per device", 1.0))


def perf_figure(run_dirs: Sequence[str | Path]) -> Figure:
    """Two panels against step (data wait, images/s per device), a line per run coloured by its formulation."""
    runs = []
    for run_dir in map(Path, run_dirs):
        rows = [_checked(run_dir, r) for r in load_metrics(run_dir) if any(k.startswith("perf/") for k in r)]
        rows = [r for r in rows if all(r.get(key) is not None for key, *_ in PERF_PANELS)]
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
