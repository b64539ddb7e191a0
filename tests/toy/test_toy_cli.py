"""The toy study's command line (quest.toy / quest-toy): outputs and resume, refusals, the sensitivity study, the
quick grid's composition. The study itself: tests/toy/test_toy.py."""
from __future__ import annotations

import csv
import json
import subprocess

import pytest
import torch
from hydra import compose, initialize_config_dir

from quest.toy import OUTCOMES, classify
from quest.toy.config import OutcomeRules, PaperOutcomeRules, register_toy_config
from quest.toy.outcomes import PAPER_OUTCOMES, classify_paper, wilson_interval

from ..helpers import CONFIGS, ROOT
from ..warm import run_app

# --- the command line ----------------------------------------------------------------------------------------------
TINY = ["grid=quick", "grid.lrs=[0.01]", "grid.weight_decays=[0.0,0.1]", "grid.data_seeds=[0]", "grid.init_seeds=[0,1]",
        "data.train_size=64", "data.test_size=64", "train.epochs=2", "probe_size=32", "workers=1", "compile=false"]


def _toy(*args: str) -> subprocess.CompletedProcess:  # forked from the warm zygote: the command, not the interpreter
    return run_app("quest.toy", *args, cwd=ROOT, timeout=600)


def test_cli_writes_outputs_and_resumes(tmp_path):
    out = tmp_path / "toy"
    proc = _toy(*TINY, "attentions=[standard,quest]", f"out_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = list(csv.DictReader((out / "runs.csv").open()))
    assert len(rows) == 2 * 2 * 2
    assert set(rows[0]) == {"attention", "lr", "weight_decay", "data_seed", "init_seed", "train_acc", "test_acc",
                            "final_train_loss", "outcome", "paper_outcome"}
    assert {r["outcome"] for r in rows} <= set(OUTCOMES) and {r["paper_outcome"] for r in rows} <= set(PAPER_OUTCOMES)
    for r in rows:  # outcomes are those of the classifiers on the stored accuracies
        assert r["outcome"] == classify(float(r["train_acc"]), float(r["test_acc"]), OutcomeRules())
        assert r["paper_outcome"] == classify_paper(float(r["train_acc"]), float(r["test_acc"]), PaperOutcomeRules())
    rates = list(csv.DictReader((out / "success_rates.csv").open()))
    assert {(r["attention"], r["lr"]) for r in rates} == {(a, lr) for a in ("standard", "quest") for lr in ("all", "0.01")}
    for png in ("success_heatmaps.png", "key_norms.png"):
        assert (out / png).stat().st_size > 10_000
    norms = torch.load(out / "key_norms.pt", weights_only=True)
    assert norms["quest"].shape == (4, 3, 3)  # runs, epochs + 1, token groups
    # a rerun finds every chunk done and reproduces the same table without training
    before = (out / "runs.csv").read_text()
    again = _toy(*TINY, "attentions=[standard,quest]", f"out_dir={out}")
    assert again.returncode == 0 and "skipped" in again.stdout + again.stderr
    assert (out / "runs.csv").read_text() == before
    # the same directory with a different config is refused, not mixed
    other = _toy(*TINY, "attentions=[standard,quest]", "train.epochs=3", f"out_dir={out}")
    assert other.returncode != 0 and "different toy config" in other.stdout + other.stderr


def test_cli_rejects_an_unknown_attention_and_a_missing_gpu(tmp_path):
    proc = _toy(*TINY, "attentions=[standard,nope]", f"out_dir={tmp_path}")
    assert proc.returncode != 0 and "['nope'] not usable" in proc.stdout + proc.stderr
    if not torch.cuda.is_available():
        proc = _toy(*TINY, "attentions=[quest]", "device=cuda", f"out_dir={tmp_path}")
        assert proc.returncode != 0 and "no CUDA device" in proc.stdout + proc.stderr


SENS = ["study=sensitivity", "study.train_sizes=[32,64]", "grid.lrs=[0.01]", "grid.data_seeds=[0,1]",
        "grid.init_seeds=[0]", "attentions=[standard,quest]", "study.scale_variants=[qknorm,qknorm_fixed_rsqrt_d]",
        "train.epochs=2", "data.test_size=64", "compile=false"]


@pytest.mark.process  # the two workers: interpreters the study spawns (multiprocessing "spawn"), its pool the point
def test_sensitivity_command_outputs(tmp_path):
    """study=sensitivity on a tiny grid, in three processes (the command's and two spawned workers): the CSV holds
    every axis, formulation and size with counts and Wilson intervals recomputed from runs.csv; every chunk's progress
    lines, also those of chunks the workers trained, are in the command's output; the figure and the
    stopping rule's verdict are written; the same command with one worker (in process, one thread as each worker
    has) reproduces the runs exactly."""
    out = tmp_path / "sens"
    # a progress line at every epoch (each takes far more than the microsecond asked for), wherever it trained
    proc = _toy(*SENS, "workers=3", "log_every_s=0.000001", f"out_dir={out}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the spawned workers' lines reach the command's log through the parent: every chunk's, both epochs
    for name in ("standard", "quest", "qknorm", "qknorm_fixed_rsqrt_d"):
        for size in (32, 64):
            for seed in (0, 1):
                for epoch in (1, 2):
                    assert f"{name}, n={size}, data {seed}: epoch {epoch}/2, " in proc.stdout, (name, size, seed)
    runs = list(csv.DictReader((out / "runs.csv").open()))
    names = ["standard", "quest", "qknorm", "qknorm_fixed_rsqrt_d"]
    assert sorted({(r["attention"], r["train_size"]) for r in runs}) == sorted(
        (a, n) for a in names for n in ("32", "64"))
    assert len(runs) == 4 * 2 * 2 * 2 and {"test_acc_b0", "test_acc_b0.5"} <= set(runs[0])
    for r in runs:
        assert r["test_acc"] == r["test_acc_b0"]  # the default test set is the one without biased samples
    table = list(csv.DictReader((out / "sensitivity.csv").open()))
    axes = {(r["axis"], r["attention"]) for r in table}
    assert {("train_size", a) for a in names} <= axes
    assert {("qknorm_scale", a) for a in ("qknorm", "qknorm_fixed_rsqrt_d")} <= axes
    assert {("test_biased_fraction", a) for a in ("standard", "quest")} <= axes
    assert {("outcome_rules", a) for a in ("standard", "quest")} <= axes
    for row in table:
        members = [r for r in runs if r["attention"] == row["attention"] and r["train_size"] == row["train_size"]]
        test_key = "test_acc_b" + f"{float(row['test_biased_fraction']):g}"
        if row["rules"] == "paper":
            outcomes = [classify_paper(float(r["train_acc"]), float(r[test_key]), PaperOutcomeRules()) for r in members]
        else:
            outcomes = [classify(float(r["train_acc"]), float(r[test_key]), OutcomeRules()) for r in members]
        k, n = outcomes.count("correct"), len(members)
        assert int(row["runs"]) == n and int(row["correct"]) == k
        assert float(row["success_rate"]) == pytest.approx(k / n, abs=1e-6)
        assert (float(row["ci_low"]), float(row["ci_high"])) == pytest.approx(wilson_interval(k, n), abs=1e-6)
        other = outcomes.count("other") + outcomes.count("unclassified")
        assert int(row["other"]) == other
    assert (out / "sensitivity.png").stat().st_size > 20_000
    verdict = json.loads((out / "sensitivity.json").read_text())["stop"]
    assert verdict["size"] in (32, 64) and verdict["rule"] == {"min_points": 5.0, "z": 2.0}
    assert [c["attention"] for c in verdict["steps"][0]["checks"]] == ["standard", "quest"]
    single = _toy(*SENS, "workers=1", "threads=1", f"out_dir={tmp_path / 'one'}")
    assert single.returncode == 0, single.stderr[-3000:]
    assert (tmp_path / "one" / "runs.csv").read_text() == (out / "runs.csv").read_text()


def test_quick_grid_is_standard_against_quest_at_4096_samples():
    """grid=quick as configs/toy/grid/quick.yaml says: standard against QUEST, 16 runs each (2 learning rates x 8
    initialisations) on 4,096 samples, where the full grid had runs of each succeed (docs/results/toy/full-n4096).
    Training it takes a minute; CI's wheel smoke runs that command (.ci/run), and what the command writes is tested
    above on a tiny grid."""
    register_toy_config()
    with initialize_config_dir(config_dir=str(CONFIGS / "toy"), version_base="1.3"):
        cfg = compose(config_name="toy", overrides=["grid=quick"])
    grid = cfg.grid
    assert list(cfg.attentions) == ["standard", "quest"] and cfg.data.train_size == 4096
    assert len(grid.lrs) * len(grid.weight_decays) * len(grid.data_seeds) * len(grid.init_seeds) == 16


def test_the_default_device_is_the_cpu_with_a_process_per_core_also_beside_a_gpu(tmp_path, monkeypatch):
    """device=auto, the default, trains on the CPU, a worker per core, also where torch sees a GPU (the toy models
    are too small for a GPU to pay: docs/experiments.md, "Which device"); a device given is used as given, on a GPU
    by one process. What the study would train is caught before anything trains."""
    import os

    from omegaconf import OmegaConf

    import quest.toy.study as study

    register_toy_config()
    with initialize_config_dir(config_dir=str(CONFIGS / "toy"), version_base="1.3"):
        cfg = OmegaConf.to_container(compose(config_name="toy", overrides=["grid=quick"]), resolve=True)
    assert cfg["device"] == "auto"
    trained: list[dict] = []

    class Caught(Exception):
        pass

    def execute(cfg, tasks, folder):
        trained.append(cfg)
        raise Caught

    monkeypatch.setattr(study, "_execute", execute)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a machine with a GPU
    for device, expected, workers in (("auto", "cpu", len(os.sched_getaffinity(0))), ("cuda", "cuda", 1)):
        with pytest.raises(Caught):
            study.run_study({**cfg, "device": device}, tmp_path)
        assert trained[-1]["device"] == expected and study._default_workers(trained[-1]) == workers
