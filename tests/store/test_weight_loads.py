"""Every load of weights is checked the same way (quest.store.weights_check) before anything changes: resume,
trainer.init_from=, model.pretrained=, eval.py's checkpoint= and weights=, quest-export. A NaN or inf in a weight,
a tensor of another shape or integer values for a floating weight are refused in one line naming the file and the
tensor, the run or results directory byte-identical; a good file loads as before."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from quest import cli
from quest.evaluation import register_eval_configs
from quest.evaluation.target import load_target
from quest.runtime.errors import EXIT_ERROR, is_user_error
from quest.store.weights_check import WeightsError, check_weights
from quest.tools.export import export_run
from quest.train import fit

from ..helpers import FAST, compose_cfg, eval_cfg
from ..tree_state import tree_state

register_eval_configs()

KEY = "blocks.0.attn.qkv.weight"
ONE_STEP = [*FAST, "trainer.max_steps=1"]


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    """A one-step run (stopped at trainer.max_steps) whose last.pt holds the model's and the EMA's weights."""
    run = tmp_path_factory.mktemp("good") / "run"
    fit(compose_cfg(*ONE_STEP), run)
    return run


def _damaged(tensor: torch.Tensor, fault: str) -> torch.Tensor:
    """``tensor`` with ``fault``: a NaN or inf in one element, a row less, or integer values."""
    if fault == "shape":
        return tensor[:-1].clone()
    if fault == "int":
        return (tensor * 100).to(torch.int64)
    out = tensor.clone()
    out.view(-1)[tensor.numel() // 2] = float("nan" if fault in ("nan", "ema_nan") else "inf")
    return out


def _run_copy(good_run: Path, tmp_path: Path, fault: str | None) -> tuple[Path, Path]:
    """A copy of the good run and its last.pt, with ``fault`` in the model's weights (the EMA's for ema_nan)."""
    run = tmp_path / "run"
    shutil.copytree(good_run, run, symlinks=True)
    last = run / "checkpoints" / "last.pt"
    if fault is not None:
        ckpt = torch.load(last, weights_only=True)
        part = "ema" if fault == "ema_nan" else "model"
        ckpt[part][KEY] = _damaged(ckpt[part][KEY], fault)
        last.unlink()  # a file of its own, whatever links the run had (best.pt keeps the good weights)
        torch.save(ckpt, last)
    return run, last


def _weights_file(good_run: Path, tmp_path: Path, fault: str | None) -> Path:
    """The good run's model weights as a plain state_dict file, with ``fault``."""
    state = dict(torch.load(good_run / "checkpoints" / "last.pt", weights_only=True)["model"])
    if fault is not None:
        state[KEY] = _damaged(state[KEY], fault)
    path = tmp_path / "given" / "weights.pth"
    path.parent.mkdir()
    torch.save(state, path)
    return path


def _attention(good_run: Path) -> str:
    return torch.load(good_run / "checkpoints" / "last.pt", weights_only=True)["config"]["attention"]["name"]


# each load: (good_run, tmp_path, fault) -> (the file named in the refusal, the folder that must not change, the load)
Load = Callable[[Path, Path, "str | None"], tuple[str, Path, Callable[[], Any]]]


def _resume(good_run: Path, tmp_path: Path, fault: str | None):
    run, last = _run_copy(good_run, tmp_path, fault)
    (run / "summary.json").unlink()  # an interrupted run: the next command resumes from last.pt
    return str(last), run, lambda: fit(compose_cfg(*FAST, "trainer.max_steps=2"), run)


def _new_run(tmp_path: Path) -> Path:
    """The (empty) directory of a new run: fit makes it to hold its lock, and a refused start leaves it empty."""
    (tmp_path / "new").mkdir()
    return tmp_path / "new"


def _init_from(good_run: Path, tmp_path: Path, fault: str | None):
    _, last = _run_copy(good_run, tmp_path, fault)
    which = "ema" if fault == "ema_nan" else "model"  # recipe.init_weights: the weights it starts from
    cfg = compose_cfg(*ONE_STEP, f"trainer.init_from={last}", f"recipe.init_weights={which}")
    return f"trainer.init_from={last}", _new_run(tmp_path), lambda: fit(cfg, tmp_path / "new")


def _pretrained(good_run: Path, tmp_path: Path, fault: str | None):
    path = _weights_file(good_run, tmp_path, fault)
    cfg = compose_cfg(*ONE_STEP, f"model.pretrained={path}")
    return f"model.pretrained={path}", _new_run(tmp_path), lambda: fit(cfg, tmp_path / "new")


def _eval_checkpoint(good_run: Path, tmp_path: Path, fault: str | None):
    _, last = _run_copy(good_run, tmp_path, fault)
    cfg = eval_cfg(f"checkpoint={last}", "eval=clean", f"eval.use_ema={fault == 'ema_nan'}")
    return f"checkpoint={last}", tmp_path / "run", lambda: load_target(cfg, torch.device("cpu"))


def _eval_weights(good_run: Path, tmp_path: Path, fault: str | None):
    path = _weights_file(good_run, tmp_path, fault)
    cfg = eval_cfg("model=vit_pico", f"attention={_attention(good_run)}", f"weights={path}", "eval=clean")
    return f"weights={path}", tmp_path / "given", lambda: load_target(cfg, torch.device("cpu"))


def _export(good_run: Path, tmp_path: Path, fault: str | None):
    run, last = _run_copy(good_run, tmp_path, fault)
    weights = "ema" if fault == "ema_nan" else "model"
    (tmp_path / "out").mkdir()
    return str(last), tmp_path, lambda: export_run(run, tmp_path / "out", weights)


LOADS: dict[str, Load] = {"resume": _resume, "init_from": _init_from, "pretrained": _pretrained,
                          "eval_checkpoint": _eval_checkpoint, "eval_weights": _eval_weights, "export": _export}
# the EMA fault where the load reads the EMA: resume, init_from (recipe.init_weights=ema), eval.use_ema, --weights ema
CASES = [(load, fault) for load in LOADS for fault in ("nan", "inf", "ema_nan", "shape", "int")
         if fault != "ema_nan" or load not in ("pretrained", "eval_weights")]


@pytest.mark.parametrize("load, fault", CASES)
def test_a_damaged_or_foreign_tensor_is_refused_in_one_line_and_nothing_changes(good_run, tmp_path, load, fault):
    named, folder, run = LOADS[load](good_run, tmp_path, fault)
    before = tree_state(folder)
    with pytest.raises(WeightsError) as info:
        run()
    message = str(info.value)
    assert is_user_error(info.value) and "\n" not in message
    assert message.startswith(f"{named}: ") and repr(KEY) in message, message
    expected = {"shape": "has shape (191, 64), the model's (192, 64)", "int": "holds int64 values",
                "nan": "hold 1 non-finite values (NaN/inf)", "inf": "hold 1 non-finite values (NaN/inf)",
                "ema_nan": "EMA weights 'blocks.0.attn.qkv.weight' hold 1 non-finite"}[fault]
    assert expected in message, message
    assert tree_state(folder) == before


@pytest.mark.parametrize("load", list(LOADS))
def test_a_good_file_loads_as_before(good_run, tmp_path, load):
    _, folder, run = LOADS[load](good_run, tmp_path, None)
    result = run()
    saved = torch.load(good_run / "checkpoints" / "last.pt", weights_only=True)["model"]
    if load in ("resume", "init_from", "pretrained"):
        assert result["status"] == "stopped" and result["step"] == (2 if load == "resume" else 1), result
    elif load == "export":
        exported = load_file(str(result / "model.safetensors"))
        assert all(torch.equal(exported[k], saved[k]) for k in saved)
    else:
        own = result.model.state_dict()
        assert all(torch.equal(own[k], saved[k]) for k in saved)


def test_the_ema_is_not_checked_where_it_is_not_loaded(good_run, tmp_path):
    """eval.py's checkpoint= without eval.use_ema reads the model's weights only: a damaged EMA does not stop it."""
    _, _, run = _eval_checkpoint(good_run, tmp_path, "ema_nan")
    cfg = eval_cfg(f"checkpoint={tmp_path / 'run' / 'checkpoints' / 'last.pt'}", "eval=clean")
    assert load_target(cfg, torch.device("cpu")).info["weights"] == "model"


@pytest.mark.parametrize("given, expected", [
    ("folder", "is a directory"),
    ("text.pt", "is not a torch checkpoint file: it looks like a text file"),
    ("state_dict.pth", "is a plain state_dict"),
])
def test_a_wrong_init_from_file_is_one_line(good_run, tmp_path, given, expected):
    from quest.run.checkpoint import read_init_from

    path = tmp_path / given
    if given == "folder":
        path.mkdir()
    elif given == "text.pt":
        path.write_text("not weights\n")
    else:
        torch.save(torch.load(good_run / "checkpoints" / "last.pt", weights_only=True)["model"], path)
    with pytest.raises((OSError, ValueError)) as info:
        read_init_from(path)
    assert is_user_error(info.value) and str(info.value).startswith(f"trainer.init_from={path} ")
    assert expected in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("key, through_folder, advice", [
    ("model.pretrained", False, "trainer.init_from="), ("model.pretrained", True, "trainer.init_from="),
    ("weights", True, "checkpoint="),
])
def test_a_quest_checkpoint_where_weights_belong_names_the_key_given_and_the_one_that_takes_it(
        good_run, tmp_path, key, through_folder, advice):
    """model.pretrained= and weights= take a state_dict; a quest checkpoint there (a file, or in a local-dir:
    folder) is refused naming the key the user gave and the key that takes a checkpoint."""
    from quest.models.pretrained import pretrained_state_dict

    folder = tmp_path / "weights"
    shutil.copytree(good_run / "checkpoints", folder)
    (folder / "config.json").write_text("{}")  # what makes a folder of exported weights, beside the checkpoint
    source = f"local-dir:{folder}" if through_folder else str(folder / "last.pt")
    with pytest.raises(ValueError) as info:
        pretrained_state_dict(source, option=key)
    said = str(info.value)
    assert said.startswith(f"{key}=") and "is a quest checkpoint" in said and advice in said and "\n" not in said


def test_a_missing_init_from_file_is_refused_by_the_config_check(tmp_path):
    from quest.config.checks import ConfigError
    from quest.train.checks import check_train_config

    with pytest.raises(ConfigError, match="trainer.init_from"):
        check_train_config(compose_cfg(*ONE_STEP, f"trainer.init_from={tmp_path / 'none.pt'}"))


def test_a_checkpoint_of_another_model_as_init_from_is_one_line(good_run, tmp_path):
    """A vit_pico checkpoint given to a wider model: refused naming a tensor, not a size-mismatch traceback."""
    cfg = compose_cfg(*ONE_STEP, f"trainer.init_from={good_run / 'checkpoints' / 'last.pt'}",
                      "model=vit_nano")
    with pytest.raises(WeightsError, match=r"^trainer.init_from=.*: EMA weights do not fit the model: .*has shape"):
        fit(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists() or tree_state(tmp_path / "run") == {}


def test_init_from_a_text_file_through_train_py_exits_1_with_one_line(tmp_path, monkeypatch, capsys):
    """train.py as the console script runs it (in this process: its error path and exit code are the point)."""
    text = tmp_path / "notes.pt"
    text.write_text("not weights\n")
    before = tree_state(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # what a user sees
    monkeypatch.setattr(sys, "argv", ["train.py", *ONE_STEP, f"trainer.init_from={text}",
                                      f"hydra.run.dir={tmp_path / 'run'}"])
    with pytest.raises(SystemExit) as exit_info:
        cli.train()
    err = capsys.readouterr().err
    assert exit_info.value.code == EXIT_ERROR and "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if "train.py: error: " in line]
    assert len(errors) == 1 and f"trainer.init_from={text} is not a torch checkpoint file" in errors[0], err
    assert tree_state(tmp_path) == before


_MODEL = None


def _model_state() -> dict[str, torch.Tensor]:
    global _MODEL
    if _MODEL is None:
        from quest.models import create_model

        _MODEL = create_model("vit_pico_patch4_16", attention="standard", num_classes=10).state_dict()
    return _MODEL


@settings(max_examples=30, deadline=None)
@given(index=st.integers(min_value=0), fault=st.sampled_from(["nan", "inf", "shape", "int"]),
       where=st.integers(min_value=0))
def test_the_check_names_whichever_tensor_holds_the_fault(index, fault, where):
    own = _model_state()
    floats = [k for k, v in own.items() if v.is_floating_point() and v.dim() > 0]
    key = floats[index % len(floats)]
    state = {k: v.clone() for k, v in own.items()}
    value = state[key]
    if fault == "shape":
        state[key] = torch.zeros(value.shape[0] + 1, *value.shape[1:])
    elif fault == "int":
        state[key] = value.to(torch.int32)
    else:
        value.view(-1)[where % value.numel()] = float(fault)
    with pytest.raises(WeightsError) as info:
        check_weights(state, "f.pt", "weights", own)
    assert str(info.value).startswith("f.pt: weights ") and repr(key) in str(info.value)
    check_weights(own, "f.pt", "weights", own)  # the untouched weights pass


def test_the_first_damaged_tensor_is_named_and_the_others_counted():
    """Many damaged tensors: the first is named with its count, the others counted (one flag per tensor)."""
    state = {f"w{i}": torch.ones(4) for i in range(6)}
    state["w2"][1:3] = float("nan")
    state["w4"][0] = float("-inf")
    state["steps"] = torch.tensor(3)  # an integer buffer is not a weight to check for NaN
    with pytest.raises(WeightsError, match=r"^f.pt: weights 'w2' hold 2 non-finite values \(NaN/inf\) of 4 "
                                           r"\(and 1 more tensors: \['w4'\]\)"):
        check_weights(state, "f.pt")
