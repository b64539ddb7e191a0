"""logger=tensorboard: every scalar metrics.jsonl holds, read back with TensorBoard's own reader, equal after a run
that crashed past its last checkpoint and was resumed (no step twice, none missing); the config as text and the
hparams with the final metrics beside them; combinable with the other writers."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

from quest.train import fit

from ..helpers import FAST, compose_cfg

OVERRIDES = [*FAST, "trainer.epochs=3", "trainer.checkpoint_every_n_steps=2", "logger=tensorboard",
             "diagnostics=default", "diagnostics.every_n_steps=1"]


def _jsonl_scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    scalars: dict[str, list[tuple[int, float]]] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                scalars.setdefault(key, []).append((row["step"], float(np.float32(value))))  # TensorBoard: float32
    return scalars


def _tensorboard_scalars(run: Path) -> tuple[dict[str, list[tuple[int, float]]], EventAccumulator]:
    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}, events


def test_tensorboard_holds_exactly_the_metrics_after_a_crash_and_a_resume(tmp_path, monkeypatch):
    from quest.train.trainer import Run

    step = Run.train_step

    def crash_at_step_6(self, batches, **kw):  # after step 5's rows were written; the last checkpoint is step 4's
        if self.state.step == 5:
            raise RuntimeError("simulated crash")
        return step(self, batches, **kw)

    monkeypatch.setattr(Run, "train_step", crash_at_step_6)
    with pytest.raises(RuntimeError, match="simulated crash"):
        fit(compose_cfg(*OVERRIDES), tmp_path)
    monkeypatch.setattr(Run, "train_step", step)
    summary = fit(compose_cfg(*OVERRIDES), tmp_path)
    assert summary["status"] == "completed"
    written, events = _tensorboard_scalars(tmp_path)
    expected = _jsonl_scalars(tmp_path)
    assert written == expected  # every tag, every step once, every value
    assert {"train/loss", "val/top1", "perf/data_wait", "epoch"} <= written.keys()
    assert any(tag.startswith("diag") for tag in written)  # diagnostics per layer too
    assert "config/text_summary" in events.Tags()["tensors"]  # the resolved config, as text
    (path,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    plugins = {value.metadata.plugin_data.plugin_name for event in EventFileLoader(str(path)).Load()
               for value in event.summary.value}
    assert {"text", "hparams"} <= plugins, plugins  # the hparams and final metrics of summary.json
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1  # the earlier attempt's: gone


def test_tensorboard_with_wandb_is_one_run_and_several_writers(tmp_path):
    fit(compose_cfg(*FAST, "logger=tensorboard", "logger.wandb=true", "logger.mode=offline", "trainer.epochs=1"),
        tmp_path)
    written, _ = _tensorboard_scalars(tmp_path)
    assert written == _jsonl_scalars(tmp_path)
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def test_a_missing_tensorboard_is_named_before_any_work(tmp_path, monkeypatch):
    import quest.runtime.extras as extras

    installed = extras._installed
    monkeypatch.setattr(extras, "_installed", lambda module: module != "tensorboard" and installed(module))
    with pytest.raises(extras.MissingExtra, match=r"logger=tensorboard needs 'tensorboard'.*"
                                                  r"pip install 'quest\[tensorboard\]'"):
        fit(compose_cfg(*FAST, "logger=tensorboard"), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_damaged_record_of_the_event_files_is_moved_aside_with_the_files_it_would_have_vouched_for(tmp_path, caplog):
    """tensorboard/.written.json says which event files earlier attempts wrote (those are rewritten); a damaged one is
    not believed, and not a late refusal of a run already under way: it and the event files go to .replaced/."""
    from omegaconf import OmegaConf

    from quest.run.outputs import RunLogger

    board = tmp_path / "tensorboard"
    board.mkdir()
    (board / ".written.json").write_text('{"files": {"../metrics.jsonl": {"by": "quest-train tensorboard"}}}')
    (board / "events.out.tfevents.1.host.1.0").write_bytes(b"an earlier writer's events")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "train/loss": 2.0}) + "\n")
    run_logger = RunLogger(tmp_path, logger_cfg=OmegaConf.create({"tensorboard": True, "wandb": False}))
    run_logger.close()
    kept = sorted(p.relative_to(tmp_path / ".replaced").parts[1:] for p in (tmp_path / ".replaced").rglob("*")
                  if p.is_file())
    assert kept == [("tensorboard", ".written.json"), ("tensorboard", "events.out.tfevents.1.host.1.0")]
    assert "written.json is damaged" in caplog.text and (tmp_path / "metrics.jsonl").exists()
    assert _tensorboard_scalars(tmp_path)[0] == {"train/loss": [(1, 2.0)]}
