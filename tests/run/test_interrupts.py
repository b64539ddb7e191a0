"""Stopping a run by signal, and failing checkpoint writes: nothing is lost, and the resumed run ends bit-identical to
an uninterrupted one (docs/training.md, "Runs, resume and provenance")."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from quest.run.checkpoint import CheckpointWriteError, load_checkpoint
from quest.train import EXIT_INTERRUPTED, exit_code, fit
from quest.train.trainer import Run

from ..helpers import FAST, ROOT, compose_cfg

# crops, mixup, cutmix and drop path on: every RNG stream matters for bit-identical resumption
LONG = [*FAST, "recipe.mixup=0.8", "recipe.cutmix=1.0", "recipe.drop_path=0.1", "trainer.epochs=3"]


def _assert_same_weights(a_dir: Path, b_dir: Path) -> None:
    a, b = (load_checkpoint(d / "checkpoints" / "last.pt") for d in (a_dir, b_dir))
    assert a["state"]["step"] == b["state"]["step"]
    for part in ("model", "ema"):
        for key, value in a[part].items():
            torch.testing.assert_close(b[part][key], value, atol=0, rtol=0, msg=f"{part}.{key}")
    for (_, x), (_, y) in zip(a["optimizer"]["state"].items(), b["optimizer"]["state"].items()):
        for name in x:
            torch.testing.assert_close(y[name], x[name], atol=0, rtol=0)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted reference run."""
    run_dir = tmp_path_factory.mktemp("straight")
    fit(compose_cfg(*LONG), run_dir)
    return run_dir


def _signal_after_step(monkeypatch, at_step: int, *signums: int) -> None:
    """Deliver real signals to this process right after optimizer step ``at_step``."""
    step = Run.train_step

    def stepping_then_signalled(self, batches, **kw):
        metrics = step(self, batches, **kw)
        if self.state.step == at_step:
            for signum in signums:
                os.kill(os.getpid(), signum)
        return metrics

    monkeypatch.setattr(Run, "train_step", stepping_then_signalled)


@pytest.mark.parametrize("signum, status, at_step", [
    (signal.SIGINT, "interrupted", 3),  # mid-epoch
    (signal.SIGTERM, "interrupted", 8),  # the last step of an epoch
    (signal.SIGUSR1, "requeued", 6),
])
def test_a_signal_saves_at_the_next_step_and_the_resumed_run_is_bit_identical(
        tmp_path, monkeypatch, straight, signum, status, at_step):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_ARRAY_JOB_ID", raising=False)
    _signal_after_step(monkeypatch, at_step, signum)
    # what was installed before: Python's default_int_handler, or SIG_IGN when pytest itself was started in the
    # background by a non-interactive shell (as `cmd &` does)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    summary = fit(compose_cfg(*LONG), tmp_path)
    name = signal.Signals(signum).name
    assert (summary["status"], summary["signal"], summary["saved"], summary["step"]) == (status, name, True, at_step)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["status"] == status and saved["checkpoint"].endswith(f"last.pt (step {at_step})")
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["state"]["step"] == at_step
    if status == "requeued":
        assert "not a SLURM job" in saved["requeue"] and exit_code(saved) == 0
    else:
        assert exit_code(saved) == EXIT_INTERRUPTED[name] == 128 + signum
    assert {s: signal.getsignal(s) for s in handlers} == handlers  # handlers restored
    monkeypatch.undo()
    resumed = fit(compose_cfg(*LONG), tmp_path)
    assert resumed["status"] == "completed" and resumed["resumed"]
    _assert_same_weights(straight, tmp_path)


def test_a_second_ctrl_c_stops_at_once_and_the_last_checkpoint_resumes(tmp_path, monkeypatch, straight):
    _signal_after_step(monkeypatch, 6, signal.SIGINT, signal.SIGINT)
    summary = fit(compose_cfg(*LONG, "trainer.checkpoint_every_n_steps=5"), tmp_path)
    assert (summary["status"], summary["saved"], summary["step"]) == ("interrupted", False, 6)
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["state"]["step"] == 5  # not step 6
    assert summary["checkpoint"].endswith("last.pt (step 5)")
    monkeypatch.undo()
    fit(compose_cfg(*LONG, "trainer.checkpoint_every_n_steps=5"), tmp_path)
    _assert_same_weights(straight, tmp_path)


def _cli(*args: str, cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_for_steps(metrics: Path, steps: int, proc: subprocess.Popen) -> None:
    """Until the run has logged ``steps`` training steps (no fixed sleep: the run's own progress decides)."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and sum('"train/loss"' in line for line in metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run did not reach step {steps}: {proc.communicate()[0][-3000:]}")


@pytest.mark.process  # a signal to a process group, its loader workers included: only a real process has one
@pytest.mark.xdist_group("machine")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_cli_ctrl_c_to_the_process_group_saves_and_exits_with_its_code(tmp_path, signum):
    # Ctrl-C reaches the whole foreground process group, data loader workers too: they must leave it to the
    # trainer; SIGTERM (kill PID) reaches the trainer only
    args = [*LONG, "trainer.epochs=200", "data.num_workers=1", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = _cli(*args, cwd=tmp_path)
    try:
        _wait_for_steps(tmp_path / "run" / "metrics.jsonl", 3, proc)
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            os.kill(proc.pid, signum)
        output, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum, output[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["saved"] and summary["signal"] == signal.Signals(signum).name
    step = load_checkpoint(tmp_path / "run" / "checkpoints" / "last.pt")["state"]["step"]
    assert step == summary["step"] >= 3
    assert f"run interrupted by {signal.Signals(signum).name} after step {step}" in output
    assert "run the same command to resume" in output


# --- failing writes -------------------------------------------------------------------------------------------
def test_a_full_disk_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    fit(compose_cfg(*FAST, "trainer.max_steps=4"), tmp_path)
    last = tmp_path / "checkpoints" / "last.pt"
    before = last.read_bytes()
    real_save = torch.save

    def half_then_full(obj, f, *args, **kwargs):  # writes part of the file, then the device is full
        f.write(b"\0" * 4096)
        raise OSError(errno.ENOSPC, "No space left on device")

    import quest.run.checkpoint as ck

    monkeypatch.setattr(ck.torch, "save", half_then_full)
    with pytest.raises(CheckpointWriteError, match=r"cannot write checkpoint .*\.pt: no space left on the device "
                                                   r"\(.* MiB free in .*\); the previous \w+\.pt, if any, is intact"):
        fit(compose_cfg(*FAST), tmp_path)
    monkeypatch.setattr(ck.torch, "save", real_save)
    assert last.read_bytes() == before
    assert not list((tmp_path / "checkpoints").glob("*.tmp")) and not list(tmp_path.glob(".*.tmp"))
    assert fit(compose_cfg(*FAST), tmp_path)["status"] == "completed"  # and the run resumes from it


def _can_mount_tmpfs(path: Path) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(path)], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["umount", str(path)], check=True)
    return ok


def test_a_real_full_file_system_fails_clearly_and_keeps_the_previous_checkpoint(tmp_path):
    mount = tmp_path / "small"
    if not _can_mount_tmpfs(mount):
        pytest.skip("mounting a size-limited tmpfs needs root (the injected-error test covers the logic)")
    probe = tmp_path / "probe"
    fit(compose_cfg(*FAST, "trainer.max_steps=1"), probe)
    size = (probe / "checkpoints" / "last.pt").stat().st_size
    # room for one checkpoint and the small files, not for a second one beside it
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(size * 1.6) + 256 * 1024}", "tmpfs", str(mount)],
                   check=True)
    try:
        with pytest.raises(CheckpointWriteError, match="no space left on the device"):
            fit(compose_cfg(*FAST, "trainer.epochs=3", "trainer.checkpoint_every_n_steps=1"), mount / "run")
        ckpt = mount / "run" / "checkpoints"
        first = load_checkpoint(ckpt / "last.pt")  # the previous checkpoint still loads
        assert first["state"]["step"] >= 1
        assert not list(ckpt.glob(".*.tmp"))
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=True)


def test_submitits_preemption_signal_saves_then_hands_over(tmp_path, monkeypatch):
    """Under Hydra's submitit launcher submitit owns USR2 (its preemption signal): quest saves and summarises at the
    next step, then calls submitit's handler, which resubmits the job."""
    calls = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: calls.append(signum))  # submitit's, say
    try:
        _signal_after_step(monkeypatch, 2, signal.SIGUSR2)
        summary = fit(compose_cfg(*FAST), tmp_path)
    finally:
        signal.signal(signal.SIGUSR2, previous)
    assert (summary["status"], summary["signal"], summary["step"]) == ("requeued", "SIGUSR2", 2)
    assert summary["requeue"] == "submitit resubmits the job" and calls == [signal.SIGUSR2]
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["state"]["step"] == 2


def test_usr2_is_left_alone_without_submitit(tmp_path):
    from quest.run.signals import StopSignals

    before = signal.getsignal(signal.SIGUSR2)
    stops = StopSignals().install()
    try:
        assert signal.getsignal(signal.SIGUSR2) is before  # not ours to take
    finally:
        stops.uninstall()


def test_the_stop_decision_comes_from_the_flag_the_step_reduced():
    """Under DDP a rank stops on the reduced flag only (every rank the same answer, also when another rank was
    signalled); one process also on a signal that came after the step's flags were read."""
    from quest.run.signals import INTERRUPTED, REQUEUED, StopSignals
    from quest.runtime.distributed import DistContext

    two, one = DistContext(rank=0, world_size=2), DistContext()
    quiet = StopSignals()
    assert quiet.request() == 0 and quiet.decide(0.0, two) is None and quiet.decide(0.0, one) is None
    assert quiet.decide(2.0, two) == INTERRUPTED and quiet.signal_name == "a signal on another rank"
    usr1 = StopSignals()
    usr1.reason, usr1.signal_name = REQUEUED, "SIGUSR1"
    assert usr1.request() == 1.0
    assert usr1.decide(0.0, two) is None  # not in this step's reduced flags: the next step carries it
    assert usr1.decide(1.0, two) == REQUEUED and usr1.decide(0.0, one) == REQUEUED
    assert usr1.decide(2.0, two) == INTERRUPTED  # an interrupt on another rank wins over a requeue
