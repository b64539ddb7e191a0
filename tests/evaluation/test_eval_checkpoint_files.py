"""A file that cannot be evaluated is refused saying which case it is: not a torch file, truncated or corrupt, a
plain state_dict (the only case that suggests weights=), a torch file of another kind, unsafe pickles."""
from __future__ import annotations

import pickle
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

from quest.evaluation import run_evaluation
from quest.run.checkpoint import load_checkpoint, load_record
from quest.store.torch_files import inspect_torch_file
from quest.train import fit

from ..helpers import FAST, compose_cfg
from .test_eval_cli import eval_cfg


@pytest.fixture(scope="module")
def last_pt(tmp_path_factory) -> Path:
    """A real last.pt from a one-step training run."""
    run_dir = tmp_path_factory.mktemp("run")
    fit(compose_cfg(*FAST, "trainer.max_steps=1"), run_dir)
    return run_dir / "checkpoints" / "last.pt"


def _refusal(tmp_path: Path, *overrides: str, error: type[Exception] = ValueError) -> str:
    with pytest.raises(error) as info:
        run_evaluation(eval_cfg(*overrides, "eval=clean"), tmp_path / "out")
    return str(info.value)


def _checkpoint(tmp_path: Path, path: Path) -> str:
    message = _refusal(tmp_path, f"checkpoint={path}")
    assert f"checkpoint={path}" in message
    return message


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_random_bytes_are_not_a_torch_file(tmp_path):
    path = _write(tmp_path / "noise.pt", np.random.default_rng(0).bytes(4096))
    message = _checkpoint(tmp_path, path)
    assert "is not a torch checkpoint file: it starts with the bytes" in message
    assert "weights=" not in message and "checkpoint= takes a checkpoint written by train.py" in message


def test_a_text_file_is_not_a_torch_file(tmp_path):
    path = _write(tmp_path / "notes.pt", b"hello, these are my notes\nline two\n")
    message = _checkpoint(tmp_path, path)
    assert "is not a torch checkpoint file: it looks like a text file, starting 'hello, these are my notes'" in message
    assert "weights=" not in message and "101" not in message


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")  # torch.load's, from trying the pickle first
@pytest.mark.parametrize("name, data, expected", [
    ("empty.pt", b"", "it is empty (0 bytes)"),
    ("pickled.pt", pickle.dumps({"model": [1, 2, 3]}), "it is a Python pickle (pickle.dump), not a torch.save file"),
])
def test_empty_files_and_python_pickles_are_not_torch_files(tmp_path, name, data, expected):
    message = _checkpoint(tmp_path, _write(tmp_path / name, data))
    assert f"is not a torch checkpoint file: {expected}" in message and "weights=" not in message


def test_a_zip_archive_that_torch_did_not_write(tmp_path):
    with zipfile.ZipFile(tmp_path / "bundle.pt", "w") as archive:
        archive.writestr("readme.txt", "not a model")
    message = _checkpoint(tmp_path, tmp_path / "bundle.pt")
    assert "is not a torch checkpoint file: it is a zip archive without a data.pkl" in message


@pytest.mark.parametrize("keep", [0.5, 0.1, 0.999])
def test_a_truncated_last_pt(tmp_path, last_pt, keep):
    data = last_pt.read_bytes()
    path = _write(tmp_path / "last.pt", data[: int(len(data) * keep)])
    message = _checkpoint(tmp_path, path)
    assert "is truncated or corrupt (the file ends early / zip archive incomplete: no valid end-of-central-directory " \
           f"record in its {path.stat().st_size:,} bytes)" in message
    assert "weights=" not in message and "copy it again" in message


def test_a_truncated_legacy_format_file(tmp_path):
    torch.save({"w": torch.zeros(64)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    data = (tmp_path / "legacy.pt").read_bytes()
    path = _write(tmp_path / "legacy_half.pt", data[: len(data) // 2])
    message = _checkpoint(tmp_path, path)
    assert "is truncated or corrupt (the file ends early (torch's legacy (pre-1.6) format))" in message
    assert "weights=" not in message


def test_damaged_tensor_bytes_fail_the_crc_check(tmp_path, last_pt):
    # torch.load does not check CRCs: without the check this checkpoint would be evaluated with a wrong weight
    ckpt = load_checkpoint(last_pt)
    ckpt["model"]["head.weight"].fill_(7.0)
    damaged = tmp_path / "damaged.pt"
    torch.save(ckpt, damaged)
    data = bytearray(damaged.read_bytes())
    at = data.find(np.full(16, 7.0, dtype=np.float32).tobytes())
    assert at > 0
    data[at:at + 4] = np.float32(-1.0).tobytes()
    damaged.write_bytes(bytes(data))
    assert torch.load(damaged, weights_only=True)["model"]["head.weight"].min() == -1.0  # torch itself loads it
    message = _checkpoint(tmp_path, damaged)
    assert "is truncated or corrupt (zip member" in message and "fails its CRC check" in message


@pytest.mark.parametrize("wrap", [False, True])
def test_a_plain_state_dict_suggests_weights(tmp_path, last_pt, wrap):
    state = load_checkpoint(last_pt)["model"]
    path = tmp_path / "weights.pt"
    torch.save({"state_dict": state, "epoch": 3} if wrap else state, path)
    message = _checkpoint(tmp_path, path)
    assert f"is a plain state_dict ({len(state)} tensors, e.g. 'cls_token', and no train.py config): pass it as " \
           f"weights={path} with model=<timm name> attention=<name>" in message


@pytest.mark.parametrize("obj, expected", [
    ({"format": "other-checkpoint-v2", "weights": torch.zeros(2)}, "format 'other-checkpoint-v2', not "
                                                                   "'quest-checkpoint-v1'"),
    # a DeiT-style training checkpoint: the model's state_dict among optimizer state and arguments
    ({"model": {"w": torch.zeros(2)}, "optimizer": {}, "lr_scheduler": {}, "epoch": 3},
     "a dict with keys ['model', 'optimizer', 'lr_scheduler', 'epoch'] and no 'format': 'quest-checkpoint-v1'"),
    (torch.zeros(3), "a torch.Tensor, not a dict"),
    ([torch.zeros(3)], "a builtins.list, not a dict"),
])
def test_a_torch_file_of_another_kind(tmp_path, obj, expected):
    torch.save(obj, tmp_path / "other.pt")
    message = _checkpoint(tmp_path, tmp_path / "other.pt")
    assert f"is a torch file of another kind ({expected})" in message and "weights=" not in message


def test_a_pickled_module_is_refused_as_unsafe(tmp_path):
    torch.save(nn.Linear(2, 2), tmp_path / "module.pt")
    message = _checkpoint(tmp_path, tmp_path / "module.pt")
    assert "cannot be loaded safely: it holds pickled Python objects (torch.nn.modules.linear.Linear), e.g. a whole " \
           "model saved with torch.save(model)" in message and "weights=" not in message


@pytest.mark.parametrize("obj", ["module", "state_dict"])
def test_a_file_pickled_with_protocol_4_is_refused_naming_the_protocol_in_quests_line_alone(tmp_path, recwarn, obj):
    # torch.load warns about the protocol before it refuses the file, whose first instruction (FRAME) its weights-only
    # reader does not know, whatever the file holds: the refusal names the protocol, not pickled objects
    torch.save(nn.Linear(2, 2) if obj == "module" else {"w": torch.ones(2)}, tmp_path / "p4.pt", pickle_protocol=4)
    message = _checkpoint(tmp_path, tmp_path / "p4.pt")
    assert "cannot be loaded safely: it was written with a pickle protocol above 3" in message
    assert "opcode 149" in message and "pickled Python objects" not in message
    assert [str(w.message) for w in recwarn if issubclass(w.category, UserWarning)] == []


@pytest.mark.parametrize("device", [False, True])  # the reader's two loads: the inspection's, then another device's
def test_a_checkpoint_pickled_with_another_protocol_loads_without_torchs_warning(tmp_path, last_pt, recwarn, device):
    torch.save(load_checkpoint(last_pt), tmp_path / "p3.pt", pickle_protocol=3)  # one torch.load reads, and warns of
    map_location = (lambda storage, _: storage) if device else "cpu"  # not "cpu": load_record loads it again
    assert load_record(tmp_path / "p3.pt", map_location=map_location).to_dict()["format"] == "quest-checkpoint-v1"
    assert [str(w.message) for w in recwarn if issubclass(w.category, UserWarning)] == []


def test_only_the_pickle_protocol_warning_is_silenced(tmp_path, monkeypatch):
    torch.save({"w": torch.zeros(2)}, tmp_path / "state.pt")
    real_load = torch.load

    def load(*args, **kwargs):
        warnings.warn("Detected pickle protocol 4 in the checkpoint, which was not the default", UserWarning)
        warnings.warn("another warning torch may give", UserWarning)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", load)
    with pytest.warns(UserWarning) as record:
        assert inspect_torch_file(tmp_path / "state.pt").kind == "state_dict"
    assert [str(w.message) for w in record] == ["another warning torch may give"]


def test_a_directory_names_the_checkpoints_inside(tmp_path, last_pt):
    run_dir = last_pt.parents[1]
    message = _refusal(tmp_path, f"checkpoint={run_dir}", error=IsADirectoryError)
    assert f"checkpoint={run_dir} is a directory" in message and str(last_pt) in message


def test_a_real_checkpoint_is_classified_as_one(last_pt):
    found = inspect_torch_file(last_pt)
    assert found.kind == "quest_checkpoint" and found.obj["format"] == "quest-checkpoint-v1"


@pytest.mark.parametrize("case", ["truncated", "text", "checkpoint", "module"])
def test_weights_files_get_the_same_diagnosis(tmp_path, last_pt, case):
    path = tmp_path / f"{case}.pt"
    if case == "truncated":
        torch.save(load_checkpoint(last_pt)["model"], path)
        _write(path, path.read_bytes()[:1000])
    elif case == "text":
        _write(path, b"not weights")
    elif case == "checkpoint":
        path = last_pt
    else:
        torch.save(nn.Linear(2, 2), path)
    message = _refusal(tmp_path, "model=vit_pico", "attention=quest", "data=digits", f"weights={path}")
    expected = {"truncated": "is truncated or corrupt (the file ends early / zip archive incomplete",
                "text": "is not a torch checkpoint file: it looks like a text file",
                "checkpoint": f"is a quest checkpoint: pass checkpoint={path} instead of weights=",
                "module": "cannot be loaded safely: it holds pickled Python objects"}[case]
    assert f"weights={path} {expected}" in message
