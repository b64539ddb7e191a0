"""CheckpointRecord: the v1 fixture written by the code before the record (tests/fixtures/make_checkpoint_v1.py) still
loads, resumes and evaluates to the outputs recorded when it was written; malformed records are refused by name."""
from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from quest.evaluation import register_eval_configs
from quest.evaluation.target import load_target
from quest.run.checkpoint import CheckpointRecord, CheckpointRecordError, load_checkpoint, load_record, save_checkpoint
from quest.run.checkpoint_record import SUPPORTED_VERSIONS, VERSION
from quest.store.torch_files import FORMAT
from quest.train import fit

from ..helpers import compose_cfg, eval_cfg
from ..record_faults import faults, planted

register_eval_configs()

FIXTURES = Path(__file__).parents[1] / "fixtures"
V1 = FIXTURES / "checkpoint_v1.pt"
REFERENCE = json.loads((FIXTURES / "checkpoint_v1.json").read_text())
# the overrides make_checkpoint_v1.py trained the fixture with (without its max_steps)
OVERRIDES = ["data=digits", "model=vit_pico", "recipe=light", "trainer.epochs=1", "data.batch_size=16",
             "trainer.log_every_n_steps=1", "trainer.device=cpu", "+model.kwargs.depth=1"]


def _input() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(2, 3, 16, 16)  # as REFERENCE["input"] says


def test_the_fixture_is_a_v1_file_without_a_version_key():
    raw = torch.load(V1, map_location="cpu", weights_only=True)
    assert "version" not in raw and raw["format"] == FORMAT and sorted(raw) == REFERENCE["keys"]


def test_a_v1_file_loads_as_a_record():
    record = load_record(V1)
    assert record.version == 1 and 1 in SUPPORTED_VERSIONS
    assert record.state == REFERENCE["state"] and record.meta == REFERENCE["meta"]
    assert record.derived == REFERENCE["derived"] and record.choices == REFERENCE["choices"]
    assert record.stateful()["model"] is record.model and record.sharded is None and len(record.rng) == 1
    assert [int(v["step"]) for v in record.optimizer["state"].values()][:1] == REFERENCE["optimizer_steps"] == [2]


@pytest.mark.parametrize("use_ema", [False, True])
def test_a_v1_file_evaluates_to_the_outputs_recorded_when_it_was_written(tmp_path, use_ema):
    path = tmp_path / "last.pt"
    shutil.copy(V1, path)
    target = load_target(eval_cfg(f"checkpoint={path}", f"eval.use_ema={str(use_ema).lower()}"), torch.device("cpu"))
    assert target.info["train_step"] == 2 and target.info["weights"] == ("ema" if use_ema else "model")
    with torch.no_grad():
        logits = target.model(_input()).double()
    expected = torch.tensor(REFERENCE["ema_logits" if use_ema else "model_logits"], dtype=torch.float64)
    # the same float32 arithmetic on the same shapes as when recorded; the tolerance allows another CPU's kernels
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)
    assert not torch.allclose(torch.tensor(REFERENCE["ema_logits"]), torch.tensor(REFERENCE["model_logits"]))


def test_a_v1_file_resumes_and_trains_on(tmp_path):
    path = tmp_path / "v1.pt"
    shutil.copy(V1, path)
    summary = fit(compose_cfg(*OVERRIDES, "trainer.max_steps=3", f"trainer.resume={path}"), tmp_path / "run")
    assert summary["status"] == "stopped" and summary["resumed"] and summary["step"] == 3
    written = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", map_location="cpu", weights_only=True)
    assert written["version"] == VERSION and written["format"] == FORMAT and written["state"]["step"] == 3
    # the step from the fixture's weights (restored, not re-initialised) moved them only slightly
    before = load_record(V1).model
    moved = max((written["model"][k] - v).abs().max().item() for k, v in before.items() if v.is_floating_point())
    assert 0 < moved < 0.05


def _rewrite(tmp_path: Path, change) -> Path:
    raw = torch.load(V1, map_location="cpu", weights_only=True)
    change(raw)
    path = tmp_path / "changed.pt"
    torch.save(raw, path)
    return path


def test_unknown_and_missing_keys_are_named(tmp_path):
    def change(raw):
        raw["surprise"] = 1
        del raw["meta"]

    with pytest.raises(CheckpointRecordError, match=r"record version 1\) does not match .*missing \['meta'\]; "
                                                    r"unknown \['surprise'\]"):
        load_record(_rewrite(tmp_path, change))


def test_a_newer_version_is_refused_naming_both_versions(tmp_path):
    path = _rewrite(tmp_path, lambda raw: raw.update(version=VERSION + 1))
    with pytest.raises(CheckpointRecordError, match=rf"record version {VERSION + 1}; this quest reads version\(s\) 1"):
        load_record(path)
    with pytest.raises(ValueError, match=rf"record version {VERSION + 1}"):  # eval.py says the same
        load_target(eval_cfg(f"checkpoint={path}"), torch.device("cpu"))


def test_save_checkpoint_checks_a_dict_against_the_record(tmp_path):
    record = load_checkpoint(V1)
    with pytest.raises(CheckpointRecordError, match=r"unknown \['extra'\]"):
        save_checkpoint(tmp_path / "x.pt", {**record, "extra": 0})
    assert not (tmp_path / "x.pt").exists()
    save_checkpoint(tmp_path / "y.pt", CheckpointRecord.from_dict(record))
    assert load_checkpoint(tmp_path / "y.pt")["state"] == REFERENCE["state"]


@functools.cache
def _v1_record() -> CheckpointRecord:
    return load_record(V1)


def _good_record() -> dict:
    return _v1_record().to_dict()  # a new dict each time; planted() copies what it changes


@pytest.mark.parametrize(("field", "value"), list(faults(CheckpointRecord)),
                         ids=lambda v: v if isinstance(v, str) else repr(v))
def test_every_field_of_a_wrong_type_or_range_is_refused_naming_it(field, value):
    """Every field of the record and of the records in it (meta, state, derived, data), each value of a type it does
    not take or out of its range: one CheckpointRecordError naming the field, never a record believed."""
    stored = planted(_good_record(), field, value)
    with pytest.raises(CheckpointRecordError) as caught:
        CheckpointRecord.from_dict(stored, "ck.pt")
    assert f"ck.pt: {field}" in str(caught.value) or (field == "version" and "record version" in str(caught.value))


def test_the_examples_from_the_field_are_refused_by_the_file_reader(tmp_path):
    """A metrics_bytes of -5 or "669", a step of -4, a config that is a list: each refused when the file is read,
    before a resume or an evaluation believes it."""
    for change, field in [(lambda raw: raw.update(metrics_bytes=-5), "metrics_bytes"),
                          (lambda raw: raw.update(metrics_bytes="669"), "metrics_bytes"),
                          (lambda raw: raw["state"].update(step=-4), "state.step"),
                          (lambda raw: raw.update(config=[1, 2]), "config")]:
        with pytest.raises(CheckpointRecordError, match=rf"changed\.pt: {field} is"):
            load_record(_rewrite(tmp_path, change))


@pytest.mark.parametrize("name", ["../elsewhere.dcp", "/abs/last.dcp", "", ".."])
def test_a_sharded_name_outside_the_checkpoint_folder_is_refused(name):
    with pytest.raises(CheckpointRecordError, match="expected the name of a directory beside"):
        CheckpointRecord.from_dict({**_good_record(), "sharded": name}, "ck.pt")


def test_a_good_record_reads_back_unchanged():
    good = _good_record()
    assert CheckpointRecord.from_dict(good, "ck.pt").to_dict() == good


def test_a_checkpoint_without_the_state_a_resume_needs_is_refused_as_the_file_it_is():
    """A record whose scheduler (or RNG) is gone can be evaluated but not resumed: one DamagedFile naming the file and
    what it lacks, before any part of the run changes (the parts here are never touched)."""
    from quest.run.checkpoint import STATEFUL_PARTS, Checkpointer
    from quest.store.damage import DamagedFile

    saved = CheckpointRecord.from_dict({**_good_record(), "scheduler": None}, "ck.pt")
    with pytest.raises(CheckpointRecordError, match=r"^ck\.pt is a checkpoint that holds no \['scheduler'\]: it cannot "
                                                    r"be resumed") as caught:
        Checkpointer(Path("checkpoints"), ctx=None, sharded=False).restore(
            saved, Path("ck.pt"), dict.fromkeys(STATEFUL_PARTS))
    assert isinstance(caught.value, DamagedFile) and caught.value.path == Path("ck.pt")
