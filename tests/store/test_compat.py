"""quest.store.compat: every older format, written out as an older quest wrote it, upgrades to exactly today's shape; the
real reader accepts it through the upgrade and behaves as with today's format; today's format passes unchanged."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from quest.data.registry import data_set_keys
from quest.evaluation.directory import EvalDirectory, EvalDirectoryError
from quest.run.checkpoint import CheckpointRecord, CheckpointRecordError, load_record
from quest.run.directory import RunDirectory, check_resume, config_differences
from quest.run.plan import Plan, _plan_metrics
from quest.store.compat import (
    FLAT_DATA_KEYS,
    checkpoint_metrics_text,
    upgrade_checkpoint,
    upgrade_checkpoint_v1,
    upgrade_data_config,
    upgrade_data_config_flat,
    upgrade_data_config_without_pipeline,
    upgrade_eval_results,
    upgrade_eval_results_without_status,
    upgrade_metrics_size_only,
    upgrade_run_config,
    upgrade_run_config_recipe_values,
)
from quest.store.torch_files import FORMAT

from ..helpers import compose_cfg, flat_data_config

V1_FILE = Path(__file__).parents[1] / "fixtures" / "checkpoint_v1.pt"

# ---------------------------------------------------------------------------------------------------------------
# the old formats, as an older quest wrote them

#: a checkpoint as the trainer's own dict wrote it before CheckpointRecord (commit c6734fb): no "version"
CHECKPOINT_V1 = {
    "format": "quest-checkpoint-v1", "model": {"head.bias": [0.0, 0.0]}, "sharded": None, "ema": None,
    "optimizer": {"state": {}, "param_groups": []}, "scheduler": {"t_initial": 89}, "scaler": None, "rng": [{}],
    "config": {"trainer": {"seed": 0}}, "meta": {"model": "vit_pico_patch4_16", "num_classes": 10},
    "state": {"step": 2, "epoch": 0}, "choices": {"model": "vit_pico_patch4_16"}, "derived": {"lr": 0.002},
    "data": {"train_size": 32, "val_size": 8, "classes": None}, "metrics_bytes": 12,
    "metrics_text": '{"step": 1}\n',
}
#: the same before metrics.jsonl was kept in checkpoints (commit f47f3ff): the size only ("the old rule")
CHECKPOINT_SIZE_ONLY = {k: v for k, v in CHECKPOINT_V1.items() if k != "metrics_text"}

#: a data config as quest stored it before data sets were registered (commit 0b96722): one flat node with every data
#: set's keys, here data=digits exactly as in tests/fixtures/checkpoint_v1.pt
DATA_FLAT = flat_data_config(name="digits", batch_size=16, img_size=16)
#: today's data=digits node with the same values
DATA_TODAY = {
    "name": "digits", "root": None, "batch_size": 16, "eval_batch_size": None, "num_workers": 0, "num_classes": 10,
    "img_size": 16, "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "train_split": "train", "val_split": "val",
    "subset_fraction": 1.0, "subset_seed": 0, "val_fraction": 0.2, "split_seed": 0, "bad_images": "error",
    "max_skipped_fraction": 0.01, "preflight": True, "pin_memory": True, "pipeline": "timm",
}

#: a config's model and recipe nodes when the model configs carried the recipes' numbers (before commit ba97586)
MODEL_RECIPE_VALUES = {
    "model": {"name": "deit3_huge_patch14_224", "img_size": 154, "layer_scale_init": 1e-4, "kwargs": {},
              "pretrained": None, "pretrained_download": False,
              "recipe_values": {"deit3": {"lr": 3e-3, "img_size": 154, "drop_path": 0.6},
                                "deit3_finetune": {"drop_path": 0.55}}},
    "recipe": {"name": "deit3", "epochs": 400, "lr": 3e-3, "img_size": 154, "drop_path": 0.6},
}

#: eval_results.json as eval.py wrote it before results directories were keyed and marked (commit 40e92f4)
EVAL_RESULTS_NO_STATUS = {
    "suite": "clean", "evaluations": ["clean"],
    "target": {"source": "checkpoint", "checkpoint": "runs/x/checkpoints/last.pt", "weights": "model",
               "model": "vit_pico_patch4_16", "attention": "quest", "img_size": 16},
    "settings": {"name": "clean", "run": ["clean"], "batch_size": 64}, "world_size": 1, "device": "cpu",
    "precision": "fp32", "versions": {"torch": "2.5.1", "timm": "1.0.12"}, "wall_time_s": 3.5,
    "results": {"clean": {"top1": 81.25, "top5": 97.5, "n": 80, "correct": 65}},
}


# ---------------------------------------------------------------------------------------------------------------
# checkpoints


def test_a_v1_checkpoint_gets_its_version():
    assert upgrade_checkpoint_v1(CHECKPOINT_V1) == {**CHECKPOINT_V1, "version": 1}
    assert upgrade_checkpoint(CHECKPOINT_SIZE_ONLY) == {**CHECKPOINT_SIZE_ONLY, "version": 1, "metrics_text": None}
    assert "version" not in CHECKPOINT_V1  # the input is never changed


def _tensors(raw: dict) -> dict:
    return {**raw, "format": FORMAT, "model": {k: torch.tensor(v) for k, v in raw["model"].items()}}


@pytest.mark.parametrize("old", [CHECKPOINT_V1, CHECKPOINT_SIZE_ONLY], ids=["v1", "size_only"])
def test_load_record_reads_a_v1_file_as_the_same_file_with_a_version(tmp_path, old):
    torch.save(_tensors(old), tmp_path / "old.pt")
    torch.save(_tensors({**old, "version": 1}), tmp_path / "today.pt")
    a, b = load_record(tmp_path / "old.pt"), load_record(tmp_path / "today.pt")
    assert a.version == b.version == 1 and a.metrics_text == old.get("metrics_text")
    assert [k for k in a.to_dict() if k != "model"] and \
        {k: v for k, v in a.to_dict().items() if k != "model"} == {k: v for k, v in b.to_dict().items() if k != "model"}
    assert torch.equal(a.model["head.bias"], b.model["head.bias"])


def test_a_record_dict_must_carry_its_version():
    """Only files are upgraded (load_record); a dict given to the record says its version."""
    with pytest.raises(CheckpointRecordError, match="no record version"):
        CheckpointRecord.from_dict({**CHECKPOINT_V1, "format": FORMAT})


def test_the_v1_fixture_upgrades_to_todays_layout_and_config():
    """tests/fixtures/checkpoint_v1.pt, written by the code before the record: every old format of its config too."""
    raw = torch.load(V1_FILE, map_location="cpu", weights_only=True)
    upgraded = upgrade_checkpoint(raw)
    assert set(upgraded) == set(raw) | {"version"} and upgraded["version"] == 1
    config = upgrade_run_config(raw["config"], data_set_keys)
    assert config["data"] == DATA_TODAY
    assert "recipe_values" not in config["model"] and config["recipe"]["by_model_size"] == {}
    assert raw["config"]["data"] == DATA_FLAT  # the fixture of this module is the real stored node


# ---------------------------------------------------------------------------------------------------------------
# metrics.jsonl of a checkpoint that stored only its size

HELD = b'{"step": 1}\n{"step": 2}\n'


def test_the_size_only_rule_becomes_the_file_up_to_that_size():
    assert upgrade_metrics_size_only(12, HELD) == b'{"step": 1}\n'
    assert upgrade_metrics_size_only(12, None) == b""
    assert checkpoint_metrics_text(None, 12, HELD) == b'{"step": 1}\n'
    assert checkpoint_metrics_text('{"step": 1}\n', 12, HELD) == b'{"step": 1}\n'  # today's: its own text
    assert checkpoint_metrics_text(None, None, HELD) is None  # written without a metrics log


def _plan(tmp_path: Path, held: bytes | None, raw: dict) -> Plan:
    run = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    run.mkdir()
    if held is not None:
        (run / "metrics.jsonl").write_bytes(held)
    plan = Plan()
    _plan_metrics(RunDirectory(run), CheckpointRecord.from_dict(upgrade_checkpoint(raw)), plan)
    return plan


@pytest.mark.parametrize("held", [HELD, HELD[:12], HELD[:5], None], ids=["longer", "same", "shorter", "missing"])
def test_the_run_directory_plans_a_size_only_checkpoint_as_the_old_rule_did(tmp_path, held):
    """The old rule: lines past metrics_bytes are cut off (kept aside), anything else is left as it is; and the same
    plan as for today's checkpoint that saw those bytes."""
    old = _plan(tmp_path, held, {**CHECKPOINT_SIZE_ONLY, "format": FORMAT})
    cut = held == HELD
    assert (old.metrics_cut, old.metrics_text) == ((True, HELD[:12]) if cut else (False, None))
    assert [name for name, _ in old.aside] == (["metrics.jsonl"] if cut else [])
    if held is not None:
        today = _plan(tmp_path, held, {**CHECKPOINT_V1, "format": FORMAT, "metrics_text": held[:12].decode()})
        assert (today.metrics_cut, today.metrics_text, today.aside) == (old.metrics_cut, old.metrics_text, old.aside)


# ---------------------------------------------------------------------------------------------------------------
# the stored training config


def test_a_flat_data_config_keeps_its_data_sets_keys_and_gets_a_pipeline():
    assert upgrade_data_config_flat(DATA_FLAT, data_set_keys("digits")) == \
        {k: v for k, v in DATA_TODAY.items() if k != "pipeline"}
    assert upgrade_data_config(DATA_FLAT, data_set_keys("digits")) == DATA_TODAY
    assert upgrade_data_config_flat(DATA_FLAT, None) == DATA_FLAT  # a data set not registered: kept whole
    assert set(DATA_FLAT) == FLAT_DATA_KEYS


def test_a_data_config_without_pipeline_trained_with_timm():
    old = {k: v for k, v in DATA_TODAY.items() if k != "pipeline"}
    assert upgrade_data_config_without_pipeline(old) == DATA_TODAY


def test_model_recipe_values_gives_way_to_an_empty_recipe_table():
    assert upgrade_run_config_recipe_values(MODEL_RECIPE_VALUES) == {
        "model": {"name": "deit3_huge_patch14_224", "img_size": 154, "layer_scale_init": 1e-4, "kwargs": {},
                  "pretrained": None, "pretrained_download": False},
        "recipe": {"name": "deit3", "epochs": 400, "lr": 3e-3, "img_size": 154, "drop_path": 0.6, "by_model_size": {}},
    }
    assert "recipe_values" in MODEL_RECIPE_VALUES["model"]


def _today() -> dict:
    return OmegaConf.to_container(compose_cfg("data=digits", "model=vit_pico", "recipe=light"), resolve=True)


def test_a_resume_reads_every_old_config_format_as_today_s():
    """config_differences / check_resume (what a resume reads of a checkpoint's or run.json's config): a config with
    the flat data node, no data.pipeline and model.recipe_values is today's config with the same values."""
    new = _today()
    old = copy.deepcopy(new)
    old["data"] = {**DATA_FLAT, **{k: v for k, v in new["data"].items() if k != "pipeline"}}
    old["model"]["recipe_values"] = {"deit": {"drop_path": 0.0}}
    del old["recipe"]["by_model_size"]
    assert config_differences(old, new) == []
    check_resume(old, new, Path("/run"))
    split = {**new, "data": {**new["data"], "pipeline": "split"}}  # the old run trained with timm's transform
    assert [(d.key, d.stored, d.new) for d in config_differences(old, split)] == [("data.pipeline", "timm", "split")]


# ---------------------------------------------------------------------------------------------------------------
# eval_results.json


def test_results_without_a_status_are_complete():
    assert upgrade_eval_results_without_status(EVAL_RESULTS_NO_STATUS) == {**EVAL_RESULTS_NO_STATUS,
                                                                            "status": "complete"}
    assert upgrade_eval_results(EVAL_RESULTS_NO_STATUS)["status"] == "complete"


def test_the_eval_directory_reads_results_without_a_status_as_complete_and_unkeyed(tmp_path):
    (tmp_path / "eval_results.json").write_text(json.dumps(EVAL_RESULTS_NO_STATUS))
    status, record = EvalDirectory(tmp_path, is_main=False).state()
    assert status == "complete" and record == {**EVAL_RESULTS_NO_STATUS, "status": "complete"}
    with pytest.raises(EvalDirectoryError, match="complete results of another evaluation; they were written by an "
                                                 "older quest"):
        EvalDirectory(tmp_path, is_main=False).begin({"evaluated": {}, "settings": {}, "inputs": {}}, False)


# ---------------------------------------------------------------------------------------------------------------
# today's formats pass unchanged

_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                    max_size=3), max_leaves=8)


@settings(max_examples=60, deadline=None)
@given(extra=st.dictionaries(st.text(max_size=8), _values, max_size=4),
       status=st.sampled_from(["running", "complete", "partial"]), version=st.integers(1, 3))
def test_today_s_formats_pass_unchanged(extra, status, version):
    record = {**extra, "format": FORMAT, "version": version}
    assert upgrade_checkpoint(record) == record
    results = {**extra, "status": status}
    assert upgrade_eval_results(results) == results
    data = {**{k: v for k, v in extra.items() if k not in FLAT_DATA_KEYS}, **DATA_TODAY}
    assert upgrade_data_config(data, data_set_keys("digits")) == data
    config = {**extra, "model": {"name": "vit_pico_patch4_16", **extra}, "data": data}
    config["model"].pop("recipe_values", None)
    assert upgrade_run_config(config, data_set_keys) == config


def test_today_s_composed_config_passes_unchanged():
    config = _today()
    assert upgrade_run_config(config, data_set_keys) == config
