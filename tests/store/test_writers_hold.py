"""What a command may remove (docs/training.md): every writing command x a foreign file in each place it writes.

A file the command did not write, in the place of one of its outputs, is refused (the message names it, and the
folder is byte for byte as it was) or moved to ``.replaced/<UTC time>[-label]/`` under the same path with its bytes;
which of the two is fixed per command and place. Never lost. The places where it is kept aside are here; the places
where it is refused, and every command refused while another process holds its folder, are rows of the refusal
contract (tests/runtime/test_refusal_contract.py). Here too: what an overwrite keeps, the temporaries training
removes, a figure's lock beside it, and a lock file removed by its holder as it lets go.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from PIL import Image

from quest.evaluation import register_eval_configs, run_evaluation
from quest.report.__main__ import main as report_main
from quest.report.plot import main as plot_main
from quest.runtime.errors import EXIT_ERROR, reporting_errors
from quest.store.locks import lock_file
from quest.store.tree import REPLACED
from quest.tools.capped import cap_folder
from quest.tools.export import main as export_main
from quest.tools.make_shards import convert_image_folder, write_index
from quest.train import fit

from ..helpers import CONFIGS, FAST, compose_cfg, eval_cfg
from ..tree_state import tree_state
from .test_move_aside import refuse_moving

register_eval_configs()

FOREIGN = b'{"somebody": "else\'s file"}\n'  # valid JSON: refused or kept for what it is, not for being garbage
HOLDER = b"pid 4242 on elsewhere\n"




def _kept(root: Path) -> dict[str, bytes]:
    """What ``root/.replaced/`` holds: path under its ``<UTC time>[-label]/`` -> bytes."""
    return {"/".join(p.relative_to(root / REPLACED).parts[1:]): p.read_bytes()
            for p in (root / REPLACED).rglob("*") if p.is_file()}


def _call(command: Callable[[], object]) -> tuple[bool, str]:
    """(whether the command succeeded, what it said: its exception's message or its standard error)."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            code = command()
    except (ValueError, OSError, RuntimeError) as exc:
        return False, str(exc)
    return not isinstance(code, int) or code == 0, err.getvalue()  # a main's exit status, or a function's result


def _image(path: Path, size: tuple[int, int], seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A trained run (export, report), a run with diagnostics (plot), an image folder (data tools)."""
    root = tmp_path_factory.mktemp("inputs")
    run = root / "sweep" / "run"
    fit(compose_cfg(*FAST, "trainer.max_steps=1"), run)
    src = root / "images"
    for split in ("train", "val"):
        _image(src / split / "c0/a.JPEG", (48, 40), 1)
        _image(src / split / "c1/s.png", (20, 16), 2)
    return {"run": run, "images": src}


@dataclass(frozen=True)
class Writer:
    """A writing command: ``run(inputs, folder, overwrite)`` runs it into ``folder`` (in process), which it holds;
    ``first``: run once before the foreign file is placed (a rerun's case); ``prepare``: what the folder holds
    before (the shards an index counts)."""

    name: str
    run: Callable[[dict[str, Path], Path, bool], object]
    first: bool = False
    prepare: Callable[[dict[str, Path], Path], None] | None = None


def _export(i, out, overwrite):
    return export_main([str(i["run"]), "--out", str(out), *(["--overwrite"] if overwrite else [])])


def _report(i, out, overwrite):
    return report_main([str(i["run"].parent), "--out", str(out), *(["--overwrite"] if overwrite else [])])


def _plot(i, out, overwrite):
    return plot_main(["perf", str(i["run"]), "--out", str(out / "fig.png"), *(["--overwrite"] if overwrite else [])])


def _cap(i, out, overwrite):
    return cap_folder(i["images"], out, 32)


def _convert(i, out, overwrite):
    return convert_image_folder(i["images"], out, [("train", "train"), ("val", "val")], name="toy", shard_size=1)


def _shards(i, out):
    made = out.parent / "made"
    _convert(i, made, False)
    out.mkdir(parents=True)
    for shard in made.glob("*.tar"):
        (out / shard.name).write_bytes(shard.read_bytes())


def _index(i, out, overwrite):
    return write_index(out, {"train": "toy-train-*.tar"})


def _toy(i, out, overwrite):
    from quest.toy.config import register_toy_config
    from quest.toy.study import run_study

    register_toy_config()
    with initialize_config_dir(config_dir=str(CONFIGS / "toy"), version_base="1.3"):
        cfg = compose(config_name="toy", overrides=[
            "grid=quick", "grid.lrs=[0.01]", "grid.weight_decays=[0.0]", "grid.data_seeds=[0]", "grid.init_seeds=[0]",
            "data.train_size=16", "data.test_size=16", "train.epochs=1", "probe_size=8", "workers=1", "compile=false",
            "attentions=[standard]", "device=cpu"])
    return run_study(OmegaConf.to_container(cfg, resolve=True), out)


def _eval(i, out, overwrite):
    return run_evaluation(eval_cfg(f"checkpoint={i['run'] / 'checkpoints' / 'last.pt'}", "eval=clean",
                                   "eval.clean.max_samples=40"), out)


def _tensorboard(i, out, overwrite):
    return fit(compose_cfg(*FAST, "trainer.max_steps=1", "logger=tensorboard"), out)


WRITERS = {w.name: w for w in [
    Writer("quest-export", _export), Writer("quest-report", _report), Writer("quest-plot", _plot),
    Writer("quest-data cap (rerun)", _cap, first=True), Writer("make_shards convert (rerun)", _convert, first=True),
    Writer("make_shards index", _index, prepare=_shards),
    Writer("quest-toy", _toy), Writer("quest-toy (rerun)", _toy, first=True),
    Writer("quest-train tensorboard", _tensorboard),
    Writer("quest-eval", _eval),
]}

# (command, the place a foreign file takes, whether it runs with --overwrite): the file is kept aside
PLACES = [
    *[("quest-export", p, True) for p in ("model.safetensors", "config.json", "README.md")],
    *[("quest-report", p, True) for p in ("runs.md", "runs.csv")],
    ("quest-plot", "fig.png", True),
    *[("quest-data cap (rerun)", p, False) for p in ("train/c0/a.JPEG", "train/c1/s.png", "train/c0/x.txt")],
    ("make_shards convert (rerun)", "toy-train-0001.tar", False),
    ("make_shards index", "_info.json", False),
    *[("quest-toy", p, False) for p in ("runs.csv", "study.json", "key_norms.pt", "success_heatmaps.png",
                                        "chunks/standard-data0.pt")],
    *[("quest-toy (rerun)", p, False) for p in ("success_rates.csv", "chunks/standard-data0.pt")],
    ("quest-train tensorboard", "tensorboard/events.out.tfevents.1.elsewhere.1.0", False),
    *[("quest-eval", p, False) for p in ("eval_results.md", "eval_results.csv", "eval.log")],
]


@pytest.mark.parametrize(("name", "place", "overwrite"), PLACES,
                         ids=[f"{n}:{p}:{'overwrite' if o else 'kept'}" for n, p, o in PLACES])
def test_a_file_the_command_did_not_write_is_kept_never_lost(inputs, tmp_path, name, place, overwrite):
    writer, folder = WRITERS[name], tmp_path / "out"
    if writer.prepare:
        writer.prepare(inputs, folder)
    if writer.first:
        assert _call(lambda: writer.run(inputs, folder, False))[0]
    target = folder / place
    target.parent.mkdir(parents=True, exist_ok=True)
    target.unlink(missing_ok=True)
    target.write_bytes(FOREIGN)
    ok, said = _call(lambda: writer.run(inputs, folder, overwrite))
    assert ok, said
    kept = _kept(folder)
    assert kept.get(place) == FOREIGN, sorted(kept)  # the same path under .replaced/<time>/, the same bytes
    assert not target.exists() or target.read_bytes() != FOREIGN  # the command's own output in its place


def test_an_export_rerun_with_overwrite_keeps_the_previous_export(inputs, tmp_path):
    out = tmp_path / "out"
    assert export_main([str(inputs["run"]), "--out", str(out)]) == 0
    first = {p: (out / p).read_bytes() for p in ("model.safetensors", "config.json", "README.md")}
    assert export_main([str(inputs["run"]), "--out", str(out), "--overwrite"]) == 0
    assert {p: _kept(out)[p] for p in first} == first
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).digest() == \
        hashlib.sha256(first["model.safetensors"]).digest()  # the same run: the same weights, written again


def test_an_export_over_a_file_that_cannot_be_moved_aside_changes_nothing(inputs, tmp_path, monkeypatch, capsys):
    """quest-export --overwrite where config.json cannot be moved (chattr +i): model.safetensors, moved before it,
    is put back, .replaced/ holds nothing new, and the refusal is one line (quest.store.tree.move_aside)."""
    out = tmp_path / "out"
    assert export_main([str(inputs["run"]), "--out", str(out)]) == 0
    before = tree_state(out)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # tests/conftest.py's: the line as a user sees it
    refuse_moving(monkeypatch, out / "config.json", unlink=True)
    with pytest.raises(SystemExit) as exit_, reporting_errors("quest-export"):
        export_main([str(inputs["run"]), "--out", str(out), "--overwrite"])
    monkeypatch.undo()
    assert exit_.value.code == EXIT_ERROR and tree_state(out) == before
    assert capsys.readouterr().err == (f"quest-export: error: cannot replace {out / 'config.json'}: it could not be "
                                       f"moved into {out / REPLACED} (Operation not permitted); nothing was replaced\n")


def test_training_removes_only_the_temporaries_its_own_writes_name(tmp_path):
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir(parents=True)
    (ckpt / ".last.pt.x1y2.tmp").write_bytes(b"half a checkpoint")  # what a killed save of last.pt leaves
    (ckpt / ".notes.tmp").write_bytes(FOREIGN)  # hidden and .tmp, but no name quest's writes give
    fit(compose_cfg(*FAST, "trainer.max_steps=1"), tmp_path)
    assert not (ckpt / ".last.pt.x1y2.tmp").exists()
    assert (ckpt / ".notes.tmp").read_bytes() == FOREIGN


def test_a_figure_leaves_its_folder_holding_the_figure_alone(inputs, tmp_path):
    """quest-plot holds the figure, not the folder (often the user's working directory): its lock file beside it
    goes at the end, no record is kept, and another figure is drawn into the same folder while one is held."""
    fd = lock_file(tmp_path / ".other.png.lock", "another figure being drawn")
    try:
        assert _plot(inputs, tmp_path, False) == 0
    finally:
        os.close(fd)
    (tmp_path / ".other.png.lock").unlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fig.png"]


def test_a_lock_file_removed_by_its_holder_as_it_lets_go_is_not_taken(tmp_path, monkeypatch):
    """The holder of one output's lock removes the file while still holding it and then lets go: a process that
    opened the file just before locks it just after, and must then find that the file at the path is another (or
    none), or two processes would hold one output (the second on the removed file, a third on a new one)."""
    path = tmp_path / ".fig.png.lock"
    path.write_bytes(HOLDER)
    real = fcntl.flock
    calls = []

    def holder_lets_go_first(fd, op):
        if not calls:
            path.unlink()  # between this process's open and its flock
        calls.append(op)
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", holder_lets_go_first)
    fd = lock_file(path, "the figure")
    try:
        assert len(calls) == 2  # the removed file was let go and the path opened again
        assert os.fstat(fd).st_ino == os.stat(path).st_ino  # the file at the path is the one held
    finally:
        os.close(fd)
