"""Unreadable images under data.bad_images=skip: counted per split in metrics.jsonl and summary.json, bounded by
data.max_skipped_fraction, and a run with nothing to train on fails with status bad_data (exit code 4)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from quest.train import exit_code, fit
from tests.helpers import compose_cfg

GOOD_PER_CLASS = 4


def _folder(root: Path, bad_train: int, bad_val: int, all_train_bad: bool = False) -> None:
    """3 classes, GOOD_PER_CLASS readable images each per split; ``bad_*`` unreadable files (a zero-byte one, text
    under an image name, a truncated PNG, in turn) spread over the classes."""
    png = root / "ref.png"
    root.mkdir(parents=True)
    Image.new("RGB", (20, 20), (10, 200, 30)).save(png)
    broken = [b"", b"not an image at all", png.read_bytes()[:40]]
    for split, n_bad in (("train", bad_train), ("val", bad_val)):
        for c in range(3):
            d = root / split / f"c{c}"
            d.mkdir(parents=True)
            for i in range(GOOD_PER_CLASS):
                if split == "train" and all_train_bad:
                    (d / f"img{i}.png").write_bytes(broken[i % 3])
                else:
                    Image.new("RGB", (20, 20), (60 * c, 20 * i, 90)).save(d / f"img{i}.png")
        for j in range(n_bad):
            (root / split / f"c{j % 3}" / f"bad{j}.png").write_bytes(broken[j % 3])
    png.unlink()


def _cfg(root: Path, *extra: str, batch: int = 7):
    # batch 7: the 14 training images of the tests below make whole batches, so every image is drawn every epoch
    return compose_cfg("data=imagefolder", f"data.root={root}", "data.num_classes=3", "data.img_size=16",
                       f"data.batch_size={batch}", "model=vit_pico", "recipe=light", "trainer.epochs=2",
                       "trainer.log_every_n_steps=1", "data.bad_images=skip", "trainer.device=cpu",
                       "data.preflight=false", *extra)  # the counts at load time; the pre-flight: test_data_preflight


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_skips_are_counted_per_split_in_metrics_and_summary(tmp_path):
    _folder(tmp_path / "data", bad_train=2, bad_val=1)
    summary = fit(_cfg(tmp_path / "data", "data.max_skipped_fraction=0.5"), tmp_path / "run")
    assert summary["status"] == "completed"
    epochs, train_images, val_images = 2, 3 * GOOD_PER_CLASS + 2, 3 * GOOD_PER_CLASS + 1
    saved = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert saved["skipped_images"] == {"train": 2 * epochs, "train_drawn": train_images * epochs,
                                       "val": 1, "val_scored": val_images - 1}
    rows = _rows(tmp_path / "run")
    # every epoch's row holds the run's training skips so far; every validation row its own skips
    assert [r["data/train_skipped"] for r in rows if "data/train_drawn" in r] == [2, 4]
    assert [r["data/train_drawn"] for r in rows if "data/train_drawn" in r] == [train_images, 2 * train_images]
    assert [r["val/skipped"] for r in rows if "val/skipped" in r] == [1, 1]
    assert exit_code(summary) == 0


def test_more_skips_than_the_limit_fail_with_status_bad_data(tmp_path):
    _folder(tmp_path / "data", bad_train=2, bad_val=0)  # 2 of 14: 14%, over the default 1%
    summary = fit(_cfg(tmp_path / "data"), tmp_path / "run")
    assert summary["status"] == "bad_data"
    assert "data.max_skipped_fraction=0.01" in summary["data_failure"] and "2 of the 14 training" in summary["data_failure"]
    assert exit_code(summary) == 4 and exit_code(summary, multirun=True) == 4


def test_validation_skips_over_the_limit_fail(tmp_path):
    _folder(tmp_path / "data", bad_train=0, bad_val=3)
    summary = fit(_cfg(tmp_path / "data", "data.max_skipped_fraction=0.1"), tmp_path / "run")
    assert summary["status"] == "bad_data" and "validation" in summary["data_failure"]


@pytest.mark.parametrize("limit", ["0.01", "1.0"])
def test_a_run_with_no_readable_training_image_fails(tmp_path, limit):
    # the example: every training image unreadable ended "completed ... after 0 steps", exit 0
    _folder(tmp_path / "data", bad_train=0, bad_val=0, all_train_bad=True)
    summary = fit(_cfg(tmp_path / "data", f"data.max_skipped_fraction={limit}", batch=4), tmp_path / "run")
    assert summary["status"] == "bad_data" and summary["step"] == 0
    assert exit_code(summary) == 4
