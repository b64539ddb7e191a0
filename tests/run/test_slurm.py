"""On a real single-node Slurm cluster: the sbatch template and a Hydra submitit multirun, each with a job preempted
mid-training that requeues, resumes and ends with the weights of an uninterrupted run.

Skipped (with the reason) when not root or when Slurm is not installed; .ci/run installs it, so CI runs them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from quest.run.checkpoint import load_checkpoint

from ..helpers import ROOT
from ..slurm_cluster import SlurmCluster, unavailable_reason
from ..warm import run_app
from .test_runs import _run_dir_name

# Slurm jobs start interpreters (the process boundary is the point), and the cluster takes the machine's cores
pytestmark = [pytest.mark.slurm, pytest.mark.process, pytest.mark.xdist_group("machine"),
              pytest.mark.skipif(unavailable_reason() is not None, reason=str(unavailable_reason()))]

# 10 epochs of 4 steps: the job is stopped after step 5 at the earliest, with 35 steps left to preempt it in
# (SlurmCluster.preempt_mid_training makes the signal's arrival independent of how fast the job trains). One torch
# thread said explicitly: the job's OMP_NUM_THREADS=1 (launch/train.sbatch) reached torch at its import, the warm
# reference's did not (tests/warm.py), and bit-equal weights need the same thread count.
TINY = ["data=fake", "data.img_size=16", "data.fake_train_size=64", "data.fake_val_size=16", "data.batch_size=16",
        "model=vit_pico", "trainer.epochs=10", "trainer.log_every_n_steps=1", "trainer.torch_threads=1"]
STEPS = 40
# CPU stand-ins for the template's GPU defaults
CPU_JOB = ["--gres=none", "--ntasks-per-node=1", "--cpus-per-task=1", "--time=30"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield c
    c.stop()


def _job_env(cluster: SlurmCluster) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    return {**cluster.env, "PATH": f"{venv_bin}:{os.environ['PATH']}", "QUEST_ROOT": str(ROOT),
            "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}


def _in_background(pool: ThreadPoolExecutor, cluster: SlurmCluster, cwd: Path, *args: str) -> Future:
    """``python train.py *args``, forked from the warm zygote in a thread, while the cluster's jobs start: the
    uninterrupted reference, and the Hydra launcher (it submits and waits, so its interpreter is not the point)."""
    return pool.submit(run_app, "train.py", *args, cwd=cwd, env=_job_env(cluster), timeout=900)


def _assert_same_weights(reference: Path, resumed: Path, parts=("model", "ema")) -> None:
    a, b = (load_checkpoint(d / "checkpoints" / "last.pt") for d in (reference, resumed))
    assert a["state"]["step"] == b["state"]["step"] == STEPS
    for part in parts:
        for key, value in a[part].items():
            torch.testing.assert_close(b[part][key], value, atol=0, rtol=0, msg=f"{part}.{key}")


def test_sbatch_template_job_preempted_mid_training_requeues_and_ends_with_the_uninterrupted_weights(
        cluster, tmp_path):
    """launch/train.sbatch as a user submits it: the job trains, SLURM's USR1 makes train.py save and run
    ``scontrol requeue``, the job runs again (restart 1), resumes and completes with the uninterrupted run's weights
    (drop path: the random state resumes too). Also the template's plain run: its log names the job, the run ends
    completed with last.pt (formerly test_sbatch_template_runs_a_training_job, a job of its own)."""
    longer = [*TINY, "recipe.drop_path=0.1"]
    run_dir = tmp_path / "preempted"
    res = subprocess.run(["sbatch", "--parsable", *CPU_JOB, f"--output={tmp_path / 'job.out'}",
                          str(ROOT / "launch" / "train.sbatch"), *longer, f"hydra.run.dir={run_dir}"],
                         env=_job_env(cluster), capture_output=True, text=True, check=True, cwd=ROOT)
    job = res.stdout.strip().split(";")[0]
    with ThreadPoolExecutor(1) as pool:
        reference = _in_background(pool, cluster, tmp_path, *longer, f"hydra.run.dir={tmp_path / 'ref'}")
        stopped_at = cluster.preempt_mid_training(job, run_dir / "metrics.jsonl", after=5)
        state = cluster.wait(job, timeout=600)  # a requeued job is PENDING, then RUNNING again: not done
        ref = reference.result()
    log = (tmp_path / "job.out").read_text()
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert 5 <= stopped_at < STEPS, f"the signal was sent after step {stopped_at} of {STEPS}"
    assert state == "COMPLETED" and cluster.show(job).get("Restarts") == "1", (state, log[-3000:])
    assert f"job {job} (restart 0)" in log and f"job {job} (restart 1)" in log, log[-3000:]
    assert "requeueing SLURM job" in log, log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed"] and summary["step"] == STEPS
    assert (run_dir / "checkpoints" / "last.pt").is_file()
    _assert_same_weights(tmp_path / "ref", run_dir)


def test_hydra_submitit_multirun_one_job_per_config_and_a_preempted_job_is_resubmitted_and_resumes(
        cluster, tmp_path):
    """``train.py -m hydra/launcher=slurm_cpu attention=standard,quest``: one SLURM job per config (submitit's job
    array), both complete; the first is preempted mid-training (USR1), submitit requeues it, and it resumes to the
    uninterrupted run's weights. Merges test_hydra_submitit_multirun_one_job_per_config and
    test_preempted_submitit_job_is_resubmitted_and_resumes, which each started a launcher and its jobs."""
    sweep = tmp_path / "sweep"
    with ThreadPoolExecutor(2) as pool:
        launcher = _in_background(pool, cluster, tmp_path, "-m", "hydra/launcher=slurm_cpu",
                                  "attention=standard,quest", *TINY, f"hydra.sweep.dir={sweep}")
        reference = _in_background(pool, cluster, tmp_path, "attention=standard", *TINY,
                                   f"hydra.run.dir={tmp_path / 'ref'}")
        job = None
        while job is None and not launcher.done():  # the array's task 0 runs the sweep's first config
            job = next((j for j in cluster.run("squeue", "-h", "-o", "%i").stdout.split() if j.endswith("_0")), None)
            time.sleep(0.2)
        assert job is not None, launcher.result().stderr[-3000:]
        run_dir = _job_dir(tmp_path / _run_dir_name(*TINY, "attention=standard"), launcher)
        stopped_at = cluster.preempt_mid_training(job, run_dir / "metrics.jsonl", after=5)
        out, ref = launcher.result(), reference.result()
    assert out.returncode == 0, out.stderr[-3000:]
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert 5 <= stopped_at < STEPS, f"the signal was sent after step {stopped_at} of {STEPS}"
    # each job in the directory its single run would use (docs/training.md, "Sweeps"), the record apart
    summaries = [json.loads(p.read_text()) for p in tmp_path.glob("runs/*/*/summary.json")]
    assert sorted(s["attention"] for s in summaries) == ["quest", "standard"]
    assert all(s["status"] == "completed" for s in summaries)
    # each config ran as its own SLURM job (submitit keeps one log folder per job)
    job_logs = list((sweep / ".submitit").glob("*/*_log.out"))
    assert len({p.parent.name for p in job_logs}) == 2, job_logs
    logs = "".join(p.read_text() for p in (sweep / ".submitit").glob(f"{job}/*_log.*"))
    # submitit truncates its log on requeue; the second attempt's log shows the resume
    assert "DUE TO JOB REQUEUE" in logs and "resumed from" in logs, logs[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["resumed"]
    _assert_same_weights(tmp_path / "ref", run_dir, parts=("model",))


def _job_dir(run_dir: Path, launcher: Future) -> Path:
    """``run_dir``, the run directory of a sweep job, once the job made it."""
    while not launcher.done():
        if run_dir.is_dir():
            return run_dir
        time.sleep(0.2)
    raise AssertionError(f"no run in {run_dir}: {launcher.result().stderr[-3000:]}")


def test_a_job_refused_on_the_cluster_fails_the_sweep_naming_its_log(cluster, tmp_path):
    """A config refused inside its SLURM job (recipe.lr is checked in the run) makes the launching command exit 1
    naming the job's log, which holds the one-line error; before quest's launcher the sweep exited 0."""
    sweep = tmp_path / "sweep"
    out = run_app("train.py", "-m", "hydra/launcher=slurm_cpu", "recipe.lr=-1", *TINY, f"hydra.sweep.dir={sweep}",
                  cwd=tmp_path, env=_job_env(cluster), timeout=600)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("train.py: error: 1 job(s) of the sweep failed: ") and "(refused; its error is in " in line
    log = Path(line.rsplit("its error is in ", 1)[1].rstrip(")"))
    assert log.is_relative_to(sweep / ".submitit") and "recipe.lr must be > 0" in log.read_text()
