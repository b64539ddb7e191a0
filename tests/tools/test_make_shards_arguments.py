"""``python -m quest.tools.make_shards``'s arguments and its summary line: every bad argument of ``convert`` and
``index`` refused in one line naming it and the expected form, before any change; what ``index`` writes is what its
readers accept; the rerun's summary counts what the tool did, not what somebody else did (docs/data.md, "Running a
data tool again")."""
from __future__ import annotations

import io
import logging
import os
import shutil
import tarfile
from pathlib import Path

import pytest
from PIL import Image

import quest.tools.make_shards as make_shards
from quest.data.shard_index import load_info, resolve_shards
from quest.runtime.errors import reporting_errors
from quest.tools.data_check import check_root
from quest.tools.make_shards import convert_image_folder, main, write_index

from ..tree_state import tree_state

PROGRAM = "python -m quest.tools.make_shards"
SHARDS = ("toy-train-0000.tar", "toy-train-0001.tar", "toy-validation-0000.tar")  # 2 + 2 samples, then 2


@pytest.fixture
def made(tmp_path: Path) -> tuple[Path, Path, Path]:
    """(source image folder, its shards ``sh/`` by convert, ``idx/`` holding copies of the train shards only)."""
    src = tmp_path / "folder"
    for split in ("train", "val"):
        for c in range(2):
            (src / split / f"c{c}").mkdir(parents=True)
            for i in range(2 if split == "train" else 1):
                Image.new("RGB", (4, 4), (c * 90, i * 90, 0)).save(src / split / f"c{c}" / f"{i}.png")
    sh, idx = tmp_path / "sh", tmp_path / "idx"
    convert_image_folder(src, sh, [("train", "train"), ("val", "validation")], name="toy", shard_size=2)
    idx.mkdir()
    for name in SHARDS[:2]:
        shutil.copy(sh / name, idx / name)
    return src, sh, idx


def _run(argv: list[str], capsys, monkeypatch) -> tuple[int, list[str]]:
    """The command as its ``__main__`` block runs it, as a user sees it: (exit code, stderr's lines)."""
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # the switch that adds a traceback
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited, reporting_errors(PROGRAM):
        main(argv)
    return exited.value.code, capsys.readouterr().err.strip().splitlines()


# every way an index argument can be wrong -> what its line must name besides the expected form SPLIT=PATTERN
BAD_INDEX = [
    (["train"], ["'train' has no '='"]),
    (["=toy-train-*.tar"], ["=toy-train-*.tar", "'' cannot name a split", "{idx}"]),
    (["a/b=toy-train-*.tar"], ["'a/b' cannot name a split", "such as train"]),
    ([".x=toy-train-*.tar"], ["'.x' cannot name a split"]),
    (["x.tar=toy-train-*.tar"], ["'x.tar' cannot name a split"]),  # data.train_split=x.tar is read as a pattern
    (["a*=toy-train-*.tar"], ["'a*' cannot name a split"]),
    (["train=../sh/*.tar"], ["train=../sh/*.tar", "outside {idx}"]),
    (["train={sh}/toy-train-*.tar"], ["train={sh}/toy-train-*.tar", "outside {idx}"]),
    (["train={{..,.}}/toy-train-0000.tar"], ["outside {idx}"]),  # a brace that expands to ../toy-train-0000.tar
    (["train=toy-train-0000"], ["'toy-train-0000' is not a shard pattern"]),  # it would be read as a split's name
    (["train="], ["'' is not a shard pattern"]),
    (["train=toy-train-0000.tar", "train=toy-train-0001.tar"], ["split 'train' is given twice"]),
]


@pytest.mark.parametrize(("args", "says"), BAD_INDEX, ids=[" ".join(a) for a, _ in BAD_INDEX])
def test_a_bad_index_argument_is_one_line_naming_it_before_any_change(made, capsys, monkeypatch, args, says):
    _, sh, idx = made
    before = tree_state(idx.parent)
    code, lines = _run(["index", str(idx), *[a.format(sh=sh) for a in args]], capsys, monkeypatch)
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"{PROGRAM}: error: "), lines
    for words in [*says, "expected SPLIT=PATTERN"]:
        assert words.format(idx=idx, sh=sh) in lines[0]
    assert tree_state(idx.parent) == before


@pytest.mark.parametrize("pattern", ["../sh/toy-train-*.tar", "../sh/toy-train-{0000..0001}.tar"])
def test_index_checks_the_record_as_its_reader_does_before_any_change(made, monkeypatch, pattern):
    """Past the argument check (switched off here), the record itself is checked with the reader's declaration
    (quest.store.tool_records.check_info) before anything is written: index never writes what it would refuse."""
    _, _, idx = made
    monkeypatch.setattr(make_shards, "_check_index_split", lambda *a: None)
    before = tree_state(idx.parent)
    with pytest.raises(ValueError, match=r"splits\.train\.filenames\[0\] is '\.\./sh/toy-train-0000\.tar', a path "
                                         "outside"):
        write_index(idx, {"train": pattern})
    assert tree_state(idx.parent) == before


@pytest.mark.parametrize("pattern", ["toy-train-*.tar", "toy-train-{0000..0001}.tar", "sub/*.tar",
                                     "./toy-train-{0000,0001}.tar"])
def test_what_index_writes_its_readers_accept_and_a_second_index_too(made, pattern):
    _, _, idx = made
    if pattern.startswith("sub/"):
        (idx / "sub").mkdir()
        for name in SHARDS[:2]:
            (idx / name).rename(idx / "sub" / name)
    write_index(idx, {"train": pattern})
    info, _ = load_info(idx)  # the reader's checks: every filename inside idx
    assert info["splits"]["train"]["num_samples"] == 4
    assert sum(s.length for s in resolve_shards(idx, "train")) == 4  # the training reader, by the split's name
    assert check_root(idx, workers=1, use_cache=False, progress=False, out=io.StringIO()) == 0  # quest-data check
    write_index(idx, {"again": pattern})  # the folder is not poisoned for the next index
    assert set(load_info(idx)[0]["splits"]) == {"train", "again"}


def test_a_refused_pattern_outside_leaves_the_folder_open_to_the_next_index(made, capsys, monkeypatch):
    """The probe's sequence: a pattern naming another folder's shards, then one naming the folder's own."""
    _, _, idx = made
    assert _run(["index", str(idx), "train=../sh/*.tar"], capsys, monkeypatch)[0] == 1
    assert not (idx / "_info.json").exists()
    write_index(idx, {"train": "toy-train-*.tar"})
    assert check_root(idx, workers=1, use_cache=False, progress=False, out=io.StringIO()) == 0


# every way a convert option can be wrong -> what its line must name (the flag is always named)
BAD_CONVERT = [
    (["--split", ":x"], ["--split ':x'", "FOLDER before ':' is empty", "FOLDER[:NAME]"]),
    (["--split", "train:"], ["--split 'train:'", "NAME after ':' is empty", "FOLDER[:NAME]"]),
    (["--split", ""], ["--split ''", "FOLDER[:NAME]"]),
    (["--split", "../folder/train:t"], ["--split '../folder/train'", "FOLDER[:NAME]", "inside it"]),
    (["--split", "../folder/train"], ["--split '../folder/train'", "FOLDER[:NAME]", "inside it"]),  # not its name
    (["--split", "{src}/train:t"], ["--split '{src}/train'", "FOLDER[:NAME]", "inside it"]),
    (["--split", "train:a/b"], ["--split 'a/b'", "plain name"]),
    (["--split", "train:.x"], ["--split '.x'", "plain name"]),
    (["--split", "train:a*"], ["--split 'a*'", "plain name", "data.train_split"]),
    (["--split", "train:x.tar"], ["--split 'x.tar'", "plain name", "data.train_split"]),
    (["--split", "train", "--split", "val:train"], ["--split", "split name 'train' is given twice", "FOLDER[:NAME]"]),
    (["--seed", "-1"], ["--seed must be 0 or more, got -1"]),
]


@pytest.mark.parametrize(("args", "says"), BAD_CONVERT, ids=[" ".join(a) for a, _ in BAD_CONVERT])
def test_a_bad_convert_option_is_one_line_naming_the_flag_before_any_change(made, capsys, monkeypatch, args, says):
    src, _, _ = made
    before = tree_state(src.parent)
    argv = ["convert", str(src), str(src.parent / "out"), *[a.format(src=src) for a in args]]
    code, lines = _run(argv, capsys, monkeypatch)
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"{PROGRAM}: error: "), lines
    for words in says:
        assert words.format(src=src) in lines[0]
    assert tree_state(src.parent) == before


def _source_of(shard: Path, src: Path) -> Path:
    """An image the shard was made from (its first member's key is ``<class>/<stem>``)."""
    with tarfile.open(shard) as tar:
        key = tar.getnames()[0].split(".")[0]
    split = "train" if "-train-" in shard.name else "val"
    return next((src / split).glob(f"{key}.*"))


# per shard of SHARDS: left alone, deleted by somebody, changed by somebody, or its source image touched
FAULTS = [("keep", "keep", "keep"), ("delete", "keep", "keep"), ("change", "keep", "keep"),
          ("stale", "keep", "keep"), ("delete", "change", "keep"), ("delete", "change", "stale"),
          ("change", "change", "delete")]


@pytest.mark.parametrize("faults", FAULTS, ids=["-".join(f) for f in FAULTS])
def test_the_rerun_summary_counts_what_the_tool_did(made, caplog, faults):
    """``removed`` counts only the shards the tool itself deleted (its own, unchanged since written: a touched
    source's shard, deleted and written anew); a shard somebody changed is counted as moved to .replaced/ and one
    somebody deleted as found missing, neither as removed."""
    src, sh, _ = made
    for name, fault in zip(SHARDS, faults):
        if fault == "delete":
            (sh / name).unlink()
        elif fault == "change":
            with open(sh / name, "ab") as f:
                f.write(b"edited")
        elif fault == "stale":
            image = _source_of(sh / name, src)
            os.utime(image, ns=(image.stat().st_atime_ns, image.stat().st_mtime_ns + 10**9))
    caplog.set_level(logging.INFO, logger="quest.tools.make_shards")
    convert_image_folder(src, sh, [("train", "train"), ("val", "validation")], name="toy", shard_size=2)
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("this run: ")]
    count = faults.count
    expected = (f"this run: {3 - count('keep')} shards written, {count('stale')} removed"
                + (f", {count('change')} moved to .replaced/ (changed since written or not on record)"
                   if count("change") else "")
                + (f", {count('delete')} found missing (deleted since written)" if count("delete") else "")
                + f", {count('keep')} kept from an earlier run (unchanged files)")
    assert line == expected
    aside = sorted(p.name for p in (sh / ".replaced").rglob("*.tar")) if (sh / ".replaced").exists() else []
    assert aside == sorted(n for n, f in zip(SHARDS, faults) if f == "change")
