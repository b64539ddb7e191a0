"""``python -m quest.report.plot diagnostics`` on synthetic run directories."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from quest.report.plot import PlotInputError, layer_series, load_metrics, main, plot_diagnostics, run_label

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
    out = tmp_path / "cli.png"
    result = subprocess.run(
        [sys.executable, "-m", "quest.report.plot", "diagnostics", str(runs[1]), "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )
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


def test_run_without_diagnostics_is_named(runs, tmp_path, capsys):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "train/loss": 1.0}) for s in range(5)))
    assert main(["diagnostics", str(runs[0]), str(plain), "--out", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err
    assert str(plain / "metrics.jsonl") in err and "diag/layerNN/max_logit" in err
    assert "diagnostics.every_n_steps" in err


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
    with pytest.raises(PlotInputError, match=r"metrics.jsonl:2: expected a JSON object with an integer 'step'"):
        load_metrics(run)


def test_bad_layers_option(runs, tmp_path, capsys):
    assert main(["diagnostics", str(runs[0]), "--out", str(tmp_path / "x.png"), "--layers", "0,x"]) == 2
    assert "--layers" in capsys.readouterr().err
