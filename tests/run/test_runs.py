"""A run is what its config says: run directory names, resume checks, finished runs, overwrite, matching ImageFolder
classes, and metrics of one run only (docs/training.md, "Runs, resume and provenance"). Its config's keys and values
are checked before any work: tests/config/test_train_config_messages.py."""
from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf
from PIL import Image

from quest.config.checks import ConfigError
from quest.run.checkpoint import load_checkpoint
from quest.train import fit

from ..helpers import CONFIGS, FAST, compose_cfg


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run_dir_name(*overrides: str) -> str:
    """hydra.run.dir as train.py would get it for these command-line overrides."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose("train", overrides=list(overrides), return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        return str(OmegaConf.select(cfg, "hydra.run.dir"))


# --- 1. the run directory's name follows the config ----------------------------------------------------------
def test_run_directory_name_follows_the_config():
    plain = _run_dir_name()
    assert plain == "runs/digits/vit_pico-quest-light-seed0"  # the README's quickstart directory
    assert _run_dir_name("attention=standard") == "runs/digits/vit_pico-standard-light-seed0"
    assert _run_dir_name("trainer.seed=3") == "runs/digits/vit_pico-quest-light-seed3"
    # what is trained differs: another directory, the same one for the same overrides
    changed = {o: _run_dir_name(o) for o in ("recipe.lr=0.05", "data.batch_size=32", "trainer.epochs=2",
                                           "diagnostics=default", "+model.kwargs.qkv_bias=false")}
    assert len(set(changed.values()) | {plain}) == len(changed) + 1, changed
    assert all(name.startswith(plain + "-") for name in changed.values())
    assert _run_dir_name("recipe.lr=0.05") == changed["recipe.lr=0.05"]
    # in words where short, sorted by key; a hash only where the words cannot say the value exactly
    assert changed["recipe.lr=0.05"] == plain + "-lr0.05"
    assert _run_dir_name("recipe.lr=0.05", "data.batch_size=32") == plain + "-bs32-lr0.05"
    assert changed["diagnostics=default"] == plain + "-diagnostics_default"
    assert changed["+model.kwargs.qkv_bias=false"] == plain + "-model.kwargs.qkv_bias_false"
    lists = _run_dir_name("recipe.opt_betas=[0.9,0.95]")
    assert re.fullmatch(re.escape(plain) + r"-recipe\.opt_betas__0\.9__0\.95_-[0-9a-f]{6}", lists), lists
    assert lists != _run_dir_name("recipe.opt_betas=[0.9,0.96]")
    # an import-path attention: no ':' (nor any character outside [A-Za-z0-9._+-]) in the directory name
    path_run = _run_dir_name("attention=path", "attention.name=my_pkg.mod:Mine")
    assert path_run == "runs/digits/vit_pico-my_pkg.mod_Mine-light-seed0", path_run
    for name in changed.values():
        assert re.fullmatch(r"[A-Za-z0-9._+/-]+", name), name
    # two data sets of the same name at two roots are two runs
    folder = ["data=imagefolder", "data.num_classes=3"]
    assert _run_dir_name(*folder, "data.root=/a") != _run_dir_name(*folder, "data.root=/b")
    # a root is named by what it holds, never by its path: the same data set moved to another disk is the same run
    moved = {_run_dir_name(*folder, f"data.root={root}") for root in ("/scratch/u1/imagenet", "/data/imagenet/")}
    assert moved == {"runs/imagefolder/vit_pico-quest-light-seed0-data.num_classes3-root_imagenet"}, moved
    assert _run_dir_name("trainer.init_from=/runs/a/checkpoints/last.pt") == plain + "-init_last.pt"
    # where and how a run executes is not part of its name
    for operational in ("trainer.device=cpu", "data.num_workers=2", "trainer.log_every_n_steps=5",
                        "trainer.max_steps=10", "logger=wandb", "trainer.compile=true"):
        assert _run_dir_name(operational) == plain, operational


def test_resume_with_another_config_names_every_key_that_differs(tmp_path):
    fit(compose_cfg(*FAST, "trainer.max_steps=2"), tmp_path)
    with pytest.raises(ConfigError, match=r"(?s)holds a run with another config.*data\.batch_size: 16 -> 8.*"
                                          r"recipe\.lr: 0\.002 -> 0\.05"):
        fit(compose_cfg(*FAST, "recipe.lr=0.05", "data.batch_size=8"), tmp_path)
    # resume-safe keys may change: the run continues and records what changed
    summary = fit(compose_cfg(*FAST, "trainer.log_every_n_steps=2", "data.num_workers=0"), tmp_path)
    assert summary["status"] == "completed" and summary["resumed"]
    assert summary["changed_on_resume"] == {"trainer.log_every_n_steps": [1, 2], "trainer.max_steps": [2, None]}
    history = json.loads((tmp_path / "run.json").read_text())["history"]
    assert [h["event"] for h in history] == ["start", "resume"]
    assert history[1]["changed"]["trainer.log_every_n_steps"] == [1, 2]


def test_finished_run_is_reported_and_never_rewritten(tmp_path, caplog):
    fit(compose_cfg(*FAST), tmp_path)
    files = {name: (tmp_path / name).read_bytes() for name in ("summary.json", "metrics.jsonl", "run.json")}
    last = (tmp_path / "checkpoints" / "last.pt").read_bytes()
    caplog.set_level("INFO", logger="quest.train")
    again = fit(compose_cfg(*FAST, "trainer.log_every_n_steps=4"), tmp_path)
    assert again["already_finished"] and again["status"] == "completed"
    assert {name: (tmp_path / name).read_bytes() for name in files} == files
    assert (tmp_path / "checkpoints" / "last.pt").read_bytes() == last
    assert "already holds this finished run" in caplog.text and "trainer.overwrite=true" in caplog.text
    assert "to train it longer: trainer.epochs=<more>" in caplog.text
    with pytest.raises(ConfigError, match=r"recipe\.lr: 0\.002 -> 0\.05"):  # another config is not "finished"
        fit(compose_cfg(*FAST, "recipe.lr=0.05"), tmp_path)


def test_a_longer_run_follows_the_schedule_of_its_new_length(tmp_path):
    fit(compose_cfg(*FAST, "trainer.epochs=3"), tmp_path / "straight")
    fit(compose_cfg(*FAST, "trainer.epochs=2"), tmp_path / "extended")
    summary = fit(compose_cfg(*FAST, "trainer.epochs=3"), tmp_path / "extended")
    assert summary["status"] == "completed" and summary["step"] == 12
    assert summary["changed_on_resume"] == {"trainer.epochs": [2, 3]}
    lr = {d: {r["step"]: r["train/lr"] for r in _rows(tmp_path / d) if "train/lr" in r} for d in ("straight", "extended")}
    assert sorted(lr["extended"]) == list(range(1, 13))  # every step once
    for step in range(9, 13):  # after the resume: the 3-epoch cosine, not the 2-epoch one that had ended
        assert lr["extended"][step] == pytest.approx(lr["straight"][step], rel=1e-12)
    with pytest.raises(ConfigError, match=r"trainer\.epochs: 3 -> 1.*extended, not shortened"):
        fit(compose_cfg(*FAST, "trainer.epochs=1"), tmp_path / "extended")


def _image_folder(root: Path, train: tuple[str, ...], val: tuple[str, ...], per_class: int = 6) -> Path:
    for split, classes in (("train", train), ("val", val)):
        for c, name in enumerate(classes):
            d = root / split / name
            d.mkdir(parents=True)
            for i in range(per_class):
                Image.new("RGB", (20, 20), (60 * c, 20 * i, 90)).save(d / f"img{i}.png")
    return root


FOLDER_BASE = ["data=imagefolder", "data.img_size=16", "data.batch_size=6", "data.num_workers=0", "model=vit_pico",
               "trainer.epochs=1", "trainer.log_every_n_steps=1"]
FOLDER = [*FOLDER_BASE, "data.num_classes=3"]


def test_moved_data_set_resumes_and_another_one_is_refused(tmp_path):
    data = _image_folder(tmp_path / "data", ("a", "b", "c"), ("a", "b", "c"))
    fit(compose_cfg(*FOLDER, f"data.root={data}", "trainer.max_steps=1"), tmp_path / "run")
    moved = tmp_path / "moved"
    shutil.copytree(data, moved)
    summary = fit(compose_cfg(*FOLDER, f"data.root={moved}", "trainer.max_steps=2"), tmp_path / "run")
    assert summary["status"] == "stopped" and summary["step"] == 2
    other = _image_folder(tmp_path / "other", ("x", "y", "z"), ("x", "y", "z"))
    with pytest.raises(ConfigError, match=r"(?s)trained on another data set.*classes"):
        fit(compose_cfg(*FOLDER, f"data.root={other}"), tmp_path / "run")


def test_validation_classes_must_equal_the_training_classes(tmp_path):
    data = _image_folder(tmp_path / "data", ("a", "b", "c"), ("a", "b", "d"))
    with pytest.raises(ValueError, match=r"only in train: \['c'\]; only in val: \['d'\]"):
        fit(compose_cfg(*FOLDER, f"data.root={data}"), tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


# --- 2. resume=never and overwrite --------------------------------------------------------------------------
def test_resume_never_refuses_an_existing_run_unless_told_to_overwrite(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="quest")  # train.log's lines as train.py logs them
    fit(compose_cfg(*FAST, "trainer.epochs=1"), tmp_path)
    before = (tmp_path / "summary.json").read_bytes()
    with pytest.raises(ConfigError, match=r"already holds a run.*trainer\.overwrite=true"):
        fit(compose_cfg(*FAST, "trainer.epochs=1", "trainer.resume=never"), tmp_path)
    assert (tmp_path / "summary.json").read_bytes() == before
    old_run = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*")
               if p.is_file() and p.name != ".lock"}
    assert {Path("train.log"), Path("run.json"), Path("summary.json")} <= set(old_run)
    # what no run writes is not the run's: a user's notes and a folder of theirs stay where they are
    (tmp_path / "notes.txt").write_text("mine\n")
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "a.png").write_bytes(b"png")
    fit(compose_cfg(*FAST, "trainer.epochs=1", "trainer.resume=never", "trainer.overwrite=true"), tmp_path)
    (archive,) = (tmp_path / ".replaced").iterdir()
    # all of the old run, byte for byte, and why; nothing of the new run written into its files
    assert {p: (archive / p).read_bytes() for p in old_run} == old_run
    assert (tmp_path / "notes.txt").read_text() == "mine\n" and (tmp_path / "figures" / "a.png").read_bytes() == b"png"
    assert {p.name for p in archive.iterdir()} == {p.parts[0] for p in old_run} | {"why.txt"}
    assert "left in place" in caplog.text and "figures, notes.txt" in caplog.text
    assert "trainer.overwrite=true" in (archive / "why.txt").read_text()
    assert (archive / "summary.json").read_bytes() == before
    new_log = (tmp_path / "train.log").read_text()
    assert new_log and not new_log.startswith(old_run[Path("train.log")].decode())
    steps = [r["step"] for r in _rows(tmp_path) if "train/loss" in r]
    assert steps == [1, 2, 3, 4]  # the new run's rows only, each step once


def test_metrics_logged_after_the_last_checkpoint_are_not_duplicated(tmp_path, monkeypatch):
    from quest.train.trainer import Run

    overrides = [*FAST, "trainer.epochs=3", "trainer.checkpoint_every_n_steps=2", "diagnostics=default",
                 "diagnostics.every_n_steps=1"]
    fit(compose_cfg(*overrides), tmp_path / "straight")
    step = Run.train_step

    def crash_at_step_6(self, batches, **kw):  # a kill -9 after step 5's rows were logged, checkpoint at step 4
        if self.state.step == 5:
            raise RuntimeError("simulated crash")
        return step(self, batches, **kw)

    monkeypatch.setattr(Run, "train_step", crash_at_step_6)
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(compose_cfg(*overrides), tmp_path / "crashed")
    monkeypatch.setattr(Run, "train_step", step)
    assert any(r["step"] == 5 for r in _rows(tmp_path / "crashed"))
    fit(compose_cfg(*overrides), tmp_path / "crashed")
    straight, resumed = _rows(tmp_path / "straight"), _rows(tmp_path / "crashed")
    key = lambda r: (r["step"], tuple(sorted(r)))  # noqa: E731
    assert sorted(map(key, resumed)) == sorted(map(key, straight))  # every row once, none of the crashed attempt's
    losses = lambda rows: {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}  # noqa: E731
    assert losses(resumed) == losses(straight)


def test_image_folder_class_count_is_checked_against_its_folders(tmp_path):
    data = _image_folder(tmp_path / "data", ("a", "b", "c"), ("a", "b", "c"))
    with pytest.raises(ConfigError, match=r"data\.num_classes must be 3: the imagefolder data set has 3 classes"):
        fit(compose_cfg(*FOLDER_BASE, f"data.root={data}", "data.num_classes=4"), tmp_path / "run")


# --- outputs ---------------------------------------------------------------------------------------------------
def test_every_run_ends_with_a_one_line_summary(tmp_path, caplog):
    caplog.set_level("INFO", logger="quest.train")
    fit(compose_cfg(*FAST), tmp_path)
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("run completed")]
    assert len(line) == 1 and str(tmp_path) in line[0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert f"val top-1 {summary['val/top1']:.2f} (best {summary['best/val/top1']:.2f}" in line[0]


def test_divergence_log_names_the_checkpoint_that_exists(tmp_path, caplog):
    caplog.set_level("INFO", logger="quest.train")
    fit(compose_cfg(*FAST, "recipe.lr=1e6", "recipe.warmup_epochs=0", "trainer.epochs=4",
                    "trainer.checkpoint_every_n_steps=1", "attention=standard"), tmp_path / "a")
    step = load_checkpoint(tmp_path / "a" / "checkpoints" / "last.pt")["state"]["step"]
    assert f"the last good checkpoint is {tmp_path / 'a' / 'checkpoints' / 'last.pt'} (step {step})" in caplog.text
    caplog.clear()
    fit(compose_cfg(*FAST, "trainer.max_loss=0.01"), tmp_path / "b")  # diverges at its first step
    assert "no checkpoint was written before it" in caplog.text
    assert not (tmp_path / "b" / "checkpoints" / "last.pt").exists()


def test_best_checkpoint_is_written_before_the_state_that_records_it(tmp_path, monkeypatch):
    import quest.run.checkpoint as ck
    from quest.train.trainer import Run

    def improving(self, model=None, prefix="val/"):  # every epoch a new best, so that every epoch writes best.pt
        top1 = 10.0 * self.state.epoch
        return {f"{prefix}{k}": v for k, v in {"top1": top1, "top5": top1, "loss": 1.0, "skipped": 0,
                                                "images": 32}.items()}, {}

    monkeypatch.setattr(Run, "validate", improving)
    link = ck.replace_with_link
    calls = {"n": 0}

    def killed_between_best_and_last(source, target):  # the process dies after best.pt, before last.pt
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed")
        link(source, target)

    monkeypatch.setattr(ck, "replace_with_link", killed_between_best_and_last)
    summary = fit(compose_cfg(*FAST, "trainer.epochs=3", "recipe.warmup_epochs=0"), tmp_path)
    assert summary["status"] == "interrupted" and not summary["saved"]
    last = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    best = load_checkpoint(tmp_path / "checkpoints" / "best.pt")
    assert last["state"]["best_epoch"] <= best["state"]["epoch"]  # best.pt never older than what last.pt records
    monkeypatch.setattr(ck, "replace_with_link", link)
    summary = fit(compose_cfg(*FAST, "trainer.epochs=3", "recipe.warmup_epochs=0"), tmp_path)
    best = load_checkpoint(tmp_path / "checkpoints" / "best.pt")
    assert summary["best_epoch"] == 3 and best["state"]["epoch"] == 3 and best["state"]["best_top1"] == 30.0


def test_temporary_files_of_a_killed_write_are_removed_on_start(tmp_path):
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir(parents=True)
    orphans = [ckpt / ".last.pt.x1y2.tmp", ckpt / ".best.pt.tmp", ckpt / ".last.pt.123.link.tmp"]
    for p in orphans:
        p.write_bytes(b"half a checkpoint")
    fit(compose_cfg(*FAST, "trainer.epochs=1"), tmp_path)
    assert not any(p.exists() for p in orphans) and not list(ckpt.glob("*.tmp"))


def test_a_second_process_in_the_same_run_directory_is_refused(tmp_path):
    from quest.run.directory import RunDirectory

    holder = RunDirectory(tmp_path)
    holder.lock()
    try:
        with pytest.raises(RuntimeError, match=r"is in use by another process \(pid"):
            fit(compose_cfg(*FAST), tmp_path)
    finally:
        holder.unlock()
    assert fit(compose_cfg(*FAST, "trainer.epochs=1"), tmp_path)["status"] == "completed"


def test_checkpoint_round_trip_holds_tensors_and_plain_containers_only(tmp_path):
    fit(compose_cfg(*FAST, "trainer.epochs=1"), tmp_path)
    ckpt = torch.load(tmp_path / "checkpoints" / "last.pt", weights_only=True)
    assert ckpt["derived"]["global_batch"] == 16 and ckpt["data"]["train_size"] == 64
    assert isinstance(ckpt["metrics_bytes"], int) and ckpt["metrics_bytes"] == (tmp_path / "metrics.jsonl").stat().st_size


# --- the README's command sequence, as written ----------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.process
def test_readme_quickstart_sequence(tmp_path):
    import os
    import subprocess
    import sys

    from ..helpers import ROOT
    from ..warm import run_app

    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}

    def run(app: str, *args: str, fresh: bool = False) -> subprocess.CompletedProcess:
        # the newcomer's first command starts a real interpreter (its imports and entry script are part of what the
        # README promises); the rest are the same argv forked from the warm zygote, which saves an interpreter's
        # imports each (the wheel smoke in .ci/run starts quest-eval and quest-report in real interpreters)
        if fresh:
            out = subprocess.run([sys.executable, str(ROOT / app), *args], cwd=tmp_path, env=env,
                                 capture_output=True, text=True, timeout=900)
        else:
            out = run_app(app, *args, cwd=tmp_path, env=env)
        assert out.returncode == 0, (app, args, out.stdout[-2000:], out.stderr[-3000:])
        return out

    run("train.py", fresh=True)  # python train.py
    quickstart = tmp_path / "runs" / "digits" / "vit_pico-quest-light-seed0"
    summary = json.loads((quickstart / "summary.json").read_text())
    got = (f"{summary['val/top1']:.1f}", f"{summary['val_ema/top1']:.1f}")
    assert summary["status"] == "completed" and summary["val/top1"] >= 95.0, summary
    # the figures the docs give are the command's, to their digits, for the instruction set torch's CPU kernels use
    # here (float32 sums round differently per set); on a set they do not give (no vector unit, ARM) only the above
    kernels = {"AVX512": "AVX-512", "AVX2": "AVX2"}.get(torch.backends.cpu.get_cpu_capability())
    for doc in ("README.md", "docs/getting-started.md"):
        said = dict((m[3], (m[1], m[2])) for m in re.finditer(
            r"(\d+\.\d)% validation top-1 \(EMA (\d+\.\d)%\) on (AVX-512|AVX2)", " ".join((ROOT / doc).read_text().split())))
        assert set(said) == {"AVX-512", "AVX2"}, (doc, said)
        assert kernels is None or said[kernels] == got, (doc, kernels, got, summary)
    again = run("train.py")  # the same command: reported, not retrained
    assert "already holds this finished run" in again.stdout + again.stderr
    assert json.loads((quickstart / "summary.json").read_text()) == summary
    # the diagnostics comparison: both formulations again with diagnostics, each in its own named directory
    run("train.py", "attention=standard", "diagnostics=default")
    run("train.py", "diagnostics=default")
    diag_runs = sorted((tmp_path / "runs" / "digits").glob("*-diagnostics_default"))  # the README's glob
    assert [p.name for p in diag_runs] == ["vit_pico-quest-light-seed0-diagnostics_default",
                                           "vit_pico-standard-light-seed0-diagnostics_default"]
    for diag_run in diag_runs:
        assert any("diag/max_logit" in line for line in (diag_run / "metrics.jsonl").read_text().splitlines())
        # the default run reaches 95% with either formulation (diagnostics only watch; they do not change training)
        diag_summary = json.loads((diag_run / "summary.json").read_text())
        assert diag_summary["status"] == "completed" and diag_summary["val/top1"] >= 95.0, diag_summary
    plotted = run("quest.report.plot", "diagnostics", *map(str, diag_runs), "--out", "diag.png")
    assert (tmp_path / "diag.png").stat().st_size > 10_000 and "skipped" not in plotted.stderr
    # the report counts the quickstart run and its diagnostics rerun (same seed) once, and says so
    report = run("quest.report", "runs/digits")
    assert "repeats" in report.stderr and "1 duplicate seed (counted once)" in report.stdout
    run("eval.py", f"checkpoint={quickstart / 'checkpoints' / 'last.pt'}", "eval=clean")
