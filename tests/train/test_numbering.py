"""One numbering in every record of a run (docs/training.md, "Steps, epochs and images"): a run trained to its end,
one stopped and resumed, and one that goes bad at a known step, each read back from every file it wrote (train.log,
metrics.jsonl, summary.json, run.json, the checkpoints) and held against what the test made happen. TensorBoard's
steps are metrics.jsonl's (tests/train/test_tensorboard.py reads both)."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from quest.run.checkpoint import load_checkpoint
from quest.train import fit
from quest.train.trainer import Run

from ..helpers import FAST, compose_cfg

PER_EPOCH, BATCH, EPOCHS = 4, 16, 2  # FAST: 64 training images in batches of 16, two epochs
STEP_LINE = re.compile(r"epoch (\d+)/(\d+) step (\d+)/(\d+) loss")
VAL_LINE = re.compile(r"epoch (\d+)( at step (\d+))?: val top-1")


@pytest.fixture(autouse=True)
def _info_logged(caplog):
    caplog.set_level(logging.INFO, logger="quest")  # train.log's step lines, as train.py's logging writes them


def _records(run: Path) -> dict[str, Any]:
    log = (run / "train.log").read_text()
    return {
        "steps_logged": [tuple(map(int, m.groups())) for m in STEP_LINE.finditer(log)],
        "vals_logged": [(int(m[1]), m[3] and int(m[3])) for m in VAL_LINE.finditer(log)],
        "log": log,
        "rows": [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()],
        "summary": json.loads((run / "summary.json").read_text()),
        "history": json.loads((run / "run.json").read_text())["history"],
        "checkpoints": {f.name: load_checkpoint(f)["state"] for f in (run / "checkpoints").glob("*.pt")},
    }


def _agree(r: dict[str, Any], weights_step: int, steps_taken: int, totals: tuple[int, ...] = (8,)) -> None:
    """What every run's records share: steps counted from 1, a record's step = the updates it holds, a record's
    epoch = epochs done, the log's epoch = the one under way."""
    for epoch, epochs, step, total in r["steps_logged"]:
        assert (epoch, epochs) == ((step - 1) // PER_EPOCH + 1, EPOCHS) and total in totals, (epoch, step, total)
    train_rows = [row for row in r["rows"] if "train/loss" in row]
    assert [row["step"] for row in train_rows] == sorted({row["step"] for row in train_rows})  # none twice
    assert [row["step"] for row in train_rows] == [s for *_, s, _ in r["steps_logged"]]
    for row in r["rows"]:  # a training row's epoch and a validation row's: epochs done at that step
        assert row["epoch"] == pytest.approx(row["step"] / PER_EPOCH), row
    for number, within in r["vals_logged"]:
        assert within is None or (within - 1) // PER_EPOCH + 1 == number
    s = r["summary"]
    assert s["step"] == weights_step and s["epoch"] == weights_step // PER_EPOCH
    perf = s["perf"]
    assert perf["steps"] == steps_taken and perf["images"] == s["skipped_images"]["train_drawn"] == steps_taken * BATCH
    first = 1
    for attempt in perf["attempts"]:  # each attempt begins where the last ended, numbered as the log numbers steps
        assert attempt["first_step"] == first and attempt["images"] == attempt["steps"] * BATCH
        first += attempt["steps"]
    assert first - 1 == steps_taken
    assert [h["step"] for h in r["history"]] == [a["first_step"] - 1 for a in perf["attempts"]]
    for name, state in r["checkpoints"].items():  # a checkpoint of step N: N updates, its epochs done
        assert state["step"] <= weights_step and state["epoch"] == state["step"] // PER_EPOCH, name


def test_a_completed_run_numbers_every_record_alike(tmp_path):
    fit(compose_cfg(*FAST, "trainer.checkpoint_every_n_steps=3"), tmp_path)
    r = _records(tmp_path)
    _agree(r, weights_step=8, steps_taken=8)
    assert [s for *_, s, _ in r["steps_logged"]] == list(range(1, 9))
    assert r["vals_logged"] == [(1, None), (2, None)] and r["summary"]["best_epoch"] == 2
    assert r["checkpoints"]["last.pt"]["step"] == 8


def test_a_stopped_and_resumed_run_numbers_every_record_alike(tmp_path, caplog):
    stopped = fit(compose_cfg(*FAST, "trainer.max_steps=3"), tmp_path)
    assert (stopped["status"], stopped["step"], stopped["epoch"]) == ("stopped", 3, 0)
    assert "epoch 1 at step 3: val top-1" in (tmp_path / "train.log").read_text()  # inside epoch 1, not "epoch 0"
    fit(compose_cfg(*FAST), tmp_path)
    r = _records(tmp_path)
    _agree(r, weights_step=8, steps_taken=8, totals=(3, 8))  # "step 1/3": the first attempt's trainer.max_steps
    assert [a["first_step"] for a in r["summary"]["perf"]["attempts"]] == [1, 4]
    assert [(h["event"], h["step"]) for h in r["history"]] == [("start", 0), ("resume", 3)]
    assert "after step 3 (0 epochs done)" in caplog.text  # said while it checks, before train.log begins


def test_a_run_that_goes_bad_at_step_6_says_6_and_holds_the_weights_of_step_5(tmp_path, monkeypatch):
    step = Run.train_step

    def poisoned(self, batches, **kw):  # the 6th step's images are NaN: its loss is not finite
        if self.state.step == 5:
            batches = [(images * float("nan"), targets) for images, targets in batches]
        return step(self, batches, **kw)

    monkeypatch.setattr(Run, "train_step", poisoned)
    summary = fit(compose_cfg(*FAST, "trainer.log_every_n_steps=3", "trainer.checkpoint_every_n_steps=2"), tmp_path)
    r = _records(tmp_path)
    assert (summary["status"], summary["diverged_at_step"]) == ("diverged", 6)
    _agree(r, weights_step=5, steps_taken=6)  # the 6th step was taken, its update skipped
    assert "run diverged at step 6 (loss nan is not finite); its weights are those of step 5" in r["log"]
    assert max(row["step"] for row in r["rows"]) < 6 and r["checkpoints"]["last.pt"]["step"] == 4
