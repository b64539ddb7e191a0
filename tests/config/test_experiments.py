"""configs/experiment/: every overlay composes with the values of the paper, sweeps what it says, and runs."""
from __future__ import annotations

import fnmatch
import itertools
import json
import os

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from ..helpers import CONFIGS, ROOT
from ..warm import run_app

EXPERIMENTS = sorted(p.stem for p in (CONFIGS / "experiment").glob("*.yaml"))


def _compose(experiment: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name="train", overrides=[f"experiment={experiment}", *overrides],
                       return_hydra_config=True)


def _sweep(cfg) -> dict[str, list[str]]:
    return {k: str(v).split(",") for k, v in cfg.hydra.sweeper.params.items()}


def test_the_paper_experiments_and_cpu_twins_exist():
    assert {"table1_ablation", "table2_deit", "table2_deit3", "table2_deit3_finetune", "tableA2_limited_data",
            "tableA3_lr_sensitivity", "table1_ablation_cpu", "tableA3_lr_sensitivity_cpu"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_sweep_point_composes_and_resolves(experiment):
    """Each job of the sweep, composed as the launcher would, resolves every value (epochs, image size, lr ...)."""
    base = _compose(experiment)
    sweep = _sweep(base)
    assert sweep, f"{experiment} sweeps nothing"
    assert str(base.hydra.sweep.dir).startswith(f"runs/.sweeps/train-{experiment}-")  # the sweep's record only
    for values in itertools.product(*sweep.values()):
        cfg = _compose(experiment, *(f"{k}={v}" for k, v in zip(sweep, values)))
        HydraConfig.instance().set_config(cfg)  # `${hydra:...}` interpolations, as inside a job
        resolved = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in cfg if k != "hydra"}
        assert resolved["trainer"]["epochs"] > 0 and resolved["attention"]["name"] in sweep.get(
            "attention", [resolved["attention"]["name"]])


def test_table1_ablation_is_vit_tiny_deit_300_epochs_six_formulations_three_seeds():
    cfg = _compose("table1_ablation")
    assert (cfg.model.name, cfg.recipe.name, cfg.data.name, cfg.trainer.epochs) == (
        "vit_tiny_patch16_224", "deit", "imagenet", 300)
    assert _sweep(cfg) == {"attention": ["standard", "quest", "qnorm", "qknorm", "qknorm_hs", "qknorm_ds"],
                           "trainer.seed": ["0", "1", "2"]}
    assert cfg.diagnostics.every_n_steps > 0  # max logit and q/k norms logged, as in Figure A6


@pytest.mark.parametrize("model, epochs", [("vit_small", 200), ("vit_base", 100), ("vit_large", 100)])
def test_table2_deit_epochs_per_model(model, epochs):
    cfg = _compose("table2_deit", f"model={model}")
    assert cfg.trainer.epochs == epochs and cfg.recipe.name == "deit"
    assert _sweep(cfg)["attention"] == ["standard", "qknorm_ds", "quest"]


@pytest.mark.parametrize("model, size, lr", [("deit3_base", 192, 3e-3), ("deit3_large", 192, 3e-3),
                                             ("deit3_huge", 126, 3e-3)])
def test_table2_deit3_first_phase(model, size, lr):
    cfg = _compose("table2_deit3", f"model={model}")
    assert (cfg.recipe.name, cfg.recipe.opt, cfg.trainer.epochs, cfg.recipe.img_size) == ("deit3", "lamb", 800, size)
    assert cfg.recipe.lr == pytest.approx(lr)


def test_table2_deit3_finetune_starts_from_the_matching_first_phase_job():
    """Each fine-tune job's init_from is the checkpoint of the first-phase job of the same model, attention and
    command line: the directory that job ran in (its hydra.run.dir, composed here as the launcher composes it)."""
    job = ("model=deit3_large", "attention=quest", "data.root=/data/in1k", "trainer.seed=1")
    first = _compose("table2_deit3", *job)
    HydraConfig.instance().set_config(first)
    first_dir = str(first.hydra.run.dir)
    cfg = _compose("table2_deit3_finetune", *job)
    HydraConfig.instance().set_config(cfg)
    assert cfg.trainer.init_from == f"{first_dir}/checkpoints/last.pt"
    assert first_dir == "runs/imagenet/deit3_large-quest-deit3-seed1-root_in1k-experiment_table2_deit3"
    assert str(cfg.hydra.run.dir) != first_dir
    assert (cfg.recipe.name, cfg.trainer.epochs, cfg.recipe.lr) == ("deit3_finetune", 20, 1e-5)


def test_table3_adversarial_trains_vit_tiny_deit_with_the_four_formulations():
    cfg = _compose("table3_adversarial")
    assert (cfg.model.name, cfg.recipe.name, cfg.data.name, cfg.trainer.epochs) == (
        "vit_tiny_patch16_224", "deit", "imagenet", 300)
    assert _sweep(cfg) == {"attention": ["standard", "quest", "elliptical", "elliptical_quest"]}


@pytest.mark.parametrize("experiment", ["table1_ablation", "table2_deit", "table2_deit3", "table2_deit3_finetune",
                                        "tableA2_limited_data", "tableA3_lr_sensitivity", "table3_adversarial"])
def test_paper_experiments_train_as_the_deit_authors(experiment):
    """fp16 with a loss scaler on CUDA, the schedule stepped per epoch as DeiT's main.py; DeiT-III's uniform drop
    path and LayerScale 1e-4; the fine-tune phase from the first phase's model weights."""
    cfg = _compose(experiment)
    assert (cfg.recipe.precision, cfg.recipe.sched_on, cfg.trainer.precision) == ("fp16", "deit", "auto")
    if cfg.recipe.name.startswith("deit3"):
        assert cfg.recipe.drop_path_schedule == "uniform" and cfg.model.layer_scale_init == 1e-4
    if experiment == "table2_deit3_finetune":
        assert cfg.recipe.init_weights == "model"


def test_limited_data_and_lr_sweeps():
    a2 = _sweep(_compose("tableA2_limited_data"))
    assert a2["data.subset_fraction"] == ["0.1", "0.25", "0.5"] and a2["data.subset_seed"] == ["0", "1", "2"]
    a3 = _compose("tableA3_lr_sensitivity")
    assert a3.model.name == "vit_small_patch16_224" and len(_sweep(a3)["recipe.lr"]) >= 4


def test_cpu_twin_multirun_runs_and_reports(tmp_path):
    """`python train.py -m experiment=table1_ablation_cpu` (cut to 2 formulations x 2 seeds x 2 steps here), then
    `python -m quest.report` on the sweep: both argv forked from the warm zygote (tests/warm.py), since the commands'
    results, not an interpreter's start, are the point."""
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    proc = run_app("train.py", "-m", "experiment=table1_ablation_cpu", "attention=standard,quest", "trainer.seed=0,1",
                   "trainer.max_steps=2", "trainer.epochs=1", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # each job where the single run of its command line trains (docs/training.md, Sweeps)
    summaries = sorted((tmp_path / "runs" / "digits").glob("*-experiment_table1_ablation_cpu*/summary.json"))
    assert [p.parent.name for p in summaries] == [
        f"vit_pico-{a}-light-seed{s}-experiment_table1_ablation_cpu-ep1" for a in ("quest", "standard")
        for s in (0, 1)]
    assert {json.loads(p.read_text())["model"] for p in summaries} == {"vit_pico_patch4_16"}
    # the sweep's record, apart from its jobs
    records = [p.relative_to(tmp_path / "runs").as_posix() for p in (tmp_path / "runs").glob(".sweeps/*/*")]
    assert len(records) == 1 and fnmatch.fnmatch(records[0], ".sweeps/train-table1_ablation_cpu-??????/multirun.yaml")
    report = run_app("quest.report", *(str(p.parent) for p in summaries), cwd=ROOT, env=env, timeout=300)
    assert report.returncode == 0, report.stderr
    assert "| quest |" in report.stdout and "| standard |" in report.stdout
