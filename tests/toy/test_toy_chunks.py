"""The toy study's chunk files (quest.toy.chunks), read back as untrusted. Every field of a chunk and of each of its
rows damaged in each way (a wrong type, out of its declared range, in range but not what the config the chunk is for
trained, missing, unknown) is refused naming the file and the field; a file that is no chunk at all is refused naming
the file; and a study whose folder holds such a chunk, one its manifest believes, is refused before it changes
anything. A diverged run's NaN or infinite loss and an empty token group's NaN key norm are results, not damage."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import pickle
import shutil

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from quest.store.damage import DamagedFile
from quest.toy.batched import ChunkResult
from quest.toy.chunks import ChunkRecord, ChunkRow, ChunkTask, chunk_of, grid_runs, read_chunk
from quest.toy.config import register_toy_config
from quest.toy.study import run_study

from ..helpers import CONFIGS
from ..record_faults import faults, planted
from ..tree_state import tree_state

# a sensitivity chunk (two extra test sets) of 2 lrs x 1 weight decay x 2 initialisations, 2 epochs, a probe
CFG = {"grid": {"lrs": [0.01, 0.02], "weight_decays": [0.0], "init_seeds": [0, 1]}, "train": {"epochs": 2},
       "probe_size": 8}
RUNS = grid_runs(CFG["grid"])
TASK = ChunkTask(name="quest", spec={}, data={"train_size": 64}, tests=(0.0, 0.5), data_seed=3, path="",
                 fingerprint="0123456789abcdef")


def _good() -> dict:
    """A chunk as the study writes it, with a diverged run (NaN and infinite losses) and an empty token group."""
    norms = torch.rand(len(RUNS), 3, 3)
    norms[:, :, 0] = float("nan")  # no biased answer token in the probe
    accs = {"test": torch.tensor([0.25, 0.5, 0.75, 1.0]), "test_acc_b0": torch.tensor([0.0, 0.5, 0.5, 0.125]),
            "test_acc_b0.5": torch.tensor([0.5, 0.5, 1.0, 0.0])}
    res = ChunkResult(train_acc=torch.tensor([0.5, 0.0625, 1.0, 0.0]), test_acc=accs["test"], key_norms=norms,
                      final_loss=torch.tensor([2.3, float("nan"), 0.01, float("inf")]), weights={}, test_accs=accs,
                      seconds={"steps": 1.0, "probe": 0.1, "eval": 0.2})
    return chunk_of(TASK, RUNS, res, 1.5)


def _read(tmp_path, chunk) -> dict:
    path = tmp_path / "quest-data3.pt"
    torch.save(chunk, path)
    return read_chunk(dataclasses.replace(TASK, path=str(path)), CFG)


def _refused(tmp_path, chunk, field: str) -> DamagedFile:
    with pytest.raises(DamagedFile) as caught:
        _read(tmp_path, chunk)
    assert caught.value.path == tmp_path / "quest-data3.pt" and str(tmp_path / "quest-data3.pt") in str(caught.value)
    assert field in caught.value.problem, caught.value
    assert "\n" not in str(caught.value)
    return caught.value


def test_a_good_chunk_reads_back_as_written_its_diverged_runs_included(tmp_path):
    good = _good()
    read = _read(tmp_path, good)
    assert [r["final_train_loss"] for r in read["rows"]] == [2.3, "nan", 0.01, "inf"]
    assert [{**r, "final_train_loss": 0} for r in read["rows"]] == [{**r, "final_train_loss": 0} for r in good["rows"]]
    assert set(read["rows"][0]) == {"attention", "lr", "weight_decay", "data_seed", "init_seed", "train_size",
                                    "train_acc", "test_acc", "test_acc_b0", "test_acc_b0.5", "final_train_loss"}
    torch.testing.assert_close(read["key_norms"], good["key_norms"], equal_nan=True)
    assert (read["fingerprint"], read["seconds"], read["phases"]) == (good["fingerprint"], 1.5, good["phases"])


def _is_nan(value) -> bool:
    return isinstance(value, float) and math.isnan(value)


# every declared field of the chunk (phases' nested ones too) and of a row, each value its declaration refuses; a
# NaN loss is a diverged run's, which a chunk holds
TOP = list(faults(ChunkRecord))
ROW = [(f, v) for f, v in faults(ChunkRow) if not (f == "final_train_loss" and _is_nan(v))]


@pytest.mark.parametrize("field, value", TOP, ids=[f"{f}={v!r}" for f, v in TOP])
def test_each_field_of_a_chunk_out_of_its_declaration_is_refused_naming_it(tmp_path, field, value):
    _refused(tmp_path, planted(_good(), field, value), field)


@pytest.mark.parametrize("row", [0, 3])
@pytest.mark.parametrize("field, value", ROW, ids=[f"{f}={v!r}" for f, v in ROW])
def test_each_field_of_a_row_out_of_its_declaration_is_refused_naming_it(tmp_path, row, field, value):
    chunk = _good()
    chunk["rows"][row][field] = value
    _refused(tmp_path, chunk, f"rows[{row}].{field}")


# in range, but not what the config the chunk is for trained: each identity of a row, for the first and last run
OTHER = {"attention": "standard", "lr": 0.5, "weight_decay": 0.25, "data_seed": 4, "init_seed": 7, "train_size": 65}


@pytest.mark.parametrize("row", [0, 3])
@pytest.mark.parametrize("field", OTHER)
def test_a_row_of_another_run_formulation_data_or_size_is_refused_naming_its_field(tmp_path, row, field):
    chunk = _good()
    chunk["rows"][row][field] = OTHER[field]
    _refused(tmp_path, chunk, f"rows[{row}].{field}")


def _at(chunk: dict, path: tuple):
    """The mapping or list holding ``path``'s last key, and that key."""
    *parents, last = path
    for key in parents:
        chunk = chunk[key]
    return chunk, last


def _set(path: tuple, value):
    def change(chunk: dict) -> None:
        node, key = _at(chunk, path)
        node[key] = value
    return change


def _drop(path: tuple):
    def change(chunk: dict) -> None:
        node, key = _at(chunk, path)
        del node[key]
    return change


DAMAGE = {  # what is changed -> (the change, the field the refusal names)
    "rows x1000": (lambda c: c.update(rows=c["rows"] * 1000), "rows holds 4000 runs, expected 4"),
    "a row fewer": (lambda c: c["rows"].pop(), "rows holds 3 runs, expected 4"),
    "no rows": (lambda c: c["rows"].clear(), "rows holds 0 runs"),
    "rows swapped": (lambda c: c["rows"].reverse(), "rows[0]."),
    "an extra accuracy above 1": (_set(("rows", 2, "test_acc_b0.5"), 1.5), "rows[2].test_acc_b0.5 is 1.5"),
    "an extra accuracy below 0": (_set(("rows", 2, "test_acc_b0"), -0.25), "rows[2].test_acc_b0 is -0.25"),
    "an extra accuracy NaN": (_set(("rows", 2, "test_acc_b0"), float("nan")), "rows[2].test_acc_b0 is float nan"),
    "an extra accuracy a string": (_set(("rows", 2, "test_acc_b0"), "0.5"), "rows[2].test_acc_b0 is str"),
    "an unknown test set": (_set(("rows", 2, "test_acc_b0.25"), 0.5), "rows[2] holds test_acc_b0.25"),
    "a loss of -inf": (_set(("rows", 1, "final_train_loss"), -math.inf), "rows[1].final_train_loss is float -inf"),
    "a fingerprint of another form": (_set(("fingerprint",), "f629a948"), "fingerprint is str 'f629a948'"),
    "key norms of another shape": (_set(("key_norms",), torch.zeros(4, 2, 3)),
                                   "key_norms is a torch.float32 tensor of shape (4, 2, 3)"),
    "key norms of another run count": (_set(("key_norms",), torch.zeros(5, 3, 3)), "key_norms is a"),
    "integer key norms": (_set(("key_norms",), torch.zeros(4, 3, 3, dtype=torch.int64)), "key_norms is a torch.int64"),
    "a negative key norm": (_set(("key_norms",), -torch.ones(4, 3, 3)), "key_norms holds a negative value"),
    "an unknown key": (_set(("weights",), torch.zeros(1)), "it holds weights"),
    "an unknown phase": (_set(("phases", "compile"), 1.0), "phases holds compile"),
    **{f"no {key}": (_drop((key,)), f"it has no {key}") for key in ("fingerprint", "rows", "key_norms", "seconds", "phases")},
    **{f"no rows[1].{key}": (_drop(("rows", 1, key)), f"rows[1] has no {key}")
       for key in ("attention", "lr", "train_size", "train_acc", "test_acc", "test_acc_b0.5", "final_train_loss")},
    "no phases.eval": (_drop(("phases", "eval")), "phases has no eval"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_chunk_that_does_not_fit_its_config_or_record_is_refused_naming_the_field(tmp_path, damage):
    change, named = DAMAGE[damage]
    chunk = _good()
    change(chunk)
    _refused(tmp_path, chunk, named)


def test_a_chunk_of_another_config_is_refused_as_such(tmp_path):
    with pytest.raises(ValueError, match="holds results of a different toy config"):
        _read(tmp_path, {**_good(), "fingerprint": "fedcba9876543210"})


def _zip_cut(path):
    torch.save(_good(), path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _zip_flipped(path):
    torch.save(_good(), path)
    data = bytearray(path.read_bytes())
    data[data.index(b"fingerprint")] ^= 0xFF  # a byte of the pickle: the zip member's CRC no longer matches
    path.write_bytes(bytes(data))


NOT_CHUNKS = {
    "empty": lambda p: p.write_bytes(b""),
    "text": lambda p: p.write_text("rows: 4000\n"),
    "random bytes": lambda p: p.write_bytes(bytes(range(256)) * 8),
    "a pickle": lambda p: p.write_bytes(pickle.dumps(_good()["rows"])),
    "a cut file": _zip_cut,
    "a flipped byte": _zip_flipped,
    "a list": lambda p: torch.save([1, 2], p),
    "a state_dict": lambda p: torch.save({"w": torch.zeros(2)}, p),
    "a whole module": lambda p: torch.save(torch.nn.Linear(1, 1), p),
}


@pytest.mark.parametrize("kind", NOT_CHUNKS)
def test_a_file_that_is_no_chunk_is_refused_naming_it(tmp_path, kind):
    path = tmp_path / "quest-data3.pt"
    NOT_CHUNKS[kind](path)
    with pytest.raises(DamagedFile) as caught:
        read_chunk(dataclasses.replace(TASK, path=str(path)), CFG)
    assert caught.value.path == path and str(path) in str(caught.value) and "\n" not in str(caught.value)


# --- a study whose folder holds a damaged chunk of its own ---------------------------------------------------------


def _tiny(*overrides: str) -> dict:
    register_toy_config()
    with initialize_config_dir(config_dir=str(CONFIGS / "toy"), version_base="1.3"):
        cfg = compose(config_name="toy", overrides=[
            "grid=quick", "grid.lrs=[0.01]", "grid.weight_decays=[0.0,0.1]", "grid.data_seeds=[0]",
            "grid.init_seeds=[0,1]", "data.train_size=16", "data.test_size=16", "train.epochs=2", "probe_size=8",
            "workers=1", "compile=false", "attentions=[quest]", "device=cpu", *overrides])
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.fixture(scope="module")
def studied(tmp_path_factory):
    """A finished tiny study's folder (one chunk of 4 runs)."""
    out = tmp_path_factory.mktemp("toy") / "study"
    run_study(_tiny(), out)
    return out


def _believed(folder, path) -> None:
    """The folder's manifest entry of ``path`` rewritten to the file as it is now: the study takes it for its own."""
    name = str(path.relative_to(folder))
    lines = []
    for line in (folder / ".manifest.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry.get("path") == name:
            entry.update(size=path.stat().st_size, mtime_ns=path.stat().st_mtime_ns,
                         sha256=hashlib.sha256(path.read_bytes()).hexdigest())
        lines.append(json.dumps(entry))
    (folder / ".manifest.jsonl").write_text("\n".join(lines) + "\n")


STUDY_DAMAGE = {  # the probe's damages, each in a chunk the manifest believes
    "NaN accuracy": (lambda c: c["rows"][0].update(train_acc=float("nan")), "rows[0].train_acc"),
    "rows x1000": (lambda c: c.update(rows=c["rows"] * 1000), "rows holds 4000 runs"),
    "negative seconds": (lambda c: c.update(seconds=-1e30), "seconds is -1e+30"),
    "string accuracy": (lambda c: c["rows"][1].update(train_acc="0.5"), "rows[1].train_acc"),
    "no rows": (lambda c: c.pop("rows"), "it has no rows"),
    "accuracy 5": (lambda c: c["rows"][2].update(test_acc=5.0), "rows[2].test_acc"),
    "garbage": (None, "not a chunk of the toy study"),
}


@pytest.mark.parametrize("damage", STUDY_DAMAGE)
def test_a_study_refuses_a_damaged_chunk_of_its_own_before_any_change(tmp_path, studied, damage):
    change, named = STUDY_DAMAGE[damage]
    folder = tmp_path / "study"
    shutil.copytree(studied, folder)
    chunk = folder / "chunks" / "quest-data0.pt"
    if change is None:
        chunk.write_bytes(b"\x00garbage" * 100)
    else:
        data = torch.load(chunk, weights_only=True)
        change(data)
        torch.save(data, chunk)
    _believed(folder, chunk)
    before = tree_state(folder)
    with pytest.raises(DamagedFile) as caught:
        run_study(_tiny(), folder)
    assert caught.value.path == chunk and named in str(caught.value)
    assert tree_state(folder) == before


def test_the_undamaged_study_reruns_from_its_chunks(tmp_path, studied):
    folder = tmp_path / "study"
    shutil.copytree(studied, folder)
    result = run_study(_tiny(), folder)
    assert len(result["rows"]) == 4
