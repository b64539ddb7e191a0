"""What eval.py records as applied is what its transform and model used (docs/evaluation.md, "Results"): for every
key that changes the input (size, crop, interpolation, normalisation), the record's value read against the
transform timm built and the model's own input size; a key it would not use is refused in one line naming it."""
from __future__ import annotations

import pytest
import torch
from torchvision import transforms as T

from quest.config.checks import ConfigError
from quest.evaluation import register_eval_configs
from quest.evaluation.runner import _target_report, check_ignored_overrides
from quest.evaluation.target import load_target
from quest.evaluation.transforms import eval_transform
from quest.train import fit

from ..helpers import FAST, compose_cfg, eval_cfg

register_eval_configs()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    fit(compose_cfg(*FAST, "trainer.epochs=1", "trainer.max_steps=1"), run)
    return run / "checkpoints" / "last.pt"


APPLIED = [(), ("data.mean=[0.5,0.4,0.3]",), ("data.std=[0.2,0.3,0.4]",), ("eval.crop_pct=0.5",),
           ("eval.interpolation=bilinear",), ("data.img_size=16",), ("data=fake", "data.mean=[0.1,0.2,0.3]"),
           ("eval.crop_pct=0.8", "eval.interpolation=bicubic", "data.std=[0.5,0.5,0.5]")]


@pytest.mark.parametrize("overrides", APPLIED, ids=lambda o: " ".join(o) or "as trained")
def test_the_record_says_what_the_transform_and_the_model_used(checkpoint, overrides):
    target = load_target(eval_cfg(f"checkpoint={checkpoint}", "eval=clean", *overrides), torch.device("cpu"))
    record = _target_report(target)
    resize, crop, _, normalize = eval_transform(target).transforms
    assert tuple(target.model.patch_embed.img_size) == (record["img_size"],) * 2 == tuple(crop.size)
    assert resize.size == int(record["img_size"] / record["crop_pct"])  # timm: the short side to size / crop_pct
    assert resize.interpolation == T.InterpolationMode(record["interpolation"])
    assert normalize.mean.tolist() == pytest.approx(record["mean"]) and normalize.std.tolist() == pytest.approx(record["std"])
    for key, value in record["data_overrides"].items():  # what it says it applied is in the data it evaluated
        assert target.data[key] == value
    given = dict(o.split("=", 1) for o in overrides)
    for key, field in (("eval.crop_pct", "crop_pct"), ("eval.interpolation", "interpolation")):
        if key in given:
            assert str(record[field]) == given[key]


@pytest.mark.parametrize("overrides, said", [
    (("data.img_size=32",), "data.img_size=32: the model takes 16 px images"),
])
def test_a_data_key_the_evaluation_would_not_use_is_refused_when_the_model_is_built(checkpoint, overrides, said):
    with pytest.raises(ValueError, match=said):
        load_target(eval_cfg(f"checkpoint={checkpoint}", "eval=clean", *overrides), torch.device("cpu"))


@pytest.mark.parametrize("override, said", [
    ("data.batch_size=4", "data.batch_size=4: changes only how training reads its data"),
    ("data.pipeline=tensor", "data.pipeline=tensor: changes only how training reads its data"),
    ("data.img_size=32", "data.img_size=32: the model takes 16 px images"),  # with data=<name>, not applied either
])
def test_a_command_line_key_the_evaluation_would_not_use_is_refused(override, said):
    with pytest.raises(ConfigError, match="these command-line settings would be ignored:\n  " + said):
        check_ignored_overrides([override], ["clean"], {"data.root": "x"}, model_size=16)
    check_ignored_overrides(["data.img_size=16", "data.mean=[0.5,0.5,0.5]"], ["clean"], {"data.root": "x"},
                            model_size=16)  # the model's own size, and a key the evaluation reads: accepted
