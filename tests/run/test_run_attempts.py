"""A run's figures over all its attempts: summary.json's ``perf`` and ``wall_time_s`` after a stop at
trainer.max_steps, a crash (a kill -9: nothing after the last checkpoint survives) and the resume that finishes it
count every step of the run once, and list each attempt (quest.run.train_state: Attempt, run_perf).
Counts are checked exactly; times only for being >= 0 and adding up (they are clocks)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from unittest import mock

import pytest

from quest.run.checkpoint_record import CheckpointRecord, CheckpointRecordError
from quest.run.directory import data_record
from quest.run.train_state import Figure, TrainState
from quest.store.torch_files import FORMAT
from quest.train import fit
from quest.train.trainer import Run

from ..helpers import FAST, compose_cfg

# 2 epochs of 4 steps of 16 images (data=fake: 64 training images); checkpoints at steps 3, 6 and each epoch's end
CONFIG = [*FAST, "trainer.epochs=2", "trainer.checkpoint_every_n_steps=3"]
BATCH, STEPS = 16, 8


def _fit(run_dir: Path, *overrides: str) -> dict:
    return fit(compose_cfg(*CONFIG, *overrides), run_dir)


def _crash_after(step: int):
    """Run.train_step failing once the run has taken ``step`` steps: the process dies there, as under kill -9."""
    train_step = Run.train_step

    def crash(self, batches, **kw):
        if self.state.step == step:
            raise RuntimeError("simulated crash")
        return train_step(self, batches, **kw)

    return mock.patch.object(Run, "train_step", crash)


@pytest.fixture(scope="module")
def three_attempts(tmp_path_factory) -> dict:
    """Stopped at trainer.max_steps=3; resumed, checkpointed at step 4 (the epoch's end), killed after step 5;
    resumed from step 4 to the end. The summary.json of the last attempt."""
    run_dir = tmp_path_factory.mktemp("attempts")
    assert _fit(run_dir, "trainer.max_steps=3")["status"] == "stopped"
    with _crash_after(5), pytest.raises(RuntimeError, match="simulated"):
        _fit(run_dir)
    assert _fit(run_dir)["status"] == "completed"
    return json.loads((run_dir / "summary.json").read_text())


def test_the_summary_counts_every_attempt_once(three_attempts):
    summary = three_attempts
    perf = summary["perf"]
    # the crashed attempt's step 5 was lost with it: the third attempt took it again, and it counts once
    assert [(a["first_step"], a["steps"], a["images"]) for a in perf["attempts"]] == [
        (1, 3, 3 * BATCH), (4, 1, BATCH), (5, 4, 4 * BATCH)]  # steps counted from 1, as the log counts them
    assert perf["steps"] == summary["step"] == STEPS
    assert perf["images"] == STEPS * BATCH
    for key in ("train_s", "wall_s", "compile_s", "loader_start_s"):
        parts = [a[key] for a in perf["attempts"]]
        assert all(p >= 0 for p in parts) and perf[key] == pytest.approx(sum(parts))
    assert summary["wall_time_s"] == perf["wall_s"]
    assert perf["img_per_s"] == pytest.approx(perf["images"] / perf["train_s"])
    assert perf["compile_steps"] == sum(a["compile_steps"] for a in perf["attempts"])


def test_the_figures_combine_every_attempt(three_attempts):
    perf = three_attempts["perf"]
    attempts = perf["attempts"]
    for name in ("data_wait", "step_s", "img_per_s_per_device", "peak_mem_gib"):
        means = [a[f"{name}_mean"] for a in attempts if a.get(f"{name}_mean") is not None]
        assert means, name  # every attempt logged steady steps (log_every_n_steps=1)
        # a time-weighted mean over all intervals lies between the attempts' own
        assert min(means) - 1e-9 <= perf[f"{name}_mean"] <= max(means) + 1e-9
    for name in ("data_wait", "step_s", "peak_mem_gib"):
        assert perf[f"{name}_max"] == max(a[f"{name}_max"] for a in attempts)


def test_the_summary_records_the_data_set_trained_on(three_attempts):
    # data.fake_train_size, data.fake_val_size; torchvision's FakeData names no classes
    assert three_attempts["data_fingerprint"] == {"train_size": 64, "val_size": 32, "num_classes": None,
                                                  "classes_sha256": None, "files_sha256": None}
    named = data_record({"train_size": 5, "val_size": 2, "classes": ["cat", "dog"]})
    assert named == {"train_size": 5, "val_size": 2, "num_classes": 2,
                     "classes_sha256": hashlib.sha256(b'["cat", "dog"]').hexdigest(), "files_sha256": None}
    assert data_record({"train_size": 5, "val_size": 2, "classes": ["dog", "cat"]}) != named  # the order counts


def test_an_attempt_in_a_checkpoint_is_checked_and_round_trips():
    st = TrainState()
    st.took_step(8)
    st.trained_for(0.5)
    st.measured({"compile_s": 0.0, "compile_steps": 0, "loader_start_s": 0.25,
                 "figures": {"data_wait": Figure(weighted=0.1, seconds=0.5, largest=0.3)}})
    st.resumed()
    st.took_step(0)
    saved = st.state_dict()
    assert [(a["first_step"], a["steps"], a["images"]) for a in saved["attempts"]] == [(1, 1, 8), (2, 1, 0)]
    again = TrainState()
    again.load_state_dict(saved)
    assert again.attempts == st.attempts
    record = {"format": FORMAT, "version": 1, "model": {}, "config": {}, "state": saved,
              "meta": {"model": "m", "attention": "a", "num_classes": 2}}
    bad = {**saved, "attempts": [{**saved["attempts"][0], "steps": -1}]}
    with pytest.raises(CheckpointRecordError, match=r"state\.attempts\[0\]\.steps is -1, expected a value >= 0"):
        CheckpointRecord.from_dict({**record, "state": bad})
    with pytest.raises(ValueError, match=r"\['gpu_hours'\] in an attempt"):
        again.load_state_dict({**saved, "attempts": [{**saved["attempts"][0], "gpu_hours": 1.0}]})
    # a state saved before attempts were recorded: they are recorded from its resume on
    older = TrainState()
    older.load_state_dict({"step": 5, "images_seen": 40})
    older.resumed()
    older.took_step(8)
    assert [(a.first_step, a.steps) for a in older.attempts] == [(6, 1)]
