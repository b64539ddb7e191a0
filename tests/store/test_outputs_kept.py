"""No file replaced silently (quest.store.files.keep_or_refuse): a command that writes into a folder refuses to replace what
it finds there, naming the files and the flag; with the flag the old files are kept in .replaced/<UTC time>/, and
files the command does not write are never touched."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quest.report.__main__ import main as report_main
from quest.store.files import OutputExists, keep_or_refuse
from quest.tools.export import export_run
from quest.tools.export import main as export_main
from quest.train import fit

from ..helpers import FAST, compose_cfg


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@given(existing=st.sets(st.sampled_from(["a.json", "b.md", "c.bin"])), other=st.booleans(),
       overwrite=st.booleans())
def test_keep_or_refuse_never_loses_a_file(tmp_path_factory, existing, other, overwrite):
    root = tmp_path_factory.mktemp("out")
    for name in existing:
        (root / name).write_text(f"old {name}")
    if other:
        (root / "notes.txt").write_text("the user's")
    before = _digest(root)
    targets = [root / n for n in ("a.json", "b.md", "c.bin")]
    if existing and not overwrite:
        with pytest.raises(OutputExists) as info:
            keep_or_refuse(targets, overwrite, keep_in=root)
        assert all(str(root / n) in str(info.value) for n in existing) and "--overwrite" in str(info.value)
        assert _digest(root) == before  # refused: nothing moved
        return
    kept = keep_or_refuse(targets, overwrite, keep_in=root)
    if not existing:
        assert kept is None and _digest(root) == before
        return
    # every old file is in .replaced/<time>/ with its content; the user's other file where it was
    assert {f"{kept.relative_to(root)}/{n}": h for n, h in before.items() if n in existing} == \
        {k: v for k, v in _digest(root).items() if k.startswith(".replaced/")}
    assert not any((root / n).exists() for n in existing)
    if other:
        assert (root / "notes.txt").read_text() == "the user's"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run") / "run"
    fit(compose_cfg(*FAST, "trainer.max_steps=1"), run_dir)
    return run_dir


def test_an_export_over_an_earlier_one_is_refused_and_kept_with_overwrite(run, tmp_path, capsys):
    out = tmp_path / "exported"
    export_run(run, out)
    (out / "notes.txt").write_text("the user's")
    first = _digest(out)
    assert export_main([str(run), "--out", str(out), "--weights", "model"]) == 2
    err = capsys.readouterr().err
    assert "model.safetensors" in err and "--overwrite" in err and _digest(out) == first
    assert export_main([str(run), "--out", str(out), "--weights", "model", "--overwrite"]) == 0
    (kept,) = (out / ".replaced").iterdir()
    assert {p.name: _digest(kept)[p.name] for p in kept.iterdir()} == {
        n: h for n, h in first.items() if n in ("model.safetensors", "config.json", "README.md")}
    assert (out / "notes.txt").read_text() == "the user's"
    assert json.loads((out / "config.json").read_text())["quest"]["weights"] == "model"  # the new export


def test_report_tables_are_not_replaced_without_overwrite(run, tmp_path):
    out = tmp_path / "tables"
    assert report_main([str(run.parent), "--out", str(out)]) == 0
    first = _digest(out)
    with pytest.raises(OutputExists, match="runs.md"):
        report_main([str(run.parent), "--out", str(out)])
    assert _digest(out) == first
    assert report_main([str(run.parent), "--out", str(out), "--overwrite"]) == 0
    assert len(list((out / ".replaced").iterdir())) == 1
