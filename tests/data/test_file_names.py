"""A data set whose file names are not UTF-8 (as old zip archives extract them) is read, fingerprinted, checked and
trained on like any other: its names reach digests, records and logs escaped, never as an encoder's error that names
no file (docs/data.md, "File names"); an unusable file whose name holds a line break is listed on one line."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from PIL import Image

from quest.tools.data_check import main as quest_data
from quest.train import fit

from ..helpers import compose_cfg

NAME = b"caf\xe9.png"  # Latin-1: not UTF-8


def _folder(root: Path) -> Path:
    for split in ("train", "val"):
        for label, colour in (("a", (200, 0, 0)), ("b", (0, 200, 0))):
            folder = root / split / label
            folder.mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (20, 20), colour).save(folder / f"{i}.png")
            Image.new("RGB", (20, 20), colour).save(os.path.join(os.fsencode(folder), NAME))
    return root


def test_a_data_set_with_names_that_are_not_utf8_trains_and_checks(tmp_path, caplog, capsys):
    root = _folder(tmp_path / "images")
    caplog.set_level(logging.INFO, logger="quest")
    summary = fit(compose_cfg("data=imagefolder", f"data.root={root}", "data.num_classes=2", "data.img_size=16",
                              "data.batch_size=5", "model=vit_pico", "recipe=light", "trainer.epochs=1"),
                  tmp_path / "run")
    assert summary["status"] == "completed" and summary["data_fingerprint"]["train_size"] == 10  # the name counted
    assert summary["data_fingerprint"]["files_sha256"] is not None
    assert "run completed" in (tmp_path / "run" / "train.log").read_text(encoding="utf-8")
    assert quest_data(["check", str(root), "--no-progress"]) == 0, capsys.readouterr()


def test_an_unusable_file_whose_name_holds_a_line_break_is_named_on_one_line(tmp_path, capsys):
    """Every listing of unusable files (the pre-flight's refusal, quest-data check and cap, make_shards convert) names each on
    its one line, the line break escaped: a reader (or a grep) of the listing sees one file per line."""
    import pytest

    from quest.data.folder import CorruptImageError
    from quest.tools.make_shards import convert_image_folder

    root = _folder(tmp_path / "images")
    (root / "train" / "a" / "bad\nname.png").write_bytes(b"not an image")
    listed = "bad\\nname.png: not an image Pillow can open"
    with pytest.raises(CorruptImageError) as refused:  # data.bad_images=error (the default): refused before the first step
        fit(compose_cfg("data=imagefolder", f"data.root={root}", "data.num_classes=2", "data.img_size=16",
                        "model=vit_pico", "recipe=light", "trainer.epochs=1"), tmp_path / "run")
    assert any(line.endswith(listed) for line in str(refused.value).splitlines()), str(refused.value)
    assert quest_data(["check", str(root), "--no-progress"]) == 1
    assert any(line.endswith(listed) for line in capsys.readouterr().out.splitlines())
    quest_data(["cap", str(root), str(tmp_path / "capped"), "--short-side", "16", "--no-progress", "--workers", "1"])
    assert any(line.strip().startswith(str(root)) and "bad\\nname.png: " in line
               for line in capsys.readouterr().out.splitlines())  # the images it left out, one line each
    with pytest.raises(CorruptImageError) as refused:
        convert_image_folder(root, tmp_path / "shards", [("train", "train")], "s", 4, 0, "error")
    assert len(str(refused.value).splitlines()) == 1 and listed in str(refused.value)
