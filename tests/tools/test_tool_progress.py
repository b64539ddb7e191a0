"""Progress of the data tools' long loops: make_shards convert logs its shards (first, last, every 10 s between)
and what it lists before. Time never decides a test: a clock that ticks once per reading stands in."""
from __future__ import annotations

import logging

from PIL import Image

from quest.tools.make_shards import convert_image_folder

from ..helpers import TickingClock


def test_a_conversion_logs_its_shards_with_an_eta_and_what_a_rerun_kept(tmp_path, monkeypatch, caplog):
    src = tmp_path / "folder"
    for split, count in (("train", 5), ("val", 2)):
        for c in ("cat", "dog", "emu"):
            (src / split / c).mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (6, 6), (i * 40, 0, 0)).save(src / split / c / f"{c}{i}.png")
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
