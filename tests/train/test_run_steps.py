"""``Run`` (quest/train/trainer.py) takes steps and returns what is to be logged; it never logs and never saves
(docs/training.md, "Who owns what"): one epoch driven through it by hand, as quest.train.loop drives it, writes
nothing into the run directory, and its counters are its TrainState's, moved by exactly the steps and batches
taken."""
from __future__ import annotations

import math

from quest.runtime.distributed import DistContext
from quest.train.trainer import Run

from ..helpers import FAST, compose_cfg


def test_an_epoch_through_run_writes_nothing_and_returns_what_to_log(tmp_path):
    cfg = compose_cfg(*FAST, "trainer.epochs=1", "trainer.accum_steps=2")  # 64 images, batches of 16: 2 steps
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    run = Run(cfg, run_dir, {"model": cfg.model.name, "attention": cfg.attention.name, "recipe": cfg.recipe.name,
                             "data": cfg.data.name}, DistContext())
    logged = [run.train_step(batches, log=True) for batches in run.step_batches()]
    epoch = run.end_epoch()
    metrics, _ = run.validate()

    # the values the loop writes come back to it, none written here
    assert len(logged) == 2
    assert all(math.isfinite(row["train/loss"]) and math.isfinite(row["train/grad_norm"]) for row in logged)
    assert epoch is None  # nothing skipped: no data counts to log
    assert 0.0 <= metrics["val/top1"] <= 100.0
    assert sorted(run_dir.rglob("*")) == []  # no metrics.jsonl, no checkpoint, no log: the loop's to write
    # the counters moved by what was taken: 2 optimizer steps of 2 micro-batches each, one epoch ended
    state = run.state
    assert (state.step, state.epoch, state.micro_in_epoch, state.train_drawn, state.train_skipped) == (2, 1, 0, 64, 0)
