"""Divergence under DDP with the check kept on the device (docs/training.md, "The training loop"): read only at the
log interval and before checkpoints, it ends every rank at the same step, the one a single process with twice the
batch reports, and no checkpoint holds weights from after it."""
from __future__ import annotations

import json

import pytest
import torch

from quest.run.checkpoint import load_checkpoint
from quest.train import EXIT_DIVERGED

from .test_distributed import DETERMINISTIC, _run

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("machine")]


def test_every_rank_diverges_at_the_step_one_process_does(tmp_path):
    # logged every 10 steps, saved every 3: the bad step is found at a save, steps after it
    diverging = [a for a in DETERMINISTIC if not a.startswith("trainer.log")] + [
        "recipe.lr=1e6", "recipe.warmup_epochs=0", "attention=standard", "trainer.log_every_n_steps=10",
        "trainer.checkpoint_every_n_steps=3"]
    one = _run([*diverging, "data.batch_size=16", f"hydra.run.dir={tmp_path / 'one'}"], tmp_path, check=False)
    two = _run([*diverging, "data.batch_size=8", f"hydra.run.dir={tmp_path / 'two'}"], tmp_path, nproc=2, check=False)
    assert [out.returncode for out in one + two] == [EXIT_DIVERGED] * 3, [out.stderr[-2000:] for out in one + two]
    s1, s2 = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("one", "two"))
    assert s1["status"] == s2["status"] == "diverged"
    assert s2["diverged_at_step"] == s1["diverged_at_step"] and s2["divergence_reason"].split()[0] == "loss"
    for rank, out in enumerate(two):  # each rank stopped at that step, not only the one writing the summary
        assert f"run diverged at step {s2['diverged_at_step']}" in out.stdout + out.stderr, (rank, out.stdout[-2000:])
    # saved at steps 3, 6, ... while no step was bad; the save after the bad step read the check and stopped
    last = tmp_path / "two" / "checkpoints" / "last.pt"
    assert last.exists() == (s2["diverged_at_step"] - 1 >= 3)  # step N went bad: N - 1 good ones
    if last.exists():
        saved = load_checkpoint(last)
        assert saved["state"]["step"] == (s2["diverged_at_step"] - 1) // 3 * 3
        assert all(torch.isfinite(v).all() for v in saved["model"].values())
