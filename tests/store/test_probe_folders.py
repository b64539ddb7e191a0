"""Cases from probing the commands as a hostile user would (issue 48): what a command reads of a folder it writes is
checked before it is believed, and a check comes before the first change. A damaged manifest (or the
``.written.json`` an older quest kept instead), a link or a
directory where the lock file belongs, a linked folder inside a capped copy, a checkpoint linked from another run, a
figure format matplotlib refuses, a resume onto a capped copy of the data: each refused (or resolved) before anything
changes, and nothing outside the folder is ever written."""
from __future__ import annotations

import json
import logging
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from quest.config.checks import ConfigError
from quest.report.plot import main as plot_main
from quest.run.checkpoint_record import CheckpointRecord
from quest.run.directory import check_data, data_fingerprint
from quest.run.outputs import start_log_file, stop_log_file
from quest.store.damage import DamagedFile
from quest.store.locks import lock_file
from quest.store.manifest import MANIFEST_NAME
from quest.store.old_manifests import OLD_RECORD
from quest.store.output_folder import holding, output_path
from quest.store.tool_records import CAPPED_INFO
from quest.tools.capped import cap_folder
from quest.tools.export import resolve_checkpoint, run_summary
from quest.tools.make_shards import convert_image_folder

from ..tree_state import tree_state

GOOD = {"by": "quest-export", "sha256": "0" * 64}


@pytest.mark.parametrize(("content", "named"), [
    ("[]", "JSON list"),
    ('{"files": 3', "not valid JSON"),
    ('{"files": []}', "files is list []"),
    (json.dumps({"files": {"../outside.txt": GOOD}}), "'../outside.txt'"),
    (json.dumps({"files": {"/etc/passwd": GOOD}}), "'/etc/passwd'"),
    (json.dumps({"files": {"a\u0000b": GOOD}}), "a path outside"),
    (json.dumps({"files": {"model.safetensors": "quest-export"}}), "files['model.safetensors'] is str"),
    (json.dumps({"files": {"x": {"by": 5}}}), "files.x.by is int 5"),
    (json.dumps({"files": {"x": {"sha256": "0" * 64}}}), "files.x has no by"),
    (json.dumps({"x": 1}), "no files"),
    (json.dumps({"files": {"x": {"by": "quest-export", "sha256": "zz"}}}), "64 hex digits"),
    (json.dumps({"files": {"x": {**GOOD, "keep": True}}}), "files.x holds keep"),
])
def test_a_damaged_older_record_is_refused_when_the_folder_is_held_and_nothing_changes(tmp_path, content, named):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / OLD_RECORD).write_text(content)
    (folder / "model.safetensors").write_bytes(b"weights")
    before = tree_state(folder)
    with pytest.raises(DamagedFile, match="Move it away") as caught:
        with holding(folder, "quest-export"):
            raise AssertionError("the block must not run: its first change would come before the refusal")
    assert named in str(caught.value) and str(folder / OLD_RECORD) in str(caught.value)
    assert tree_state(folder) == before  # the lock file the hold made is gone again


@pytest.mark.parametrize(("content", "named"), [
    ("", "empty"),
    ("[1]\n", "line 1: holds list"),
    ('{"files": {}}\n', "line 1: it holds files"),
    ('{"manifest": 1}\n{"path": "x", "by": "quest-export"\n{"path": "y", "by": "quest-export"}\n',
     "line 2 is not JSON"),
    ('{"manifest": 1}\n' + json.dumps({"path": "../outside.txt", "by": "quest-export"}) + "\n", "a path outside"),
    ('{"manifest": 1}\n' + json.dumps({"path": "x", "by": "quest-export", "size": -1}) + "\n", "size is -1"),
])
def test_a_damaged_manifest_is_refused_when_the_folder_is_held_and_nothing_changes(tmp_path, content, named):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / MANIFEST_NAME).write_text(content)
    before = tree_state(folder)
    with pytest.raises(DamagedFile, match="Move it away") as caught:
        with holding(folder, "quest-export"):
            raise AssertionError("the block must not run: its first change would come before the refusal")
    assert named in str(caught.value) and str(folder / MANIFEST_NAME) in str(caught.value)
    assert tree_state(folder) == before


@pytest.mark.parametrize("name", [MANIFEST_NAME, OLD_RECORD])
@pytest.mark.parametrize("kind", ["directory", "link"])
def test_a_record_that_is_not_a_plain_file_is_refused(tmp_path, kind, name):
    folder = tmp_path / "out"
    folder.mkdir()
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"files": {"x": GOOD}}))
    (folder / name).mkdir() if kind == "directory" else (folder / name).symlink_to(elsewhere)
    with pytest.raises(DamagedFile, match="symbolic link" if kind == "link" else "not a plain file"):
        with holding(folder, "quest-export"):
            pass


def test_what_note_writes_is_a_record_the_next_hold_believes(tmp_path):
    folder = tmp_path / "out"
    with holding(folder, "quest-export") as held:
        held.claim()
        (folder / "sub").mkdir()
        for name in ("a.md", "sub/b.csv", "log.txt"):
            (folder / name).write_text(name)
        held.manifest.note([folder / "a.md", folder / "sub/b.csv"])
        held.manifest.note([folder / "log.txt"], digest=False)
    with holding(folder, "quest-export") as held:
        assert sorted(held.manifest.entries) == ["a.md", "log.txt", "sub/b.csv"]
        assert held.manifest.owns(folder / "sub/b.csv") and held.manifest.owns(folder / "log.txt")
        assert held.manifest.entries["a.md"].size == 4 and held.manifest.entries["log.txt"].size is None


@pytest.mark.parametrize("dangling", [False, True])
def test_a_lock_file_that_is_a_link_is_refused_and_never_written_through(tmp_path, dangling):
    folder, target = tmp_path / "out", tmp_path / "notes.txt"
    folder.mkdir()
    if not dangling:
        target.write_text("somebody's notes")
    (folder / ".lock").symlink_to(target)
    with pytest.raises(DamagedFile, match="a symbolic link to .*notes.txt"):
        with holding(folder, "quest-export"):
            pass
    assert (target.read_text() == "somebody's notes") if not dangling else not target.exists()
    assert (folder / ".lock").is_symlink()  # left as it was, for its owner to look at


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_a_lock_file_that_is_a_directory_or_a_fifo_is_refused_naming_it(tmp_path, kind):
    path = tmp_path / ".lock"
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    with pytest.raises(DamagedFile, match=r"\.lock is damaged: a (directory or )?special file"):
        lock_file(path, "this folder")


def _images(root: Path) -> Path:
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / "train" / c).mkdir(parents=True)
        for i in range(2):
            Image.fromarray(rng.integers(0, 255, (40, 48, 3), dtype=np.uint8)).save(root / "train" / c / f"{i}.jpg")
    return root


def test_cap_refuses_a_class_folder_linked_elsewhere_before_any_change(tmp_path):
    src, dst = _images(tmp_path / "src"), tmp_path / "capped"
    cap_folder(src, dst, 16)
    theirs = tmp_path / "theirs"  # somebody's folder, linked in place of the copy's class folder
    theirs.mkdir()
    (theirs / "0.jpg").write_bytes(b"their image")
    for name in os.listdir(dst / "train" / "cat"):
        (dst / "train" / "cat" / name).unlink()
    (dst / "train" / "cat").rmdir()
    (dst / "train" / "cat").symlink_to(theirs)
    os.utime(src / "train" / "cat" / "0.jpg", ns=(1, 1))  # a changed source: the rerun would redo cat/0.jpg
    before, theirs_before = tree_state(dst), tree_state(theirs)
    with pytest.raises(ValueError, match=r"through the link .*train/cat -> .*theirs"):
        cap_folder(src, dst, 16)
    assert tree_state(dst) == before and tree_state(theirs) == theirs_before


def test_a_checkpoint_linked_from_another_run_is_exported_with_that_runs_summary(tmp_path):
    runs = {}
    for name, top1 in (("mine", 10.0), ("other", 55.0)):
        run = tmp_path / name
        (run / "checkpoints").mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({"status": "completed", "val/top1": top1}))
        runs[name] = run
    (runs["other"] / "checkpoints" / "last.pt").write_bytes(b"weights")
    (runs["mine"] / "checkpoints" / "last.pt").symlink_to(runs["other"] / "checkpoints" / "last.pt")
    for source in (runs["mine"], runs["mine"] / "checkpoints" / "last.pt"):
        path = resolve_checkpoint(source)
        assert path == (runs["other"] / "checkpoints" / "last.pt").resolve()
        assert run_summary(path)["val/top1"] == 55.0  # the weights' own run, not the link's


def test_a_figure_format_matplotlib_refuses_moves_no_earlier_file_aside(tmp_path, capsys):
    """--out perf.txt: refused with the arguments (exit 2, naming the formats), the earlier file left in place."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "perf/data_wait": 0.1, "perf/img_per_s_per_device": 100.0 + s}) + "\n" for s in range(1, 4)))
    out = tmp_path / "figs" / "perf.txt"
    out.parent.mkdir()
    out.write_text("my notes")
    before = tree_state(out.parent)
    with pytest.raises(SystemExit) as exited:  # refused with the arguments, before any figure is drawn
        plot_main(["perf", str(run), "--out", str(out), "--overwrite"])
    assert exited.value.code == 2 and ".txt is not an image format matplotlib writes" in capsys.readouterr().err
    assert tree_state(out.parent) == before
    assert plot_main(["perf", str(run), "--out", str(out.with_suffix(".png"))]) == 0


class _Set(list):
    classes = ["cat", "dog"]


def test_resuming_onto_a_capped_copy_of_the_data_is_refused(tmp_path):
    src, dst = _images(tmp_path / "src"), tmp_path / "capped"
    cap_folder(src, dst, 16)
    full, capped = data_fingerprint(_Set([1] * 4), [], src), data_fingerprint(_Set([1] * 4), [], dst)
    assert full["storage"] is None and capped["storage"]["short_side"] == 16
    with pytest.raises(ConfigError, match="storage: None -> .*'short_side': 16"):
        check_data(full, capped, tmp_path / "run")
    with pytest.raises(ConfigError, match="'short_side': 16.* -> None"):
        check_data(capped, full, tmp_path / "run")
    check_data(full, data_fingerprint(_Set([1] * 4), [], src), tmp_path / "run")  # the same data: no refusal
    older = {k: v for k, v in capped.items() if k != "storage"}  # a checkpoint written before storage was recorded
    check_data(older, capped, tmp_path / "run")
    check_data(older, full, tmp_path / "run")
    with pytest.raises(ConfigError, match="train_size: 4 -> 3"):
        check_data(older, data_fingerprint(_Set([1] * 3), [], src), tmp_path / "run")
    json.loads((dst / CAPPED_INFO).read_text())  # still the tool's manifest


def test_the_checkpoint_record_takes_the_storage_and_an_older_one_without_it():
    from ..run.test_checkpoint_record import _good_record

    record = _good_record()
    assert "storage" not in record["data"]
    assert "storage" not in CheckpointRecord.from_dict(record, "ck.pt").data
    record["data"]["storage"] = {"short_side": 16, "quality": 90, "resample": "PIL bicubic (antialiased)"}
    assert CheckpointRecord.from_dict(record, "ck.pt").data["storage"]["short_side"] == 16


def test_a_log_file_that_is_a_link_is_moved_aside_and_never_written_through(tmp_path):
    diary = tmp_path / "diary.txt"
    diary.write_text("mine\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").symlink_to(diary)
    handler = start_log_file(run / "train.log")
    try:
        logging.getLogger("quest.train").warning("a line of the run")
    finally:
        stop_log_file(handler)
    assert diary.read_text() == "mine\n"
    log = run / "train.log"
    assert not log.is_symlink() and "a line of the run" in log.read_text() and "was a link to" in log.read_text()
    (kept,) = (run / ".replaced").glob("*-unrecorded/train.log")
    assert kept.is_symlink() and os.readlink(kept) == str(diary)


@pytest.mark.parametrize(("flag", "value"), [("--name", "a/b"), ("--split", "../../elsewhere"), ("--name", ""),
                                             ("--split", ".hidden")])
def test_make_shards_refuses_a_shard_name_that_is_not_a_plain_name_before_any_change(tmp_path, flag, value):
    src, out = _images(tmp_path / "src"), tmp_path / "shards"
    name, splits = (value, [("train", "train")]) if flag == "--name" else ("shards", [("train", value)])
    with pytest.raises(ValueError, match=f"{flag} {value!r}: expected a plain name"):
        convert_image_folder(src, out, splits, name, shard_size=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_make_shards_as_a_script_refuses_in_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """``python -m quest.tools.make_shards`` goes through quest's error path: its ``__main__`` block run in-process
    (runpy runs the module as the interpreter's -m does), with the command line a user types."""
    import runpy

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # the switch that shows tracebacks
    monkeypatch.setattr(sys, "argv", ["make_shards.py", "convert", str(tmp_path / "src"), str(tmp_path / "out"),
                                      "--shard-size", "0"])
    monkeypatch.delitem(sys.modules, "quest.tools.make_shards", raising=False)  # runpy's warning: run it fresh
    with pytest.raises(SystemExit) as exited:
        runpy.run_module("quest.tools.make_shards", run_name="__main__", alter_sys=True)
    err = capsys.readouterr().err
    assert exited.value.code == 1 and "Traceback" not in err
    assert err.strip() == "python -m quest.tools.make_shards: error: --shard-size must be at least 1, got 0"


@pytest.mark.parametrize("workers", ["-3", "0"])
def test_a_worker_count_out_of_range_is_refused_with_the_one_range(tmp_path, capsys, workers):
    from quest.tools.data_check import main as quest_data

    with pytest.raises(SystemExit) as exited:
        quest_data(["cap", str(tmp_path), str(tmp_path / "out"), "--short-side", "16", "--workers", workers])
    assert exited.value.code == 2
    assert re.search(rf"--workers: must be an integer in 1\.\.\d+ \(at most .*\), got {workers}$",
                     capsys.readouterr().err.strip())


def test_a_replaced_folder_that_is_a_link_is_refused_and_nothing_leaves_the_folder(tmp_path):
    from quest.run.directory import RunDirectory
    from quest.store.tree import move_aside

    folder, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    folder.mkdir()
    elsewhere.mkdir()
    (folder / "model.safetensors").write_bytes(b"weights")
    (folder / ".replaced").symlink_to(elsewhere)
    with pytest.raises(DamagedFile, match=r"\.replaced is damaged: a symbolic link to .*elsewhere"):
        move_aside(folder, [folder / "model.safetensors"])
    assert (folder / "model.safetensors").read_bytes() == b"weights" and not any(elsewhere.iterdir())
    with pytest.raises(ConfigError, match=r"\.replaced is a symbolic link to .*elsewhere, not a folder of its own"):
        RunDirectory(folder).writable()  # training: refused with the run directory's checks, before any change



@pytest.mark.parametrize("kind", ["file", "link"])
def test_a_folder_whose_replaced_cannot_keep_anything_is_refused_before_its_lock_changes_it(tmp_path, kind):
    """holding() asks before it makes its lock file, whose making and removal would change the folder's entries and
    modification time: a refused command leaves the folder as it was, its mtime included."""
    from quest.store.output_folder import holding

    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "config.json").write_bytes(b"{}")
    (folder / ".replaced").write_bytes(b"x") if kind == "file" else (folder / ".replaced").symlink_to(tmp_path)
    os.utime(folder, ns=(1_700_000_000_000_000_000,) * 2)
    with pytest.raises(DamagedFile, match=r"\.replaced is damaged"), holding(folder, "quest-export"):
        pass
    assert sorted(p.name for p in folder.iterdir()) == [".replaced", "config.json"]
    assert folder.stat().st_mtime_ns == 1_700_000_000_000_000_000

def _output_command(name: str):
    """The in-process main of each command that takes an output path."""
    from quest.report.__main__ import main as report
    from quest.tools.data_check import main as quest_data
    from quest.tools.export import main as export
    from quest.tools.make_shards import main as make_shards

    return {"quest-export": export, "quest-report": report, "quest-plot": plot_main, "quest-data": quest_data,
            "make_shards": make_shards}[name]


#: each command that writes into an output path, ``{}`` where the path goes
OUTPUT_ARGV = [
    ["quest-export", "run", "--out", "{}"],
    ["quest-report", "runs", "--out", "{}"],
    ["quest-plot", "perf", "run", "--out", "{}fig.png"],
    ["quest-data", "cap", "src", "{}", "--short-side", "16"],
    ["make_shards", "convert", "src", "{}"],
]


def _run_output_command(argv: list[str], out: str) -> int:
    """The exit code of the command of ``argv`` with ``out`` as its output path."""
    with pytest.raises(SystemExit) as exited:
        _output_command(argv[0])([a.format(out) for a in argv[1:]])
    return exited.value.code


@pytest.mark.parametrize("argv", OUTPUT_ARGV)
@pytest.mark.parametrize("out", ["", " "])
def test_an_empty_output_path_is_refused_by_every_command_before_any_work(tmp_path, monkeypatch, capsys, argv, out):
    """``--out "$OUT"`` with OUT unset: the working directory would receive the command's files."""
    monkeypatch.chdir(tmp_path)
    if argv[0] == "quest-plot":
        argv = [*argv[:-1], out]
    code = _run_output_command(argv, out)
    assert code == 2 and "is empty; expected a path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv", OUTPUT_ARGV)
def test_an_output_path_going_up_from_a_missing_folder_is_refused_and_makes_none(tmp_path, monkeypatch, capsys,
                                                                                  argv):
    """``--out x/sub/..`` with no x/sub: the command's mkdir would make x/sub on the way and leave it behind."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x").mkdir()
    assert _run_output_command(argv, "x/sub/../") == 2
    assert "goes up ('..') from x/sub, which is not an existing folder" in capsys.readouterr().err
    assert [p.relative_to(tmp_path) for p in tmp_path.rglob("*")] == [Path("x")]
    (tmp_path / "x" / "sub").mkdir()  # through an existing folder '..' is the kernel's, as a shell's cd
    assert output_path("x/sub/..") == Path("x/sub/..")


@pytest.mark.parametrize("inside", ["train/zz", ".", "val"])
def test_make_shards_refuses_an_output_folder_inside_its_source(tmp_path, inside):
    src = _images(tmp_path / "src")
    before = tree_state(src)
    with pytest.raises(ValueError, match="must not lie inside its source"):
        convert_image_folder(src, src / inside, [("train", "train")], shard_size=2)
    assert tree_state(src) == before


@pytest.mark.parametrize("name", ["figs", "figs/", "figure"])
def test_plot_refuses_a_folder_or_a_name_without_a_format_as_its_image(tmp_path, capsys, name):
    """``--out figs --overwrite`` moved the folder figs/ aside and wrote a PNG named figs."""
    (tmp_path / "figs").mkdir()
    (tmp_path / "figs" / "notes.txt").write_text("mine")
    before = tree_state(tmp_path)
    with pytest.raises(SystemExit) as exited:
        plot_main(["perf", str(tmp_path / "run"), "--out", f"{tmp_path}/{name}", "--overwrite"])
    assert exited.value.code == 2
    assert ("is a folder" if name.startswith("figs") else "has no suffix") in capsys.readouterr().err
    assert tree_state(tmp_path) == before


def test_json_nested_past_the_decoder_is_damage_like_any_other_not_a_bug(tmp_path):
    """``[[[[...`` raises RecursionError inside json.loads, which quest's error path calls a bug of quest."""
    from quest.store.files import parse_json

    deep = "[" * 200_000
    with pytest.raises(json.JSONDecodeError, match="nested deeper than any file quest writes"):
        parse_json(deep)
    assert parse_json('{"a": [[1]]}') == {"a": [[1]]}
    src, dst = _images(tmp_path / "src"), tmp_path / "capped"
    cap_folder(src, dst, 16)
    with open(dst / MANIFEST_NAME, "a") as f:
        f.write(deep + "\n{}\n")
    with pytest.raises(ValueError, match=r"\.manifest\.jsonl line \d+ is not JSON"):
        cap_folder(src, dst, 16)
