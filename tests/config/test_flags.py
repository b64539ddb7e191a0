"""A timm or DeiT habit (``--epochs 3``) is answered in one line naming the quest override it means (quest.config.flags),
before Hydra parses anything; Hydra's own flags pass."""
from __future__ import annotations

import dataclasses
import sys
import typing

import pytest

from quest import cli
from quest.config.checks import dataclass_of
from quest.config.files import config_root
from quest.config.flags import KEY_OF_FLAG, flag_problems
from quest.config.hydra_store import register_configs
from quest.config.overrides import app_groups
from quest.config.schema import TrainConfig
from quest.runtime.errors import EXIT_ERROR


def _is_key(dotted: str) -> bool:
    node: type | None = TrainConfig
    for part in dotted.split("."):
        fields = {f.name: f for f in dataclasses.fields(node)} if node else {}
        if part not in fields:
            return False
        node = dataclass_of(typing.get_type_hints(node)[part])
    return True


@pytest.mark.parametrize("flag", sorted(KEY_OF_FLAG))
def test_every_flag_names_a_key_or_group_quest_has(flag):
    register_configs()
    key = KEY_OF_FLAG[flag].split("=", 1)[0]
    groups = app_groups(config_root(), "train")
    assert key in groups or key == "hydra.run.dir" or _is_key(key), f"{flag} -> {key}: not a quest key"


@pytest.mark.parametrize("args, expected", [
    (["--epochs", "3"], ["--epochs 3: quest takes key=value overrides, not flags: write trainer.epochs=3"]),
    (["--epochs=3", "model=vit_pico"], ["--epochs=3: quest takes key=value overrides, not flags: write trainer.epochs=3"]),
    (["--amp", "--model", "vit_tiny"], ["--amp: quest takes key=value overrides, not flags: write trainer.precision=fp16",
                                        "--model vit_tiny: quest takes key=value overrides, not flags: write model=vit_tiny"]),
    (["--frobnicate"], ["--frobnicate: not a flag quest knows; quest takes key=value overrides such as trainer.epochs=3"]),
    (["-m", "attention=standard,quest", "--cfg", "job", "--help", "recipe.lr=-1"], []),  # Hydra's own, and values
])
def test_a_flag_is_answered_with_the_override_it_means(args, expected):
    found = flag_problems(args, "train.py")
    assert [line.split(" (train.py --help")[0] for line in found] == expected


def test_train_py_with_timm_flags_exits_1_before_hydra_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["train.py", "--model", "vit_tiny", "--epochs", "3"])
    with pytest.raises(SystemExit) as exit_info:
        cli.train()
    err = capsys.readouterr().err
    assert exit_info.value.code == EXIT_ERROR and "Traceback" not in err
    assert err.splitlines() == [
        "train.py: error: --model vit_tiny: quest takes key=value overrides, not flags: write model=vit_tiny "
        "(train.py --help lists every key)",
        "train.py: error: --epochs 3: quest takes key=value overrides, not flags: write trainer.epochs=3 "
        "(train.py --help lists every key)"]
    assert list(tmp_path.iterdir()) == []  # nothing made: no outputs/, no runs/
