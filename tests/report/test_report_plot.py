"""``python -m quest.report.plot diagnostics`` on synthetic run directories."""
from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from quest.report.plot import (
    FORMULATION_COLORS,
    PlotInputError,
    diagnostics_figure,
    formulation_color,
    layer_series,
    load_metrics,
    main,
    plain_log_axis,
    plot_diagnostics,
    run_label,
)
from tests.warm import run_app

ROOT = Path(__file__).resolve().parents[2]

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
STATS = ("max_logit", "q_norm_at_max", "k_norm_at_max", "q_norm_mean", "entropy_mean", "low_entropy_head_frac")


def write_run(root: Path, name: str, growth: float, summary: dict | None = None, layers: int = 4) -> Path:
    """A run whose logits grow like exp(growth * step); diagnostics every 10 steps, training loss every step."""
    run = root / name
    run.mkdir()
    lines = []
    for step in range(0, 50):
        record = {"step": step, "train/loss": 2.0 / (1 + step)}
        if step % 10 == 0:
            for layer in range(layers):
                tag = f"diag/layer{layer:02d}/"
                record[tag + "max_logit"] = (layer + 1) * math.exp(growth * step)
                record[tag + "q_norm_at_max"] = 3.0 + layer + growth * step
                record[tag + "k_norm_at_max"] = 2.0 + layer
                record[tag + "q_norm_mean"] = 1.0
                record[tag + "entropy_mean"] = 4.0 - 0.01 * step * layer
                record[tag + "low_entropy_head_frac"] = 0.0
                record[tag + "head01/max_logit"] = float(layer + 1)
            record["diag/max_logit"] = layers * math.exp(growth * step)
        lines.append(json.dumps(record))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if summary is not None:
        (run / "summary.json").write_text(json.dumps(summary))
    return run


@pytest.fixture
def runs(tmp_path):
    return [
        write_run(tmp_path, "run_a", 0.05, {"choices": {"attention": "standard", "model": "vit_pico"}}),
        write_run(tmp_path, "run_b", 0.0, {"attention": "quest"}),
        write_run(tmp_path, "run_c", 0.01),  # no summary.json: labelled by directory name
    ]


def assert_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 1000
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_plots_max_over_layers(runs, tmp_path, capsys):
    out = tmp_path / "figs" / "a6.png"
    assert main(["diagnostics", *map(str, runs), "--out", str(out)]) == 0
    assert_png(out)
    assert str(out) in capsys.readouterr().out


def test_plots_chosen_layers_and_keys(runs, tmp_path):
    out = tmp_path / "layers.png"
    assert main(["diagnostics", *map(str, runs), "--out", str(out), "--layers", "0,3",
                 "--keys", "max_logit", "entropy_mean", "low_entropy_head_frac", "head01/max_logit"]) == 0
    assert_png(out)
    out_all = tmp_path / "single.png"
    assert main(["diagnostics", str(runs[0]), "--out", str(out_all), "--layers", "all"]) == 0
    assert_png(out_all)


def test_module_runs_as_a_script(runs, tmp_path):
    """``python -m quest.report.plot``: exit status and output of a process of its own (forked warm, tests/warm.py)."""
    out = tmp_path / "cli.png"
    result = run_app("quest.report.plot", "diagnostics", str(runs[1]), "--out", str(out), cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert_png(out)


def test_labels_from_summary_or_directory(runs, tmp_path):
    assert [run_label(r) for r in runs] == ["standard", "quest", "run_c"]
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "summary.json").write_text("{not json")
    assert run_label(tmp_path / "broken") == "broken"


def test_series_keep_the_last_value_of_a_step_and_skip_a_truncated_last_line(tmp_path):
    run = tmp_path / "resumed"
    run.mkdir()
    lines = [
        {"step": 0, "diag/layer00/max_logit": 1.0},
        {"step": 0, "diag/layer00/max_logit": 2.0},  # a resumed run logs step 0 again
        {"step": 1, "train/loss": 1.0},
    ]
    (run / "metrics.jsonl").write_text("\n".join(map(json.dumps, lines)) + '\n{"step": 2, "diag/la')
    assert layer_series(load_metrics(run)) == {0: {"max_logit": {0: 2.0}}}


def test_missing_metrics_file_is_named(tmp_path, capsys):
    empty = tmp_path / "empty_run"
    empty.mkdir()
    assert main(["diagnostics", str(empty), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert str(empty / "metrics.jsonl") in err and "one JSON object per line" in err
    assert not (tmp_path / "x.png").exists()
    with pytest.raises(PlotInputError, match="not a directory"):
        plot_diagnostics([tmp_path / "nowhere"], tmp_path / "x.png")


def _plain_run(root: Path, name: str = "plain") -> Path:
    """A run trained without diagnostics: metrics.jsonl has no diag/ keys."""
    plain = root / name
    plain.mkdir()
    (plain / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "train/loss": 1.0}) for s in range(5)))
    (plain / "summary.json").write_text(json.dumps({"attention": "quest"}))
    return plain


def test_a_run_without_diagnostics_is_skipped_with_a_warning_when_others_have_them(runs, tmp_path, caplog):
    plain = _plain_run(tmp_path)
    caplog.set_level(logging.WARNING, logger="quest.report")
    out = tmp_path / "x.png"
    assert main(["diagnostics", str(runs[0]), str(plain), str(runs[1]), "--out", str(out)]) == 0
    assert_png(out)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(plain / "metrics.jsonl") in warnings[0] and "skipped" in warnings[0]
    fig = diagnostics_figure([runs[0], plain, runs[1]])
    assert {line.get_label() for line in fig.axes[0].get_lines()} == {"standard", "quest"}


def test_only_runs_without_diagnostics_is_an_error_naming_them(tmp_path, capsys):
    plain, other = _plain_run(tmp_path), _plain_run(tmp_path, "other")
    assert main(["diagnostics", str(plain), str(other), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert str(plain / "metrics.jsonl") in err and "diag/layerNN/max_logit" in err
    assert "diagnostics.every_n_steps" in err and not (tmp_path / "x.png").exists()


def test_missing_layer_or_key_is_named(runs, tmp_path):
    with pytest.raises(PlotInputError, match=r"run_a.*no layer 7 \(layers present: 0, 1, 2, 3\)"):
        plot_diagnostics(runs, tmp_path / "x.png", layers=[7])
    with pytest.raises(PlotInputError, match="no 'diag/layerNN/entropy_min'.*statistics present: .*max_logit"):
        plot_diagnostics(runs, tmp_path / "x.png", keys=["entropy_min"])


def test_malformed_lines_are_named(tmp_path):
    run = tmp_path / "bad"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(PlotInputError, match=r"metrics.jsonl:2: not valid JSON"):
        load_metrics(run)
    (run / "metrics.jsonl").write_text('{"step": 0}\n{"train/loss": 1.0}\n')
    with pytest.raises(PlotInputError, match=r"metrics.jsonl:2: no step; expected .*a JSON object with an integer 'step'"):
        load_metrics(run)


def test_bad_layers_option(runs, tmp_path, capsys):
    assert main(["diagnostics", str(runs[0]), "--out", str(tmp_path / "x.png"), "--layers", "0,x"]) == 2
    assert "--layers" in capsys.readouterr().err


def _colours(fig) -> dict[str, str]:
    """Line label -> colour (hex) of every line in every panel; a label has one colour across panels."""
    out: dict[str, str] = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            colour = to_hex(line.get_color())
            assert out.setdefault(line.get_label(), colour) == colour, line.get_label()
    return out


@pytest.mark.parametrize("layers", [None, [0, 3]])
def test_a_formulation_has_its_colour_whatever_the_order_of_the_runs(runs, layers):
    orders = [runs, runs[::-1], [runs[1], runs[2], runs[0]]]
    colours = [_colours(diagnostics_figure(order, layers=layers)) for order in orders]
    assert colours[0] == colours[1] == colours[2]
    if layers is None:
        assert colours[0]["standard"] == FORMULATION_COLORS["standard"]
        assert colours[0]["quest"] == FORMULATION_COLORS["quest"]
        assert colours[0]["run_c"] == formulation_color("run_c")  # no summary.json: coloured by its name
    # the same run alone keeps its colour too
    alone = _colours(diagnostics_figure([runs[1]], layers=layers))
    assert all(colours[0][label] == colour for label, colour in alone.items())


def test_every_configured_formulation_has_its_own_fixed_colour():
    # path.yaml is the entry for a formulation given as pkg.module:Class, not a formulation of its own
    names = sorted(p.stem for p in (ROOT / "configs" / "attention").glob("*.yaml") if p.stem != "path")
    assert set(names) <= set(FORMULATION_COLORS), "a new formulation needs a colour in FORMULATION_COLORS"
    assert len({FORMULATION_COLORS[n] for n in names}) == len(names)


@pytest.mark.process  # another hash seed is a new interpreter's: a fork keeps its parent's
def test_other_names_get_further_colours_deterministically():
    names = ["my_new_attention", "run_c", "sigmoid"]
    colours = [formulation_color(n) for n in names]
    assert colours == [formulation_color(n) for n in names]
    assert not set(colours) & set(FORMULATION_COLORS.values())
    # the same in another process with another hash seed (Python's hash() would differ)
    code = f"from quest.report.plot import formulation_color; print([formulation_color(n) for n in {names!r}])"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == repr(colours)


def test_axes_say_their_units(runs):
    keys = ["max_logit", "q_norm_at_max", "k_norm_at_max", "q_norm_mean", "entropy_mean", "low_entropy_head_frac",
            "head01/max_logit"]
    fig = diagnostics_figure(runs, keys=keys)
    ylabels = [ax.get_ylabel() for ax in fig.axes if ax.get_visible()]
    assert ylabels == ["max attention logit (unitless)", "‖q‖₂ of the max-logit pair (unitless)",
                       "‖k‖₂ of the max-logit pair (unitless)", "mean ‖q‖₂ (unitless)",
                       "mean attention entropy (nats)", "share of heads below the entropy threshold (0-1)",
                       "head 01: max attention logit (unitless)"]
    assert all(ax.get_xlabel() == "training step (optimizer steps)" for ax in fig.axes if ax.get_visible())


@pytest.mark.parametrize("growth", [0.4, 0.05, 0.002])  # 8.7, 0.9 and 0.04 decades of max logit
def test_log_axes_read_as_plain_numbers(tmp_path, growth):
    run = write_run(tmp_path, "run", growth, {"attention": "standard"})
    fig = diagnostics_figure([run])
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.get_yscale() == "log"
    low, high = ax.get_ylim()
    for axis in (ax.yaxis, ax.xaxis):
        labels = [t.get_text() for t in axis.get_ticklabels(which="both") if t.get_text()]
        assert labels, "no tick labels"
        for text in labels:
            assert "$" not in text and "times" not in text, text  # no mathtext 10^x
            float(text.replace("\N{MINUS SIGN}", "-"))  # a plain number
        assert not axis.get_offset_text().get_text()  # no '1e4' offset
    shown = [t for t in ax.yaxis.get_majorticklocs() if low <= t <= high]
    assert len(shown) >= 2  # even within less than a decade the axis has labelled ticks


@pytest.mark.parametrize("low, high", [(0.13, 1.1), (0.8, 6.3), (1.0, 8.8), (7.0, 62.0), (40.0, 350.0), (3.0, 3.2),
                                       (0.5, 40.0), (0.01, 300.0), (4.0, 4.0)])
def test_both_ends_of_a_log_axis_have_labelled_ticks(low, high):
    """Within a decade, evenly spaced ticks (2, 4, 6, 8 on 0.9..8.8) left the stretched low end of a log axis
    without a label; every range now has a labelled tick in the lowest and in the highest third (log space), and
    no two labels overlap (4..4: a constant line, drawn with about a decade around it)."""
    fig = Figure(figsize=(5.0, 3.8))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    values = list(np.geomspace(low, high, 30))
    ax.plot(range(30), values)
    plain_log_axis(ax, values)
    fig.canvas.draw()
    bottom, top = (math.log10(v) for v in ax.get_ylim())
    labels = [t for t in ax.yaxis.get_ticklabels() if t.get_text() and t.get_visible()
              and bottom <= math.log10(t.get_position()[1]) <= top]
    where = [(math.log10(t.get_position()[1]) - bottom) / (top - bottom) for t in labels]
    assert len(labels) >= 2 and min(where) <= 1 / 3 and max(where) >= 2 / 3, [t.get_text() for t in labels]
    boxes = sorted((t.get_window_extent(fig.canvas.get_renderer()) for t in labels), key=lambda b: b.y0)
    assert all(a.y1 <= b.y0 for a, b in zip(boxes, boxes[1:]))  # no two labels overlap


def test_long_panel_titles_are_wrapped_not_cut(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": step, "diag/layer00/head01/low_entropy_head_frac": 0.1 * step,
                    "diag/layer00/max_logit": 1.0 + step}) + "\n" for step in range(0, 30, 10)))
    fig = diagnostics_figure([run], keys=["head01/low_entropy_head_frac", "max_logit"])
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    long_title, short_title = fig.axes[0].title, fig.axes[1].title
    assert long_title.get_text().replace("\n", " ") == "head01/low_entropy_head_frac (min over layers)"
    assert "\n" in long_title.get_text() and "\n" not in short_title.get_text()
    for ax in fig.axes[:2]:  # each title within its own panel's width, so neither cut nor over its neighbour
        title, panel = ax.title.get_window_extent(renderer), ax.get_window_extent(renderer)
        assert panel.x0 - 1 <= title.x0 and title.x1 <= panel.x1 + 1
