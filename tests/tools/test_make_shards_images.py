"""``make_shards convert`` decodes every image before it packs one (docs/data.md, "Unreadable images when converting
to shards"): an image that does not decode refuses the conversion in one line naming it, before any change
(``--bad-images error``, the default), or is left out and recorded in _info.json (``--bad-images skip``)."""
from __future__ import annotations

import io
import json
import logging
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from quest.data.folder import CorruptImageError
from quest.runtime.errors import reporting_errors
from quest.tools.data_check import check_root
from quest.tools.make_shards import convert_image_folder, main

from ..tree_state import tree_state

PROGRAM = "python -m quest.tools.make_shards"


def _jpeg() -> bytes:
    out = io.BytesIO()  # noise, so that the scan data is most of the file and a cut lands in it
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()


# the bad file's bytes -> the reason the error gives for it
BAD = {"truncated": (_jpeg()[:-40], "undecodable (image file is truncated"),
       "text": (b"this is not a jpeg\n", "not an image Pillow can open"),
       "empty": (b"", "empty file (0 bytes)")}


def _source(root: Path, bad: dict[str, bytes]) -> Path:
    """train/c0, train/c1: two 8 x 8 images each, and ``bad`` (name -> bytes) in c1 as .jpg files."""
    for c in range(2):
        (root / "train" / f"c{c}").mkdir(parents=True)
        for i in range(2):
            Image.new("RGB", (8, 8), (c * 90, i * 90, 0)).save(root / "train" / f"c{c}" / f"{i}.png")
    for name, payload in bad.items():
        (root / "train" / "c1" / f"{name}.jpg").write_bytes(payload)
    return root


def test_a_truncated_jpeg_passes_pillow_s_verify_so_convert_decodes_whole():
    """Why a whole decode: verify() reads the headers only and takes a JPEG cut short for a good one."""
    with Image.open(io.BytesIO(BAD["truncated"][0])) as img:
        img.verify()
    with pytest.raises(OSError, match="truncated"), Image.open(io.BytesIO(BAD["truncated"][0])) as img:
        img.load()


@pytest.mark.parametrize("kind", sorted(BAD))
def test_an_image_that_does_not_decode_refuses_the_conversion_in_one_line_before_any_change(
        tmp_path, capsys, monkeypatch, kind):
    src = _source(tmp_path / "src", {kind: BAD[kind][0]})
    before = tree_state(tmp_path)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # the switch that adds a traceback
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited, reporting_errors(PROGRAM):
        main(["convert", str(src), str(tmp_path / "out"), "--split", "train", "--name", "toy"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 1 and len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"{PROGRAM}: error: make_shards convert: 1 of the 5 images of split 'train'"), line
    assert f"{src / 'train' / 'c1' / f'{kind}.jpg'}: {BAD[kind][1]}" in line
    assert "expected images Pillow decodes whole to 8-bit RGB" in line and "--bad-images skip" in line
    # nothing written: no output folder, no shard, and the source as it was (the pre-flight's cache is a change too)
    assert not (tmp_path / "out").exists() and tree_state(tmp_path) == before


def test_skip_leaves_them_out_and_records_them_in_info_json(tmp_path, caplog):
    src = _source(tmp_path / "src", {kind: payload for kind, (payload, _) in BAD.items()})
    caplog.set_level(logging.INFO, logger="quest.tools.make_shards")
    info = convert_image_folder(src, tmp_path / "out", [("train", "train")], name="toy", shard_size=3,
                                bad_images="skip")
    split = json.loads(info.read_text())["splits"]["train"]
    assert split["num_samples"] == 4 and split["shard_lengths"] == [3, 1]
    left_out = split["left_out"]
    assert left_out["files"] == 3 and left_out["of"] == 7
    assert left_out["by_reason"] == {"undecodable": 1, "not an image Pillow can open": 1, "empty file": 1}
    assert sorted(left_out["first"]) == sorted(str((src / "train" / "c1" / f"{k}.jpg").absolute()) for k in BAD)
    members = [m for name in split["filenames"] for m in tarfile.open(tmp_path / "out" / name).getnames()]
    assert sorted(members) == sorted(f"c{c}/{i}.{ext}" for c in range(2) for i in range(2) for ext in ("png", "cls"))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "3 of the 7 images of split 'train'" in warned[0]
    assert "left out (--bad-images skip), recorded in _info.json splits.train.left_out" in warned[0]
    assert check_root(tmp_path / "out", workers=1, progress=False, out=io.StringIO()) == 0  # the shards read clean

    # the source fixed: a rerun packs every image and the record goes with the reason for it
    for kind in BAD:
        Image.new("RGB", (8, 8), (9, 9, 9)).save(src / "train" / "c1" / f"{kind}.jpg", "JPEG")
    caplog.clear()
    split = json.loads(convert_image_folder(src, tmp_path / "out", [("train", "train")], name="toy", shard_size=3,
                                            bad_images="skip").read_text())["splits"]["train"]
    assert split["num_samples"] == 7 and "left_out" not in split
    assert "train: all 7 images decode" in [r.getMessage() for r in caplog.records]


def test_skip_refuses_a_split_none_of_whose_images_decodes_and_a_bad_value_is_refused(tmp_path):
    src = tmp_path / "src"
    (src / "train" / "c0").mkdir(parents=True)
    (src / "train" / "c0" / "a.jpg").write_bytes(b"")
    with pytest.raises(CorruptImageError, match="none would be left: fix or remove them"):
        convert_image_folder(src, tmp_path / "out", [("train", "train")], bad_images="skip")
    with pytest.raises(ValueError, match="--bad-images must be one of error, skip"):
        convert_image_folder(src, tmp_path / "out", [("train", "train")], bad_images="ignore")
    assert not (tmp_path / "out").exists()


def test_entries_that_are_not_regular_files_get_the_pre_flight_s_verdict_not_silence(tmp_path):
    """A link to a missing file and a FIFO named as images: what the data set would list, which the pre-flight
    (quest-data check) counts as problems; convert used to drop them unsaid (``is_file()``)."""
    src = _source(tmp_path / "src", {})
    os.symlink(tmp_path / "gone.jpg", src / "train" / "c0" / "dangling.jpg")
    os.mkfifo(src / "train" / "c1" / "fifo.jpg")
    with pytest.raises(CorruptImageError, match=r"2 of the 6 images of split 'train'") as refused:
        convert_image_folder(src, tmp_path / "out", [("train", "train")], name="toy")
    assert "dangling.jpg" in str(refused.value) and "fifo.jpg" in str(refused.value)
    assert not (tmp_path / "out").exists()
    assert check_root(src, workers=1, progress=False, out=io.StringIO()) == 1  # the pre-flight says the same
    info = convert_image_folder(src, tmp_path / "out", [("train", "train")], name="toy", bad_images="skip")
    assert json.loads(info.read_text())["splits"]["train"]["left_out"]["files"] == 2
