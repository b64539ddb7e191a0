"""What the data tools read back: the folder's manifest (quest/store/manifest.py) and the ledger an older quest wrote
instead (quest/store/old_manifests.py), a shard folder's ``_info.json``, a capped copy's ``_capped.json`` and the
pre-flight's cache (quest/store/tool_records.py). For every kind, every field set to a value of the wrong type, one
out of its range, and every path it names set outside its folder: the reader refuses it naming the file and the
field, before acting on it (the pre-flight's cache, only a shortcut, is not believed: the folder is checked
again)."""
from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from quest.data.preflight import _cache_paths, check_image_folder_files
from quest.data.shard_index import ShardError, load_info
from quest.store.damage import DamagedFile
from quest.store.manifest import MANIFEST_NAME, Manifest, ManifestEntry, ManifestHeader
from quest.store.old_manifests import OLD_LEDGER, LedgerHeader, LedgerLine
from quest.store.tool_records import (
    CAPPED_INFO,
    CappedRecord,
    InfoSplit,
    PreflightCache,
    ShardInfo,
    read_capped,
)
from quest.tools.capped import cap_folder
from quest.tools.data_check import check_root

from ..record_faults import faults, planted

TOOL, PARAMS = "quest-data cap", {"short_side": 16, "quality": 90, "splits": ["train"]}
HEADER = {"manifest": 1, "settings": {TOOL: PARAMS}}
LINE = {"path": "train/cat/a.png", "by": TOOL, "size": 69, "mtime_ns": 1700000000000000000, "sha256": "0" * 64,
        "source": "train/cat/a.png", "stamp": "69:1700000000000000000"}
OLD_HEADER = {"tool": TOOL, "params": PARAMS}
OLD_LINE = {"key": "train/cat/a.png", "out": "train/cat/a.png", "stamp": "69:1700000000000000000"}
INFO = {"splits": {"train": {"name": "train", "num_samples": 3, "filenames": ["toy-train-0.tar"],
                             "shard_lengths": [3]}}, "num_classes": 2, "classes": ["cat", "dog"], "complete": True}
CAPPED = {"complete": True, "short_side": 16, "quality": 90, "resample": "bicubic", "source": "/data/src",
          "layout": "image folder", "splits": {"train": {"images": 2, "unreadable": {}}}, "linked": ["val"]}


def _manifest(folder: Path, header, line, name: str = MANIFEST_NAME) -> Manifest:
    """The manifest of ``folder`` holding ``header`` and ``line`` (in the older ledger's form with ``OLD_LEDGER``),
    read as the tool reads it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps(header) + "\n" + json.dumps(line) + "\n")
    manifest = Manifest(folder, TOOL)
    manifest.resume(PARAMS)
    return manifest


def test_good_files_read_right(tmp_path):
    assert _manifest(tmp_path / "m", HEADER, LINE).entries == {LINE["path"]: ManifestEntry(**LINE)}
    (tmp_path / "_info.json").write_text(json.dumps(INFO))
    assert load_info(tmp_path) == (INFO, tmp_path / "_info.json")
    (tmp_path / CAPPED_INFO).write_text(json.dumps(CAPPED))
    assert read_capped(tmp_path) == CAPPED


OUTSIDE = ("../outside.png", "/etc/passwd", "train/../../x.png")
MANIFEST_FAULTS = ([("header", path, value) for path, value in faults(ManifestHeader)]
                   + [("line", path, value) for path, value in faults(ManifestEntry)]
                   + [("line", "path", value) for value in OUTSIDE] + [("line", "sha256", "zz")])


@pytest.mark.parametrize("part,path,value", MANIFEST_FAULTS, ids=[f"{p}.{f}={v!r}" for p, f, v in MANIFEST_FAULTS])
def test_a_manifest_field_that_does_not_fit_is_refused_naming_the_line_and_field(tmp_path, part, path, value):
    header, line = (planted(HEADER, path, value), LINE) if part == "header" else (HEADER, planted(LINE, path, value))
    with pytest.raises(DamagedFile) as refused:
        _manifest(tmp_path, header, line)
    number = 1 if part == "header" else 2
    assert f"{tmp_path / MANIFEST_NAME} line {number}: {path}" in str(refused.value)
    assert refused.value.path == tmp_path / MANIFEST_NAME  # the file, for a reader that keeps it aside


def test_a_manifest_entry_without_its_command_or_with_a_key_it_does_not_declare_is_refused(tmp_path):
    with pytest.raises(DamagedFile, match="line 2: no by; expected the command"):
        _manifest(tmp_path, HEADER, {k: v for k, v in LINE.items() if k != "by"})
    with pytest.raises(DamagedFile, match="line 2: it holds keep"):
        _manifest(tmp_path, HEADER, {**LINE, "keep": True})


OLD_FAULTS = ([("header", path, value) for path, value in faults(LedgerHeader)]
              + [("line", path, value) for path, value in faults(LedgerLine)]
              + [("line", "out", value) for value in OUTSIDE])


@pytest.mark.parametrize("part,path,value", OLD_FAULTS, ids=[f"{p}.{f}={v!r}" for p, f, v in OLD_FAULTS])
def test_an_older_ledger_is_checked_as_strictly_naming_the_line_and_field(tmp_path, part, path, value):
    header, line = ((planted(OLD_HEADER, path, value), OLD_LINE) if part == "header"
                    else (OLD_HEADER, planted(OLD_LINE, path, value)))
    with pytest.raises(DamagedFile) as refused:
        _manifest(tmp_path, header, line, OLD_LEDGER)
    assert f"{tmp_path / OLD_LEDGER} line {1 if part == 'header' else 2}: {path} is" in str(refused.value)


@pytest.mark.parametrize("name,header,line", [(MANIFEST_NAME, HEADER, LINE), (OLD_LEDGER, OLD_HEADER, OLD_LINE)])
def test_only_a_cut_last_line_is_passed_over(tmp_path, name, header, line):
    (tmp_path / "train/cat").mkdir(parents=True)
    (tmp_path / "train/cat/a.png").write_bytes(b"x" * 69)
    (tmp_path / name).write_text(json.dumps(header) + "\n" + json.dumps(line) + '\n{"path": "train/c')
    manifest = Manifest(tmp_path, TOOL)
    manifest.resume(PARAMS)
    assert list(manifest.sources()) == ["train/cat/a.png"]
    (tmp_path / name).write_text(json.dumps(header) + '\n{"path": "train/c\n' + json.dumps(line) + "\n")
    with pytest.raises(DamagedFile, match="line 2 is not JSON"):
        Manifest(tmp_path, TOOL).resume(PARAMS)


def test_a_rerun_whose_manifest_names_a_file_outside_its_folder_deletes_nothing(tmp_path):
    """The path a rerun would delete: the whole command refused first, every file as it was."""
    src = tmp_path / "src"
    for c in ("cat", "dog"):
        (src / "train" / c).mkdir(parents=True)
        Image.new("RGB", (20, 20)).save(src / "train" / c / "a.png")
    dst = tmp_path / "capped"
    cap_folder(src, dst, short_side=16)
    victim = tmp_path / "victim.png"
    victim.write_bytes(b"someone else's")
    lines = (dst / MANIFEST_NAME).read_text().splitlines()
    lines.append(json.dumps({"path": "../victim.png", "by": TOOL, "source": "train/cat/gone.png", "stamp": "1:1"}))
    (dst / MANIFEST_NAME).write_text("\n".join(lines) + "\n")
    before = {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(DamagedFile, match=r"path is '\.\./victim\.png', a path outside"):
        cap_folder(src, dst, short_side=16)
    assert {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.rglob("*") if p.is_file()} == before


INFO_FAULTS = (list(faults(ShardInfo)) + list(faults(InfoSplit, "splits.train."))
               + [("splits.train.shard_lengths", [-1]), ("splits.train.filenames", ["../other/toy-train-0.tar"]),
                  ("splits.train.filenames", ["/data/toy-train-0.tar"]), ("splits.train", {"name": "train"}),
                  ("num_classes", 10**18), ("num_classes", 3)])  # INFO names 2 classes


@pytest.mark.parametrize("path,value", INFO_FAULTS, ids=[f"{f}={v!r}" for f, v in INFO_FAULTS])
def test_an_info_field_that_does_not_fit_is_refused_naming_the_field(tmp_path, path, value):
    (tmp_path / "_info.json").write_text(json.dumps(planted(INFO, path, value)))
    with pytest.raises(ShardError) as refused:
        load_info(tmp_path)
    assert f"{tmp_path / '_info.json'}: {path}" in str(refused.value)


def test_quest_data_check_names_a_bad_info_field(tmp_path):
    (tmp_path / "_info.json").write_text(json.dumps(planted(INFO, "num_classes", "2")))
    out = io.StringIO()
    assert check_root(tmp_path, workers=1, progress=False, out=out, err=io.StringIO()) == 1
    assert "num_classes is str '2', expected" in out.getvalue()


CAPPED_FAULTS = list(faults(CappedRecord)) + [("linked", ["../val"]), ("linked", ["a/b"])]


@pytest.mark.parametrize("path,value", CAPPED_FAULTS, ids=[f"{f}={v!r}" for f, v in CAPPED_FAULTS])
def test_a_capped_record_field_that_does_not_fit_is_refused_naming_the_field(tmp_path, path, value):
    (tmp_path / CAPPED_INFO).write_text(json.dumps(planted(CAPPED, path, value)))
    with pytest.raises(DamagedFile) as refused:
        read_capped(tmp_path)
    assert f"{tmp_path / CAPPED_INFO}: {path}" in str(refused.value)


def _cached_folder(tmp: Path) -> tuple[Path, dict]:
    root = tmp / "train"
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        Image.new("RGB", (8, 8)).save(root / c / "a.png")
    (root / "dog" / "b.png").write_bytes(b"")
    check_image_folder_files(root, workers=1)
    return root, json.loads((root / ".quest-preflight.json").read_text())


# the folder of _cached_folder holds 3 files, 2 images and 1 problem: counts that do not add up to its files (the
# message names images, beside the problems' count)
COUNT_FAULTS = [("images", 3), ("images", 10**18), ("problems", [])]
CACHE_FAULTS = list(faults(PreflightCache)) + [("problems", [{"path": "/etc/passwd", "reason": "empty"}]),
                                               ("problems", [{"reason": "empty"}]), *COUNT_FAULTS]


@pytest.mark.parametrize("path,value", CACHE_FAULTS, ids=[f"{f}={v!r}" for f, v in CACHE_FAULTS])
def test_a_preflight_cache_that_does_not_fit_is_not_believed(tmp_path, monkeypatch, path, value, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root, cache = _cached_folder(tmp_path)
    fresh = check_image_folder_files(root, workers=1, use_cache=False)
    for where in _cache_paths(root):  # the bad record wherever the pre-flight looks
        where.parent.mkdir(parents=True, exist_ok=True)
        where.write_text(json.dumps(planted(cache, path, value)))
    report = check_image_folder_files(root, workers=1)
    assert not report.cached and (report.images, report.problems) == (fresh.images, fresh.problems)
    assert f": {'images' if (path, value) in COUNT_FAULTS else path}" in caplog.text and "not used" in caplog.text


def test_a_preflight_cache_naming_a_file_the_folder_does_not_hold_is_not_believed(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root, cache = _cached_folder(tmp_path)
    cache["problems"] = [{"path": str(root / "cat" / "gone.png"), "reason": "empty"}]  # inside, but not a file of it
    (root / ".quest-preflight.json").write_text(json.dumps(cache))
    report = check_image_folder_files(root, workers=1)
    assert not report.cached and report.images == 2 and "problems[0].path" in caplog.text and "not used" in caplog.text


def test_a_file_of_somebody_else_s_at_the_caches_name_is_never_written_over(tmp_path, monkeypatch, caplog):
    """A file at the cache's name in the data folder that is no pre-flight cache (the user's notes) stays as it was;
    the cache goes to the user's cache folder and is read from there."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    root, _ = _cached_folder(tmp_path)
    (root / ".quest-preflight.json").write_bytes(b"my notes\n")
    assert not check_image_folder_files(root, workers=1).cached
    assert (root / ".quest-preflight.json").read_bytes() == b"my notes\n"
    assert "is not the pre-flight's cache" in caplog.text and _cache_paths(root)[1].is_file()
    assert check_image_folder_files(root, workers=1).cached
