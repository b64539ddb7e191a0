"""Every file a run directory holds is the run's own: one that is a link resolving into another run (its summary.json
counted twice, n=2 with std 0) is refused naming the file and where it points; a link within the run is read."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from quest.report.__main__ import main
from quest.report.run_metrics import PlotInputError, load_metrics, run_formulation

#: every file of a run directory quest-report reads
RUN_FILES = ("summary.json", "run.json", "metrics.jsonl", ".hydra/config.yaml",
             "eval/suite/last-model/eval_results.json")


def _run(root: Path, name: str, seed: int, top1: float, record: bool) -> Path:
    """A run directory as train.py and eval.py leave it, written by hand (its numbers are the test's)."""
    run = root / name
    config = {"attention": {"name": "quest"}, "model": {"name": "vit_tiny"}, "trainer": {"seed": seed}}
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(OmegaConf.create(config), run / ".hydra" / "config.yaml")
    if record:  # run.json is read before .hydra/config.yaml: without it the report reads Hydra's copy
        (run / "run.json").write_text(json.dumps({"history": [], "config": config}))
    (run / "summary.json").write_text(json.dumps({"status": "completed", "val/top1": top1, "attention": "quest"}))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 2.0}) + "\n")
    results = run / "eval" / "suite" / "last-model" / "eval_results.json"
    results.parent.mkdir(parents=True)
    results.write_text(json.dumps({"status": "complete", "suite": "suite", "target": {
        "checkpoint": str(run / "checkpoints" / "last.pt"), "weights": "model"}, "results": {"clean": {"top1": top1}}}))
    return run


@pytest.mark.parametrize("name", RUN_FILES)
def test_a_run_file_linked_to_another_runs_is_refused_and_one_linked_within_is_read(tmp_path, capsys, name):
    root = tmp_path / "sweep"
    record = name != ".hydra/config.yaml"
    own, other = _run(root, "a", 0, 40.0, record), _run(root, "b", 1, 60.0, record)
    assert main([str(root)]) == 0
    expected = capsys.readouterr().out
    assert "50.00" in expected  # the mean of both runs' 40 and 60: each run's own numbers

    kept = own / ".kept" / Path(name).name  # a hidden folder of the run: no run of the sweep is looked for there
    kept.parent.mkdir()
    (own / name).rename(kept)
    (own / name).symlink_to(os.path.relpath(kept, (own / name).parent))
    assert main([str(root)]) == 0
    assert capsys.readouterr().out == expected  # a link within the run is the run's own file

    (own / name).unlink()
    (own / name).symlink_to(other / name)
    assert main([str(root)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert f"{own / name}: a link to {(other / name).resolve()}, outside {own}" in captured.err


def test_the_figures_refuse_a_linked_metrics_log_or_summary(tmp_path):
    own, other = _run(tmp_path, "a", 0, 40.0, True), _run(tmp_path, "b", 1, 60.0, True)
    assert run_formulation(own) == "quest" and load_metrics(own) == [{"step": 1, "train/loss": 2.0}]
    for name in ("metrics.jsonl", "summary.json"):
        (own / name).unlink()
        (own / name).symlink_to(other / name)
    with pytest.raises(PlotInputError, match=f"{own / 'metrics.jsonl'}: a link to .*outside"):
        load_metrics(own)
    with pytest.raises(PlotInputError, match=f"{own / 'summary.json'}: a link to .*outside"):
        run_formulation(own)


@pytest.mark.parametrize("name", ["summary.json", "run.json", "metrics.jsonl", "checkpoints", ".hydra",
                                  "checkpoints/last.pt", ".hydra/config.yaml", "tensorboard"])
def test_a_resume_refuses_a_run_path_linked_to_another_run_and_writes_nothing(tmp_path, name):
    """Every path a run writes (quest.run.directory): a link out of the run directory would have training believe
    another run's files and write through into them (its checkpoints, Hydra's record, its metrics log)."""
    from quest.config.checks import ConfigError
    from quest.train import fit

    from ..helpers import FAST, compose_cfg

    other = _run(tmp_path, "other", 0, 40.0, True)
    (other / "checkpoints").mkdir()
    (other / "checkpoints" / "last.pt").write_bytes(b"the other run's checkpoint")
    (other / "tensorboard").mkdir()
    run = tmp_path / "run"
    (run / name).parent.mkdir(parents=True)
    (run / name).symlink_to(other / name)
    before = {p: p.read_bytes() for p in sorted(other.rglob("*")) if p.is_file()}
    inside = sorted(os.listdir(run))
    with pytest.raises(ConfigError, match=f"{run / name}: a link to {other / name}, outside {run}"):
        fit(compose_cfg(*FAST, "logger.tensorboard=true"), run)
    assert {p: p.read_bytes() for p in sorted(other.rglob("*")) if p.is_file()} == before
    assert sorted(os.listdir(run)) == inside


def test_quest_export_refuses_a_summary_linked_to_another_run(tmp_path):
    from quest.tools.export import run_summary

    own, other = _run(tmp_path, "a", 0, 40.0, True), _run(tmp_path, "b", 1, 60.0, True)
    (own / "checkpoints").mkdir()
    assert run_summary(own / "checkpoints" / "last.pt")["val/top1"] == 40.0
    (own / "summary.json").unlink()
    (own / "summary.json").symlink_to(other / "summary.json")  # it would call an unfinished run finished
    with pytest.raises(ValueError, match=f"cannot read {own / 'summary.json'}: a link to .*outside {own}"):
        run_summary(own / "checkpoints" / "last.pt")


def test_a_summary_or_an_evaluation_of_another_run_is_not_credited_to_this_one(tmp_path, capsys, caplog):
    """A summary.json copied from another run (it names another attention than the run's config) refuses the report
    naming it; an evaluation of another run's weights (copied into this run's eval/) is left out, saying why."""
    run = _run(tmp_path / "sweep", "a", 0, 40.0, True)
    results = run / "eval" / "suite" / "last-model" / "eval_results.json"
    record = json.loads(results.read_text())
    record["target"].update(attention="standard", model="vit_tiny")
    record["results"]["clean"]["top1"] = 77.0
    results.write_text(json.dumps(record))
    assert main([str(tmp_path / "sweep")]) == 0
    captured = capsys.readouterr()
    assert "77.00" not in captured.out and "40.00" in captured.out and "1 older evaluation(s) left out" in captured.out
    assert "another run's weights (it names attention 'standard', and the run's config 'quest')" in caplog.text

    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "attention": "standard"}))
    assert main([str(tmp_path / "sweep")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert f"{run / 'summary.json'}: it names attention 'standard', and the run's config 'quest' ({run / 'run.json'})" \
        in captured.err
