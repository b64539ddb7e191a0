"""quest-export exports the weights the user expects: by default the trained model's, the ones the run's val/top1
was measured on; the command and the model card say which weights and their top-1, every metric labelled with the
weights it belongs to; a run that has not finished, diverged or failed on its data is refused, naming its status,
unless --allow-unfinished."""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from quest.run.checkpoint import load_record
from quest.tools.export import export_run
from quest.tools.export import main as export_main
from tests.interop_helpers import make_image_folder, train_tiny_run


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("export_weights")
    return train_tiny_run(make_image_folder(base / "data"), base / "run")


def _copy(run: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(run, tmp_path / "run"))


@pytest.mark.parametrize("weights,field,top1_key", [("model", "model", "val/top1"), ("ema", "ema", "val_ema/top1")])
def test_the_exported_weights_are_named_with_their_top1(finished_run, tmp_path, capsys, weights, field, top1_key):
    summary = json.loads((finished_run / "summary.json").read_text())
    args = [str(finished_run), "--out", str(tmp_path / "out")] + (["--weights", weights] if weights != "model" else [])
    assert export_main(args) == 0  # model: the default
    line = capsys.readouterr().out
    assert f"({weights} weights, validation top-1 {summary[top1_key]:.2f}%)" in line, line
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quest"]["weights"] == weights and config["quest"]["val_top1"] == summary[top1_key]
    assert config["quest"]["run_status"] == "completed"
    stored = getattr(load_record(finished_run / "checkpoints" / "last.pt"), field)
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert exported.keys() == stored.keys() and all(torch.equal(exported[k], stored[k]) for k in stored)
    card = (tmp_path / "out" / "README.md").read_text()
    assert f"holds the {weights} weights of step {summary['step']}: validation top-1 {summary[top1_key]:.2f}%" in card
    # every metric row says what it was measured on
    assert f"| val/top1 | model, last step | {summary['val/top1']}" in card
    assert f"| val_ema/top1 | EMA, last step | {summary['val_ema/top1']}" in card
    assert f"| best/val/top1 | model at epoch {summary['best_epoch']} (best.pt) |" in card


@pytest.mark.parametrize("status", ["diverged", "bad_data", "interrupted", "requeued", None])
def test_a_run_that_did_not_finish_is_refused_naming_its_status_unless_asked(finished_run, tmp_path, capsys, status):
    run = _copy(finished_run, tmp_path)
    if status is None:
        (run / "summary.json").unlink()
        named = "there is no summary.json beside"
    else:
        summary = json.loads((run / "summary.json").read_text())
        (run / "summary.json").write_text(json.dumps({**summary, "status": status}))
        named = f"the run's status is {status}"
    assert export_main([str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert named in err and "--allow-unfinished" in err and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()  # refused before any work
    assert export_main([str(run), "--out", str(tmp_path / "out"), "--allow-unfinished"]) == 0
    assert f"not measured on the validation set; unfinished: {named}" in capsys.readouterr().out
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quest"]["val_top1"] is None and config["quest"]["run_status"] == status
    assert "the run did not measure them on its validation set" in (tmp_path / "out" / "README.md").read_text()


def test_a_run_continued_after_its_summary_is_unfinished(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "step": summary["step"] - 1}))
    with pytest.raises(ValueError, match=rf"says completed at step {summary['step'] - 1}, but last.pt holds step "
                                         rf"{summary['step']}"):
        export_run(run, tmp_path / "out")


def test_best_pt_is_the_best_epochs_model(finished_run, tmp_path):
    summary = json.loads((finished_run / "summary.json").read_text())
    out = export_run(finished_run / "checkpoints" / "best.pt", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["quest"]["val_top1"] == summary["best/val/top1"]


def test_an_import_path_in_the_checkpoint_is_never_imported_unless_trusted(finished_run, tmp_path, monkeypatch):
    """A checkpoint is data: an attention named by import path is refused before its module is imported (that
    module, on the path, would leave a mark), unless --trust-code, which imports it."""
    mark = tmp_path / "imported"
    (tmp_path / "quest_export_probe_mod.py").write_text(f"open({str(mark)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    run = _copy(finished_run, tmp_path)
    last = run / "checkpoints" / "last.pt"
    ckpt = torch.load(last, weights_only=True)
    ckpt["config"]["attention"]["name"] = ckpt["meta"]["attention"] = "quest_export_probe_mod:Attention"
    torch.save(ckpt, last)
    with pytest.raises(ValueError, match=r"attention.name='quest_export_probe_mod:Attention', an import path.*"
                                         r"--trust-code"):
        export_run(run, tmp_path / "out")
    assert not mark.exists() and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="quest_export_probe_mod"):  # trusted: imported, then found no attention
        export_run(run, tmp_path / "out", trust_code=True)
    assert mark.exists()


@pytest.mark.parametrize("kind, says", [
    ("text", "is not a torch checkpoint file: it looks like a text file"),
    ("pickle", "is not a torch checkpoint file: it is a Python pickle"),
    ("module", "cannot be loaded safely: it holds pickled Python objects"),
    ("cut", "is truncated or corrupt"),
])
def test_a_file_that_is_no_checkpoint_is_named_with_what_it_is(finished_run, tmp_path, kind, says):
    """quest-export reads a checkpoint as every reader does (quest.run.checkpoint.load_record): one line saying
    which case the file is, as eval.py's checkpoint= does, not torch's own message."""
    import pickle

    path = tmp_path / f"{kind}.pt"
    if kind == "text":
        path.write_text("hello\n")
    elif kind == "pickle":
        path.write_bytes(pickle.dumps({"a": 1}))
    elif kind == "module":
        torch.save(torch.nn.Linear(2, 2), path)
    else:
        path.write_bytes((finished_run / "checkpoints" / "last.pt").read_bytes()[:100_000])
    with pytest.raises(ValueError) as refused:
        export_run(path, tmp_path / "out")
    assert str(refused.value).startswith(f"{path} {says}") and "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("checkpoint, key", [("last.pt", "val/top1"), ("best.pt", "best/val/top1")])
def test_a_summary_whose_top1_the_checkpoint_did_not_record_is_refused(finished_run, tmp_path, checkpoint, key):
    """The model card's figure is the one the checkpoint recorded (its last validation row at its step, best.pt's
    best): a summary.json edited to a plausible 99 is refused, not claimed."""
    run = _copy(finished_run, tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    summary[key] = 99.0
    (run / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(ValueError, match=rf"says {re.escape(key)} 99, but .*{checkpoint} recorded"):
        export_run(run / "checkpoints" / checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_export_run_again_after_a_kill_ends_holding_its_files_alone(finished_run, tmp_path):
    """A kill -9 during an export leaves its lock file (its holder line) and the temporary of the write it cut; the
    next export into the folder removes both, so the folder holds what a fresh export holds. A lock file of another
    command's, or a temporary of another file's name, stays."""
    fresh = tmp_path / "fresh"
    assert export_main([str(finished_run), "--out", str(fresh)]) == 0
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").write_bytes(b"quest-export, pid 999999 on elsewhere\n")
    (out / ".model.safetensors.a_zd1sap.tmp").write_bytes(b"cut short")
    (out / ".notes.txt.x.tmp").write_bytes(b"somebody else's")
    assert export_main([str(finished_run), "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {p.name for p in fresh.iterdir()} | {".notes.txt.x.tmp"}
    other = tmp_path / "other"
    other.mkdir()
    (other / ".lock").write_bytes(b"my own lock file\n")
    assert export_main([str(finished_run), "--out", str(other)]) == 0
    assert ".lock" in os.listdir(other)  # not the export's: left, as every lock file is


def test_a_checkpoint_whose_metrics_text_is_not_json_lines_is_refused_naming_the_file_and_field(finished_run, tmp_path):
    run = _copy(finished_run, tmp_path)
    last = run / "checkpoints" / "last.pt"
    saved = torch.load(last, weights_only=True)
    saved["metrics_text"] = "xxxxx"
    torch.save(saved, last)
    with pytest.raises(ValueError, match=rf"{re.escape(str(last))}: metrics_text is not the metrics log it saw"):
        export_run(last, tmp_path / "out")
    assert not (tmp_path / "out").exists()
