"""A sweep's jobs are laid out by the rule of single runs: each job trains in the directory the single run of its
command line would use (``hydra.run.dir``), so the same sweep run again resumes every job in place, and the sweep's
own record (``multirun.yaml``) lies apart, in ``runs/.sweeps/<command>[-<experiment>]-<digest>``."""
from __future__ import annotations

import json

from omegaconf import OmegaConf

from quest.config.run_names import sweep_record_name

from ..helpers import FAST
from ..runtime.test_refusal_contract import run_command
from .test_runs import _run_dir_name

SWEEP = (*[a for a in FAST if not a.startswith("trainer.")], "trainer.epochs=1")


def _summaries(cwd) -> dict[str, dict]:
    return {str(p.parent.relative_to(cwd)): json.loads(p.read_text()) for p in cwd.glob("runs/*/*/summary.json")}


def test_a_sweeps_jobs_land_where_their_single_runs_would_and_the_same_sweep_again_resumes_them(tmp_path, monkeypatch,
                                                                                               capsys):
    """train.py -m twice (the second resumes both jobs), then eval.py -m over their checkpoints, each in this process
    as its console script runs it (the layout is the point, not the process)."""
    code, _, err = run_command("train.py", ["-m", *SWEEP, "trainer.max_steps=1", "recipe.lr=1e-3,2e-3"], tmp_path,
                               monkeypatch, capsys)
    assert code == 0, err[-3000:]
    # the reference: hydra.run.dir of each job's command line composed as a single run (no -m)
    singles = {_run_dir_name(*SWEEP, lr) for lr in ("recipe.lr=1e-3", "recipe.lr=2e-3")}
    ran = _summaries(tmp_path)
    assert set(ran) == singles and len(singles) == 2, ran.keys()
    assert {s["step"] for s in ran.values()} == {1} and {s["status"] for s in ran.values()} == {"stopped"}
    records = sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "runs" / ".sweeps").rglob("*"))
    assert len(records) == 2 and records[1] == f"{records[0]}/multirun.yaml", records

    # the same sweep, allowed one more step (trainer.max_steps names no run): each job resumes in its directory
    code, _, err = run_command("train.py", ["-m", *SWEEP, "trainer.max_steps=2", "recipe.lr=1e-3,2e-3"], tmp_path,
                               monkeypatch, capsys)
    assert code == 0, err[-3000:]
    resumed = _summaries(tmp_path)
    assert set(resumed) == singles, resumed.keys()
    assert {s["step"] for s in resumed.values()} == {2} and all(s["resumed"] for s in resumed.values())
    assert sorted(p.relative_to(tmp_path).as_posix() for p in (tmp_path / "runs" / ".sweeps").rglob("*")) == records

    # eval.py -m: each job writes where the single evaluation of its checkpoint writes, <run>/eval/<suite>/last-model
    checkpoints = ",".join(f"{run}/checkpoints/last.pt" for run in sorted(singles))
    code, _, err = run_command("eval.py", ["-m", f"checkpoint={checkpoints}", "eval=clean", "eval.clean.max_samples=8"],
                               tmp_path, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.glob("runs/*/*/eval/*/*/eval_results.json")) == [
        f"{run}/eval/clean/last-model/eval_results.json" for run in sorted(singles)]
    assert len(list((tmp_path / "runs" / ".sweeps").glob("eval-*/multirun.yaml"))) == 1


def _sweep_config(*overrides: str, experiment: str | None = None, command: str = "train"):
    choices = {"experiment": experiment} if experiment else {}
    return OmegaConf.create({"hydra": {"overrides": {"task": list(overrides)}, "job": {"name": command},
                                       "runtime": {"choices": choices}}})


def test_a_sweeps_record_is_named_by_what_its_command_line_sweeps():
    name = sweep_record_name(_root_=_sweep_config("recipe.lr=1e-3,2e-3", "data=fake"))
    assert name.startswith("train-") and len(name) == len("train-") + 6
    # the same sweep, its overrides in another order or with operational keys and Hydra's own: the same folder
    assert sweep_record_name(_root_=_sweep_config("data=fake", "trainer.device=cpu", "recipe.lr=1e-3,2e-3",
                                                  "trainer.max_steps=3", "hydra.job.chdir=false")) == name
    # a data set moved to another folder is the same sweep, as it is the same run
    assert sweep_record_name(_root_=_sweep_config("data.root=/a/digits", "recipe.lr=1,2")) == sweep_record_name(
        _root_=_sweep_config("data.root=/b/digits", "recipe.lr=1,2"))
    # another sweep: another folder
    others = {sweep_record_name(_root_=_sweep_config(*o)) for o in (
        ("recipe.lr=1e-3,3e-3", "data=fake"), ("recipe.lr=1e-3,2e-3", "data=digits"), ("recipe.lr=1e-3,2e-3",))}
    assert len(others) == 3 and name not in others
    # an experiment and the command name the folder in words
    assert sweep_record_name(_root_=_sweep_config("experiment=table1_ablation_cpu", experiment="table1_ablation_cpu")
                             ).startswith("train-table1_ablation_cpu-")
    assert sweep_record_name(_root_=_sweep_config("eval.use_ema=true,false", command="eval")).startswith("eval-")
