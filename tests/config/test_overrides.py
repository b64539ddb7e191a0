"""Misspelt keys, groups and options get the nearest valid spelling on the first try, in one line, before Hydra
composes anything; quest-eval without a target says what to pass and leaves no directory behind."""
from __future__ import annotations

import os
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quest.cli import config_root
from quest.config.overrides import app_groups, override_problems
from quest.config.schema import TrainConfig
from quest.evaluation import register_eval_configs
from quest.evaluation.config import eval_config_schema
from quest.toy.config import ToyConfig

from ..helpers import ROOT
from ..warm import run_app

register_eval_configs()
TRAIN_GROUPS = app_groups(config_root(), "train")


def train_problems(*args: str) -> list[str]:
    return override_problems(list(args), TrainConfig, TRAIN_GROUPS)


@pytest.mark.parametrize("arg, near", [
    ("atention=standard", "did you mean attention=standard?"),
    ("+atention=standard", "did you mean attention=standard?"),  # Hydra's own advice for the line above
    ("++atention=standard", "did you mean attention=standard?"),
    ("atention.name=quest", "did you mean attention.name=quest?"),
    ("trainer.epoch=3", "did you mean trainer.epochs=3?"),
    ("+trainer.epoch=3", "did you mean trainer.epochs=3?"),
    ("trainr.epochs=3", "did you mean trainer.epochs=3?"),
    ("recipe.lrr=0.1", "did you mean recipe.lr=0.1?"),
    ("attention=standrd", "did you mean attention=standard?"),
    ("modell=vit_pico", "did you mean model=vit_pico?"),
])
def test_a_typo_gets_the_nearest_valid_spelling(arg, near):
    problems = train_problems("trainer.epochs=1", arg)
    assert len(problems) == 1 and "\n" not in problems[0]
    assert problems[0].startswith(f"{arg}: ") and near in problems[0]


def test_valid_overrides_pass():
    assert train_problems(
        "attention=quest", "model=vit_pico", "recipe=light", "data=fake", "trainer.epochs=1", "+experiment=null",
        "experiment=table1_ablation_cpu", "attention=path", "attention.name=my_pkg.mod:Cls", "attention=quest,standard",
        "trainer.seed=range(3)", "model.kwargs.drop_rate=0.1", "+model.kwargs.foo=1", "~diagnostics",
        "hydra.run.dir=x", "hydra/launcher=submitit_slurm", "experiment_values.epochs.vit_small=3",
        "data.batch_size=${oc.env:BS,32}", "-m", "--cfg", "job") == []


def test_every_problem_is_reported_and_nothing_is_guessed_wildly():
    problems = train_problems("atention=standard", "trainer.epoch=3", "zzzzzz=1")
    assert len(problems) == 3
    assert "did you mean" not in problems[2] and "no config group or key 'zzzzzz'" in problems[2]


def test_eval_and_toy_check_their_own_schema():
    groups = app_groups(config_root(), "eval")
    assert set(groups) >= {"eval", "model", "attention", "data", "logger"} and "trainer" not in groups
    eval_problems = override_problems(["eval=clen", "eval.adversarial.atacks=[fgsm]", "checkpont=x.pt",
                                       "eval.clean.max_samples=3", "checkpoint=x.pt"], eval_config_schema(), groups)
    assert len(eval_problems) == 3
    assert "did you mean eval=clean?" in eval_problems[0]
    assert "did you mean eval.adversarial.attacks=[fgsm]?" in eval_problems[1]
    assert "did you mean checkpoint=x.pt?" in eval_problems[2]
    toy = override_problems(["gird=quick", "grid=quick", "workers=2"], ToyConfig, app_groups(config_root() / "toy", "toy"))
    assert len(toy) == 1 and "did you mean grid=quick?" in toy[0]


def _run(tmp_path, app: str, *args: str) -> subprocess.CompletedProcess:
    """``python <app> *args`` in ``tmp_path``, forked from the warm zygote: its stderr and its working directory are
    what this test reads, not the interpreter's start."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    return run_app(app, *args, cwd=tmp_path, env=env, timeout=600)


def test_the_command_line_answers_in_one_line_without_a_traceback(tmp_path):
    proc = _run(tmp_path, "train.py", "atention=standard")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("train.py: error: atention=standard: ") and "attention=standard?" in proc.stderr
    assert not (tmp_path / "runs").exists()
    # quest-eval with nothing to evaluate: what to pass, and no outputs/eval/None-None/ left behind
    proc = _run(tmp_path, "eval.py")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.startswith("eval.py: error: nothing to evaluate: pass checkpoint=")
    assert list(tmp_path.iterdir()) == []


def test_options_from_an_added_search_path_are_not_judged(tmp_path, monkeypatch):
    from quest.config.overrides import exit_on_bad_overrides

    args = [f"hydra.searchpath=[file://{tmp_path}]", "eval=my_suite", "model=vit_pico"]
    exit_on_bad_overrides("quest-eval", args, eval_config_schema(), config_root(), "eval")  # returns: nothing to say
    with pytest.raises(SystemExit):
        exit_on_bad_overrides("quest-eval", ["eval=my_suite"], eval_config_schema(), config_root(), "eval")


@settings(max_examples=40)
@given(parts=st.lists(st.text(alphabet="abcxyz_-.", min_size=1, max_size=300).filter(lambda p: p not in (".", "..")),
                      min_size=1, max_size=3),
       key=st.sampled_from(["hydra.run.dir", "hydra.sweep.dir"]))
def test_an_output_directory_hydra_could_not_make_is_refused_before_it_runs(parts, key):
    """Hydra makes the run's directory before quest's code runs, and fails there with its own traceback: a name over
    the file system's limit is refused by the override check, naming it; any other name passes."""
    path = "/".join(parts)
    problems = override_problems([f"{key}={path}"], TrainConfig, app_groups(config_root(), "train"))
    too_long = any(len(p.encode()) > os.pathconf(".", "PC_NAME_MAX") for p in parts)
    assert bool(problems) == too_long, problems
    if too_long:
        assert problems[0].startswith(f"{key}=") and "bytes long" in problems[0]


def test_a_sweep_subdir_is_refused_since_each_job_runs_in_its_run_dir():
    problems = override_problems(["hydra.sweep.subdir=${hydra.job.num}"], TrainConfig, app_groups(config_root(), "train"))
    assert len(problems) == 1 and problems[0].startswith("hydra.sweep.subdir=${hydra.job.num}: not used: ")
    assert "hydra.run.dir" in problems[0]


def test_an_output_directory_under_a_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "taken").write_text("")
    problems = override_problems(["hydra.run.dir=taken/run"], TrainConfig, app_groups(config_root(), "train"))
    assert problems == ["hydra.run.dir=taken/run: taken exists and is not a directory (expected a directory to write "
                        "into)"]
    assert override_problems(["hydra.run.dir=free/run"], TrainConfig, app_groups(config_root(), "train")) == []


@pytest.mark.parametrize("value", ['"~/runs/x"', "'~other/x'"])
def test_an_output_directory_starting_with_a_tilde_is_refused_not_made_as_a_folder_named_tilde(value):
    """Quoted, ``~`` reaches Hydra unexpanded, which would make ``./~/runs/x``: refused, naming the home it meant."""
    problems = override_problems([f"hydra.run.dir={value}"], TrainConfig, app_groups(config_root(), "train"))
    assert len(problems) == 1 and "is not expanded here" in problems[0]
    assert os.path.expanduser(value.strip("\"'").split("/")[0]) in problems[0]
