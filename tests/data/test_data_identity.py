"""The data fingerprint's content identity (``files_sha256``): two image folders of the same sizes and class names
but other files are two data sets (resume refused, two report settings); the same folder copied elsewhere is one."""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from quest.config.checks import ConfigError
from quest.data.folder import SafeImageFolder
from quest.report import RunResult
from quest.report.runs import flatten
from quest.report.settings import DATA_SET, setting
from quest.run.checkpoint_record import DataFingerprint
from quest.run.directory import check_data, data_fingerprint, data_record
from quest.store.damage import DamagedFile
from quest.store.records import check_fields


def _folder(root: Path, names: dict[str, dict[str, int]]) -> Path:
    """``root/{train,val}/<class>/<name>`` of the given byte counts; never decoded (the fingerprint reads no image)."""
    for split in ("train", "val"):
        for cls, files in names.items():
            (root / split / cls).mkdir(parents=True)
            for name, size in files.items():
                (root / split / cls / name).write_bytes(b"x" * size)
    return root


def _fingerprint(root: Path) -> dict:
    return data_fingerprint(SafeImageFolder(root / "train"), SafeImageFolder(root / "val"), root)


def _run(name: str, fingerprint: dict) -> RunResult:
    summary = {"status": "completed", "val/top1": 50.0, **flatten({"data_fingerprint": data_record(fingerprint)})}
    return RunResult(Path(name), "completed", summary, {"model.name": "vit"}, {"val/top1": 50.0})


LAYOUT = {"cat": {"a.jpg": 3, "b.jpg": 5}, "dog": {"c.jpg": 7}}


def test_other_files_of_the_same_sizes_and_classes_are_another_data_set(tmp_path):
    first = _fingerprint(_folder(tmp_path / "one", LAYOUT))
    # the same classes and split sizes; other files (one renamed; one moved to the other class)
    renamed = _fingerprint(_folder(tmp_path / "two", {"cat": {"a.jpg": 3, "z.jpg": 5}, "dog": {"c.jpg": 7}}))
    relabelled = _fingerprint(_folder(tmp_path / "three", {"cat": {"a.jpg": 3}, "dog": {"b.jpg": 5, "c.jpg": 7}}))
    for other in (renamed, relabelled):
        assert {k: v for k, v in other.items() if k != "files_sha256"} == \
               {k: v for k, v in first.items() if k != "files_sha256"}
        with pytest.raises(ConfigError, match=f"files_sha256: '{first['files_sha256']}' -> '{other['files_sha256']}'"):
            check_data(first, other, tmp_path / "run")
        a, b = _run("runs/a", first), _run("runs/b", other)
        assert setting(a, ())[DATA_SET] != setting(b, ())[DATA_SET]  # two settings in quest-report
    # an independent reference: the digest over the sorted "relative path<TAB>label" lines of each split
    lines = b"cat/a.jpg\t0\ncat/b.jpg\t0\ndog/c.jpg\t1\n"
    expected = hashlib.sha256(b"files-2\n" + (lines + b"\n") * 2).hexdigest()
    assert first["files_sha256"] == expected
    assert data_record(first)["files_sha256"] == expected
    # the stated limit: the names, not the bytes (no file is opened or stat'ed at a start)
    resized = _fingerprint(_folder(tmp_path / "four", {"cat": {"a.jpg": 3, "b.jpg": 5}, "dog": {"c.jpg": 8}}))
    assert resized["files_sha256"] == first["files_sha256"]


def test_the_same_folder_copied_elsewhere_is_the_same_data_set(tmp_path):
    src = _folder(tmp_path / "src", LAYOUT)
    dst = tmp_path / "moved" / "elsewhere"
    shutil.copytree(src, dst)
    here, there = _fingerprint(src), _fingerprint(dst)
    assert here == there and here["files_sha256"] is not None
    check_data(here, there, tmp_path / "run")  # resume allowed
    assert setting(_run("runs/a", here), ()) == setting(_run("runs/b", there), ())  # one setting


def test_a_checkpoint_written_before_the_digest_resumes(tmp_path):
    now = _fingerprint(_folder(tmp_path / "d", LAYOUT))
    older = {k: v for k, v in now.items() if k != "files_sha256"}
    check_fields(DataFingerprint, older, "last.pt")  # a valid record without it
    check_fields(DataFingerprint, now, "last.pt")
    with pytest.raises(DamagedFile, match="files_sha256"):
        check_fields(DataFingerprint, {**now, "files_sha256": 7}, "last.pt")
    check_data(older, now, tmp_path / "run")  # not compared on it
    with pytest.raises(ConfigError, match="val_size: 3 -> 2"):
        check_data(older, {**now, "val_size": 2}, tmp_path / "run")
    # a data set that lists no files (built-in, generated) has none, and two such are not told apart by it
    assert data_fingerprint(list(range(4)), list(range(2)))["files_sha256"] is None
