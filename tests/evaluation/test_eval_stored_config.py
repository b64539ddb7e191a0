"""A checkpoint is read back from a file: every value of its stored train.py config is checked against train.py's own
declarations (quest.config.schema) before anything is built from it, and every requirement a suite has on the data
and the model (boxes for explain, ...) and every eval.* number's upper bound is checked before the first evaluation
runs. Each refusal names the file and the field, and leaves the results directory as it was (not created)."""
from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path

import pytest
import torch

from quest.config.checks import ConfigError
from quest.evaluation import run_evaluation
from quest.evaluation.config import eval_settings_schema
from quest.run.checkpoint_record import CheckpointRecordError
from quest.store.records import bound_ends, unwrap_optional
from quest.train import fit

from ..helpers import FAST, compose_cfg
from .test_eval_cli import eval_cfg


@pytest.fixture(scope="module")
def last_pt(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    fit(compose_cfg(*FAST, "trainer.epochs=1", "trainer.max_steps=1"), run_dir)
    return run_dir / "checkpoints" / "last.pt"


def _edited(last_pt: Path, tmp_path: Path, key: str, value, delete: bool = False) -> Path:
    """A copy of ``last_pt`` whose config has ``key`` set to ``value`` (or removed): loaded and saved as a user would
    edit it (weights_only=True)."""
    ckpt = torch.load(last_pt, map_location="cpu", weights_only=True)
    *parents, leaf = key.split(".")
    node = ckpt["config"]
    for part in parents:
        node = node[part]
    if delete:
        del node[leaf]
    else:
        node[leaf] = value
    path = tmp_path / "run" / "checkpoints" / "edited.pt"
    path.parent.mkdir(parents=True)
    torch.save(ckpt, path)
    return path


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


EDITS = [  # (key, stored value, what the refusal says is expected)
    ("recipe.eval_interpolation", "bogus", "must be one of bilinear, bicubic, nearest"),
    ("recipe.crop_pct", float("nan"), "must be a finite number"),
    ("recipe.crop_pct", 0.001, "must be in [0.1, 1]"),
    ("recipe.crop_pct", "0.9", "must be in [0.1, 1]"),
    ("data.num_classes", "10", "must be a positive integer"),
    ("data.num_classes", 0, "must be a positive integer"),
    ("data.mean", "abc", "must be three values in [0, 1]"),
    ("data.mean", [0.5, 0.5], "must be three values in [0, 1]"),
    ("data.mean", [123.7, 116.3, 103.5], "must be three values in [0, 1]"),
    ("data.std", [0, 0, 0], "must be three values > 0"),
    ("data.std", [float("inf"), 0.2, 0.2], "must be a finite number"),
    ("data.name", "no_such_data", "must be one of"),
    ("model.name", "no_such_model", "must be a timm model name"),
    ("attention.name", "no_such_attention", "is invalid"),
    ("recipe.crop_pct", None, "is missing"),
    ("data.mean", None, "is missing"),
]


@pytest.mark.parametrize("key, value, expected", EDITS, ids=[f"{k}={v!r}" for k, v, _ in EDITS])
def test_a_bad_stored_config_value_is_refused_before_any_change(last_pt, tmp_path, key, value, expected):
    path = _edited(last_pt, tmp_path, key, value, delete=expected == "is missing")
    out = tmp_path / "run" / "eval" / "clean" / "edited-model"
    before = _tree(tmp_path)
    # a value out of its declaration is refused as the record is loaded (every reader of a checkpoint: resume,
    # init_from, quest-export); a key evaluation needs or an unknown name by evaluation's own check
    with pytest.raises((ConfigError, CheckpointRecordError)) as info:
        run_evaluation(eval_cfg(f"checkpoint={path}", "eval=clean"), out)
    lines = [line for line in str(info.value).splitlines() if f"config.{key}" in line]
    assert len(lines) == 1 and f"{path}: config.{key} {expected}" in lines[0], str(info.value)
    assert not out.exists() and not out.parent.exists()  # the results directory was not created
    assert _tree(tmp_path) == before  # nor anything else written (the checkpoint included)


def test_an_existing_results_directory_is_left_as_it_was(last_pt, tmp_path):
    path = _edited(last_pt, tmp_path, "recipe.eval_interpolation", "bogus")
    out = tmp_path / "results"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    before = _tree(out)
    with pytest.raises(CheckpointRecordError, match="config.recipe.eval_interpolation"):
        run_evaluation(eval_cfg(f"checkpoint={path}", "eval=clean"), out)
    assert _tree(out) == before and sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_the_unedited_checkpoint_passes_the_checks(last_pt, tmp_path):
    """The check refuses what train.py would refuse, not what it wrote: the matrix above edits this one."""
    report = run_evaluation(eval_cfg(f"checkpoint={last_pt}", "eval=clean", "eval.clean.max_samples=4"),
                            tmp_path / "out")
    assert report["status"] == "complete"


@pytest.mark.parametrize("suite, overrides, expected", [
    ("explain", (), "explain: data=fake has no bounding boxes"),  # its clean part would run first otherwise
    ("adversarial", ("eval.adversarial.source=imagenet_val", "eval.roots.val={tmp}"),
     "eval.adversarial.source=imagenet_val needs a 1000-class ImageNet classifier"),
])
def test_a_suite_requirement_on_data_or_model_is_checked_before_the_first_evaluation(last_pt, tmp_path, suite,
                                                                                     overrides, expected):
    out = tmp_path / "eval" / suite
    with pytest.raises(ValueError, match=expected):
        run_evaluation(eval_cfg(f"checkpoint={last_pt}", f"eval={suite}",
                                *(o.format(tmp=tmp_path) for o in overrides)), out)
    assert not out.exists()  # no evaluation ran: no directory, no status: partial


def _numbers(schema: type, prefix: str) -> list[tuple[str, typing.Any, dict]]:
    """Every int/float field (or list of them) under the eval schema: (key, type, metadata)."""
    found = []
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = unwrap_optional(hints[f.name])
        args = typing.get_args(hint)
        item = unwrap_optional(args[0]) if typing.get_origin(hint) in (list, tuple) and args else hint
        if dataclasses.is_dataclass(item):
            found += _numbers(item, f"{prefix}{f.name}.")
        elif item in (int, float):
            found.append((f"{prefix}{f.name}", item, f.metadata))
    return found


NUMBERS = _numbers(eval_settings_schema(), "eval.")


def test_every_eval_number_has_an_upper_bound():
    unbounded = [key for key, _, metadata in NUMBERS if bound_ends(metadata.get("bounds", (None, None)))[1] is None]
    assert not unbounded


@pytest.mark.parametrize("key, kind, metadata", NUMBERS, ids=[k for k, _, _ in NUMBERS])
def test_a_number_past_its_upper_bound_is_refused_before_any_change(tmp_path, key, kind, metadata):
    high = bound_ends(metadata["bounds"])[1]
    value = 10**20 if kind is int else (high * 10 if high > 0 else math.inf)
    is_list = typing.get_origin(unwrap_optional(next(
        typing.get_type_hints(s)[key.rsplit(".", 1)[1]] for s in [_schema_of(key)]))) in (list, tuple)
    given = f"[{value}]" if is_list else str(value)
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as info:
        run_evaluation(eval_cfg("model=vit_pico", "attention=quest", f"{key}={given}"), out)
    assert f"  {key} must be" in str(info.value)
    assert not out.exists()


def _schema_of(key: str) -> type:
    schema = eval_settings_schema()
    for part in key.split(".")[1:-1]:
        hint = unwrap_optional(typing.get_type_hints(schema)[part])
        schema = hint if dataclasses.is_dataclass(hint) else typing.get_args(hint)[0]
    return schema
