"""Figures from run directories. ``diagnostics``: Figure-A6-style curves of the attention diagnostics; ``perf``: the
data wait and throughput over training (quest.report.perf_plot); ``explain``: explanation maps side by side.

    python -m quest.report.plot diagnostics RUN_DIR [RUN_DIR ...] --out FILE.png [--layers 0,3|all] [--keys ...]

Each RUN_DIR holds ``metrics.jsonl`` (one flat JSON object per line, always with an integer ``step``; diagnostic
keys ``diag/layerLL/<stat>`` only on diagnostic steps) and optionally ``summary.json`` (the line label is its
``attention``, or ``choices.attention``, else the directory name). A run without diagnostic keys is skipped with a
warning when another run has them. Each formulation has one colour in every figure (:func:`formulation_color`);
axes say their units and log axes read as plain numbers. Definitions: docs/diagnostics.md.
"""
from __future__ import annotations

import argparse
import logging
import math
import re
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from quest.runtime.errors import doc_summary, input_error, parse_arguments, program_name
from quest.runtime.extras import require
from quest.store.files import atomic_write, figure_bytes, save_figure
from quest.store.output_folder import FolderHeld, holding, input_path, output_path
from quest.store.tree import OutputExists, make_dirs, refuse_present

require("matplotlib", "report", "quest.report.plot")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from .axes import FORMULATION_COLORS, STEP_LABEL, axis_label, formulation_color, plain_linear_axis, plain_log_axis, shade  # noqa: E402
from .run_metrics import PlotInputError, load_metrics, run_formulation, run_label  # noqa: E402

__all__ = ["PlotInputError", "FORMULATION_COLORS", "formulation_color", "axis_label", "plain_log_axis",
           "load_metrics", "run_label", "run_formulation", "layer_series", "diagnostics_figure", "plot_diagnostics",
           "main"]

logger = logging.getLogger("quest.report")

Series = dict[int, dict[str, dict[int, float]]]  # layer -> stat -> step -> value

_TITLE_CHARS = 40  # a panel title's line length

#: The panels of the QUEST paper's Figure A6: the max attention logit and the query / key norms of its pair.
DEFAULT_KEYS = ("max_logit", "q_norm_at_max", "k_norm_at_max")
# Statistics that belong to the max-logit pair: "over layers" they come from the layer holding the max logit.
_AT_MAX = ("q_norm_at_max", "k_norm_at_max")
_LINESTYLES = ("-", "--", ":", "-.")
_MARKERS = ("", "o", "s", "^", "v", "D", "P", "X")  # the 2nd, 3rd, ... run of one formulation (seeds, lrs)

def layer_series(records: list[dict[str, Any]], prefix: str = "diag/") -> Series:
    """Per-layer diagnostic values keyed by layer index, statistic and step (a later line for a step wins)."""
    pattern = re.compile(rf"^{re.escape(prefix)}layer(\d+)/(.+)$")
    series: Series = {}
    for record in records:
        for key, value in record.items():
            match = pattern.match(key)
            if match is None or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            layer, stat = int(match.group(1)), match.group(2)
            series.setdefault(layer, {}).setdefault(stat, {})[record["step"]] = float(value)
    return series


def _over_layers(series: Series, stat: str) -> dict[int, float]:
    """One value per step across layers: the max-logit layer's value for ``*_at_max``, min for entropies, else max."""
    steps = sorted({s for layer in series.values() for s in layer.get(stat, {})})
    out: dict[int, float] = {}
    for step in steps:
        if stat in _AT_MAX:
            # The pair's norms only mean something next to the pair's logit: take them from the layer that has it.
            candidates = [
                (layer["max_logit"][step], layer[stat][step])
                for layer in series.values()
                if step in layer.get("max_logit", {}) and step in layer.get(stat, {})
            ]
            if candidates:
                out[step] = max(candidates, key=lambda c: -math.inf if math.isnan(c[0]) else c[0])[1]
            continue
        values = [layer[stat][step] for layer in series.values() if step in layer.get(stat, {})]
        if any(math.isnan(v) for v in values):
            out[step] = math.nan  # a diverged layer leaves a gap, it does not silently lose to the others
            continue
        # Entropy collapse shows in the least entropic layer; logits and norms in the largest.
        out[step] = min(values) if "entropy" in stat else max(values)
    return out


def _check_run(path: Path, series: Series, layers: Sequence[int] | None, keys: Sequence[str], prefix: str) -> None:
    metrics = path / "metrics.jsonl"
    if not series:
        raise PlotInputError(
            f"{metrics}: no diagnostic keys (expected lines with '{prefix}layerNN/max_logit' and friends, written "
            "when the run trains with diagnostics.every_n_steps > 0)"
        )
    present = sorted(series)
    for layer in layers or ():
        if layer not in series:
            raise PlotInputError(f"{metrics}: no layer {layer} (layers present: {', '.join(map(str, present))})")
    stats = sorted({s for layer in series.values() for s in layer})
    for key in keys:
        if not any(key in series[layer] for layer in (layers or present)):
            raise PlotInputError(
                f"{metrics}: no '{prefix}layerNN/{key}' (statistics present: {', '.join(stats)})"
            )


def _parse_layers(text: str | None) -> list[int] | str | None:
    if text is None or text == "all":
        return text
    try:
        layers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise PlotInputError(f"--layers takes comma-separated layer indices or 'all', got {text!r}") from None
    if not layers or any(layer < 0 for layer in layers):
        raise PlotInputError(f"--layers takes non-negative layer indices, got {text!r}")
    return layers


def _load_runs(run_dirs: Sequence[str | Path], layers: Sequence[int] | str | None, keys: Sequence[str],
               prefix: str) -> list[tuple[Path, Series, Sequence[int] | None]]:
    """(run directory, series, chosen layers) of every run with diagnostics. A run without any diagnostic key (one
    trained with diagnostics off, next to one with them) is skipped with a warning naming it; only when no run has
    any is it an error."""
    loaded = [(run_dir, layer_series(load_metrics(run_dir), prefix)) for run_dir in map(Path, run_dirs)]
    with_diag = [(run_dir, series) for run_dir, series in loaded if series]
    if not with_diag:
        # no run to plot: every run's own error, the first one raised
        for run_dir, series in loaded:
            _check_run(run_dir, series, None, keys, prefix)
    runs = []
    for run_dir, series in loaded:
        if not series:
            logger.warning("%s: skipped, no diagnostic keys ('%slayerNN/...': trained with diagnostics.every_n_steps"
                           " = 0); plotting the %d run(s) that have them", run_dir / "metrics.jsonl", prefix,
                           len(with_diag))
            continue
        chosen = sorted(series) if layers == "all" else layers
        _check_run(run_dir, series, chosen, keys, prefix)
        runs.append((run_dir, series, chosen))
    return runs


def diagnostics_figure(
    run_dirs: Sequence[str | Path],
    layers: Sequence[int] | str | None = None,
    keys: Sequence[str] = DEFAULT_KEYS,
    prefix: str = "diag/",
) -> Figure:
    """One panel per statistic in ``keys`` against step, one line per run (and layer); see :func:`plot_diagnostics`.

    Colour: the run's formulation (:func:`formulation_color`), whatever the order of ``run_dirs``; layers of a run:
    shades of that colour and line styles; a second run of one formulation: markers."""
    if not run_dirs:
        raise PlotInputError("no run directories given")
    keys = list(keys)
    runs = _load_runs(run_dirs, layers, keys, prefix)
    labels = [run_label(run_dir) for run_dir, _, _ in runs]
    # Two runs of one attention (seeds, learning rates) need their directory names to be told apart.
    labels = [f"{label} ({run_dir.resolve().name})" if labels.count(label) > 1 else label
              for (run_dir, _, _), label in zip(runs, labels)]
    # a run without a formulation in its summary is coloured by its directory name (deterministic too)
    formulations = [run_formulation(run_dir) or run_dir.resolve().name for run_dir, _, _ in runs]
    hues = [formulation_color(f) for f in formulations]
    repeat = [formulations[:i].count(f) for i, f in enumerate(formulations)]

    ncols = min(len(keys), 3)
    nrows = math.ceil(len(keys) / ncols)
    fig = Figure(figsize=(5.0 * ncols, 3.8 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, key in zip(axes, keys):
        drawn: list[float] = []
        for (_, series, chosen), label, hue, rep in zip(runs, labels, hues, repeat):
            if chosen is None:
                lines = [(label, _over_layers(series, key), hue, "-")]
            else:
                lines = [(f"{label} layer{layer:02d}", series[layer].get(key, {}), shade(hue, pos, len(chosen)),
                          _LINESTYLES[pos % len(_LINESTYLES)]) for pos, layer in enumerate(chosen)]
            for line_label, values, color, style in lines:
                steps = sorted(values)
                ys = [values[s] for s in steps]
                drawn += [y for y in ys if math.isfinite(y)]
                marker = _MARKERS[rep % len(_MARKERS)]
                ax.plot(steps, ys, label=line_label, color=color, linestyle=style, linewidth=1.4, marker=marker or None,
                        markersize=4, markevery=max(1, len(steps) // 8))
        # Log scale as in Figure A6 when it can show every value (a share of heads may be exactly 0).
        if drawn and all(y > 0 for y in drawn):
            plain_log_axis(ax, drawn)
        else:
            plain_linear_axis(ax.yaxis)
        plain_linear_axis(ax.xaxis)
        reduction = "" if layers is not None else (" (layer of the max logit)" if key in _AT_MAX else
                                                   " (min over layers)" if "entropy" in key else " (max over layers)")
        # wrapped, never cut: a panel is 5 inches, about 40 characters of the title font
        ax.set_title(textwrap.fill(key + reduction, width=_TITLE_CHARS))
        ax.set_xlabel(STEP_LABEL)
        ax.set_ylabel(axis_label(key))
        ax.grid(True, which="both", alpha=0.3)
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    axes[0].legend(fontsize="small")
    fig.suptitle("attention diagnostics " + ("(over layers)" if layers is None else "(per layer)"))
    return fig


def plot_diagnostics(
    run_dirs: Sequence[str | Path],
    out: str | Path,
    layers: Sequence[int] | str | None = None,
    keys: Sequence[str] = DEFAULT_KEYS,
    prefix: str = "diag/",
) -> Path:
    """Draw one panel per statistic in ``keys`` against step, one line per run (and layer), and save ``out``.

    ``layers``: None plots one value per run over layers (max logit and the norms of that layer's max pair, min for
    entropies, max otherwise); a list of indices, or ``"all"``, plots those layers' own lines.
    """
    fig = diagnostics_figure(run_dirs, layers, keys, prefix)
    out = Path(out)
    make_dirs(out.parent)
    save_figure(fig, out, dpi=120)
    return out


def image_path(text: str) -> Path:
    """argparse type of ``--out``: an image file's path. A folder (``--out figs/``) is refused, as is a name without
    a format's suffix: with ``--overwrite`` the folder would be moved aside and a file of its name written."""
    path = output_path(text, file=True)
    if path.is_dir() or text.endswith("/"):
        raise argparse.ArgumentTypeError(f"{text} is a folder; expected the image file to write, e.g. "
                                         f"{path / 'figure.png'}")
    if not path.suffix:
        raise argparse.ArgumentTypeError(f"{text} has no suffix; expected an image file name ending in its format, "
                                         "e.g. .png, .pdf or .svg")
    from matplotlib.backend_bases import FigureCanvasBase  # the formats savefig writes, whatever the backend

    formats = FigureCanvasBase.get_supported_filetypes()
    if path.suffix[1:].lower() not in formats:
        raise argparse.ArgumentTypeError(f"{text}: {path.suffix} is not an image format matplotlib writes; expected "
                                         f"one of {', '.join('.' + f for f in sorted(formats))}")
    return path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=program_name("quest-plot"), description=doc_summary(__doc__))
    commands = parser.add_subparsers(dest="command", required=True)
    diag = commands.add_parser(
        "diagnostics",
        help="max attention logit and the q/k norms of its pair against step (QUEST paper, Figure A6)",
        description="Plot attention diagnostics from each RUN_DIR/metrics.jsonl; see docs/diagnostics.md.",
    )
    diag.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", type=input_path)
    diag.add_argument("--out", required=True, type=image_path, help="output image (.png, .pdf, .svg)")
    diag.add_argument("--overwrite", action="store_true",
                      help="replace an existing --out (the old file is kept in .replaced/ beside it)")
    diag.add_argument(
        "--layers",
        help="comma-separated layer indices (e.g. 0,3) or 'all' for per-layer lines; default: one line per run "
        "over layers (max logit, the norms of that layer's max pair, min entropy)",
    )
    diag.add_argument(
        "--keys",
        nargs="+",
        default=list(DEFAULT_KEYS),
        help=f"per-layer statistics, one panel each (default: {' '.join(DEFAULT_KEYS)}); also e.g. entropy_mean, "
        "q_norm_max, head01/max_logit",
    )
    diag.add_argument("--prefix", default="diag/", help="key prefix the run was logged with (default: diag/)")
    perf = commands.add_parser("perf", help="data wait and images/s per device against step (docs/training.md)",
                               description="Plot each RUN_DIR/metrics.jsonl's telemetry (perf/ rows).")
    perf.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", type=input_path)
    perf.add_argument("--out", required=True, type=image_path, help="output image (.png, .pdf, .svg)")
    perf.add_argument("--overwrite", action="store_true",
                      help="replace an existing --out (the old file is kept in .replaced/ beside it)")
    expl = commands.add_parser(
        "explain",
        help="one explanation method's maps of several runs on the same images (QUEST paper, Figure 1)",
        description="Compare the maps eval=explain wrote (RUN_DIR/eval/<suite>/<checkpoint>-<weights>/"
        "explain_maps.pt); see docs/explain.md.",
    )
    expl.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", type=input_path)
    expl.add_argument("--out", required=True, type=image_path, help="output image (.png, .pdf, .svg)")
    expl.add_argument("--overwrite", action="store_true",
                      help="replace an existing --out (the old file is kept in .replaced/ beside it)")
    expl.add_argument("--method", default="agcam", help="attention, rollout or agcam (default: agcam)")
    expl.add_argument("--suite", help="the eval suite that wrote the maps (default: any, last-model first)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point; returns the exit status (2 with a message on stderr for unusable input)."""
    args = parse_arguments(_parser(), argv)
    out = Path(args.out)
    try:
        # the figure held from the check to its save (quest.store.output_folder: .<name>.lock beside it, gone at the end);
        # drawn before anything in its folder changes, so that a refused input leaves an earlier figure where it was
        with holding(out.parent, "quest-plot", output=out.name) as folder:
            refuse_present([out], args.overwrite)  # an earlier figure is replaced only when asked
            fig, dpi = _figure(args)
            image = figure_bytes(fig, out, dpi=dpi)  # rendered before the first change: a refused format moves nothing
            folder.make_room([out])
            atomic_write(out, lambda f: f.write(image))
    except (PlotInputError, OutputExists, FolderHeld) as err:
        return input_error(program_name("quest-plot"), err)
    print(out)
    return 0


def _figure(args: argparse.Namespace) -> tuple[Any, int]:
    """The figure ``args`` asks for and the dpi it is saved at."""
    if args.command == "explain":
        from quest.explain.figures import DPI, compare_figure

        try:  # every run's file read and checked before any is drawn (quest.explain.maps_file)
            return compare_figure(args.run_dirs, args.method, args.suite), DPI
        except (FileNotFoundError, ValueError) as err:
            raise PlotInputError(str(err)) from err
    if args.command == "perf":
        from .perf_plot import perf_figure

        return perf_figure(args.run_dirs), 120
    keys = [k for part in args.keys for k in part.split(",") if k]
    return diagnostics_figure(args.run_dirs, _parse_layers(args.layers), keys, args.prefix), 120


if __name__ == "__main__":  # quest's one error path (quest/runtime/errors.py), as the quest-plot console script
    from quest.runtime.errors import program_name, reporting_errors

    with reporting_errors(program_name("quest-plot")):
        code = main()
    sys.exit(code)
