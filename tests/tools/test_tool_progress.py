"""Progress of the data tools' long loops: make_shards convert logs its shards (first, last, every 10 s between)
and what it lists before; make_shards index the shards it counts. Time never decides a test: a clock that ticks
once per reading stands in."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from PIL import Image

from quest.tools.make_shards import convert_image_folder, write_index

from ..helpers import TickingClock


def _image_folder(src: Path) -> Path:
    """train/ with 5 images of each of 3 classes, val/ with 2."""
    for split, count in (("train", 5), ("val", 2)):
        for c in ("cat", "dog", "emu"):
            (src / split / c).mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (6, 6), (i * 40, 0, 0)).save(src / split / c / f"{c}{i}.png")
    return src


def test_a_conversion_logs_its_shards_with_an_eta_and_what_a_rerun_kept(tmp_path, monkeypatch, caplog):
    src = _image_folder(tmp_path / "folder")
    out = tmp_path / "wds"
    caplog.set_level(logging.INFO, logger="quest.tools.make_shards")
    for _ in range(2):  # the conversion, then a rerun that keeps every shard
        monkeypatch.setattr("quest.evaluation.progress.monotonic", TickingClock())
        convert_image_folder(src, out, [("train", "train"), ("val", "validation")], "toy", shard_size=4)
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count(f"train: listing {src / 'train'}") == 2
    assert f"validation: 6 images from {src / 'val'}, 2 shard(s) of at most 4; reading their sizes and times" in lines
    # 15 + 6 images in shards of 4: 4 + 2 shards; a reading at the start and one per shard, never 10 s apart
    shard_lines = [m for m in lines if m.startswith(f"make_shards convert {out}: shard ")]
    assert shard_lines == [f"make_shards convert {out}: shard 1/6, elapsed 1.0 s, ETA 5.0 s, 1 written",
                           f"make_shards convert {out}: shard 6/6, elapsed 6.0 s, ETA 0.0 s, 6 written",
                           f"make_shards convert {out}: shard 1/6, elapsed 1.0 s, ETA 5.0 s, 0 written",
                           f"make_shards convert {out}: shard 6/6, elapsed 6.0 s, ETA 0.0 s, 0 written"]


def test_an_index_logs_each_shard_it_counts_with_an_eta(tmp_path, monkeypatch, caplog):
    """Shards without an _info.json (another tool's), counted by ``make_shards index``: a line at the first shard
    and the last (never 10 s apart here), naming the shard just counted; the counts are the shards' own."""
    made, out = tmp_path / "made", tmp_path / "shards"
    convert_image_folder(_image_folder(tmp_path / "folder"), made, [("train", "train")], "toy", shard_size=4)
    out.mkdir()
    for shard in made.glob("*.tar"):  # 15 images in shards of 4
        (out / shard.name).write_bytes(shard.read_bytes())
    caplog.set_level(logging.INFO, logger="quest.tools.make_shards")
    monkeypatch.setattr("quest.evaluation.progress.monotonic", TickingClock())
    info = json.loads(write_index(out, {"train": "toy-train-*.tar"}).read_text())
    assert info["splits"]["train"]["shard_lengths"] == [4, 4, 4, 3]
    # a reading when the count starts and one per shard
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("make_shards index")] == [
        f"make_shards index {out} train: shard 1/4, elapsed 1.0 s, ETA 3.0 s, toy-train-0000.tar",
        f"make_shards index {out} train: shard 4/4, elapsed 4.0 s, ETA 0.0 s, toy-train-0003.tar"]
