"""The image-folder pre-flight: every file under a data root is a usable image or is reported with its reason
before the first step (docs/data.md)."""
from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from quest.data.folder import CorruptImageError
from quest.data.preflight import check_image_folder_files
from quest.train import fit
from tests.helpers import compose_cfg


def _png(mode: str = "RGB", **kw) -> bytes:
    buf = io.BytesIO()
    if mode == "noise":
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, format="PNG")
    elif mode == "I;16":
        Image.fromarray(np.full((12, 12), 4000, dtype=np.uint16)).save(buf, format="PNG")
    else:
        Image.new(mode, (12, 12), **kw).save(buf, format="PNG")
    return buf.getvalue()


# problem kind -> (file content, reason the report must give)
PROBLEMS = {
    "empty": (b"", "empty file"),
    "truncated": (_png("noise")[:6000], "undecodable"),  # cut inside the pixel data
    "not_an_image": (b"class notes, not pixels\n", "not an image"),
    "sixteen_bit": (_png("I;16"), "image mode 'I;16'"),
}
GOOD_MODES = ["RGB", "L", "P", "RGBA", "LA", "1", "CMYK"]


def _root(tmp: Path, bad: dict[str, bytes]) -> Path:
    for split in ("train", "val"):
        for c in range(2):
            d = tmp / split / f"c{c}"
            d.mkdir(parents=True)
            for i, mode in enumerate(GOOD_MODES):
                img = Image.new(mode, (12, 12))
                img.save(d / f"ok{i}.{'jpg' if mode == 'CMYK' else 'png'}")
    for name, content in bad.items():
        (tmp / "train" / "c1" / name).write_bytes(content)
    return tmp


@pytest.mark.parametrize("kind", sorted(PROBLEMS))
def test_every_problem_kind_is_reported_with_its_reason(tmp_path, kind):
    content, reason = PROBLEMS[kind]
    root = _root(tmp_path, {f"{kind}.png": content})
    report = check_image_folder_files(root / "train", workers=1, use_cache=False)
    assert [(Path(p.path).name, reason in p.reason) for p in report.problems] == [(f"{kind}.png", True)]
    assert report.images == 2 * len(GOOD_MODES)


@pytest.mark.unprivileged
def test_permission_denied_is_named(tmp_path):
    root = _root(tmp_path, {"locked.png": _png()})
    (root / "train" / "c1" / "locked.png").chmod(0)
    report = check_image_folder_files(root / "train", workers=1, use_cache=False)
    assert [(Path(p.path).name, "unreadable" in p.reason) for p in report.problems] == [("locked.png", True)]


def test_parallel_workers_and_the_cache_agree(tmp_path):
    root = _root(tmp_path, {f"{k}{i}.png": c for k, (c, _) in PROBLEMS.items() for i in range(20)})
    first = check_image_folder_files(root / "train", workers=2)
    assert not first.cached and len(first.problems) == 4 * 20
    again = check_image_folder_files(root / "train", workers=2)
    assert again.cached and again.problems == first.problems and again.images == first.images
    (root / "train" / "c0" / "late.png").write_bytes(b"")  # a changed folder is checked again
    third = check_image_folder_files(root / "train", workers=2)
    assert not third.cached and len(third.problems) == 81


def test_a_run_is_refused_before_the_first_step_naming_every_bad_file(tmp_path):
    root = _root(tmp_path / "data", {f"{k}.png": c for k, (c, _) in PROBLEMS.items()})
    base = ["data=imagefolder", f"data.root={root}", "data.num_classes=2", "data.img_size=16", "data.batch_size=4",
            "model=vit_pico", "trainer.epochs=1", "trainer.device=cpu"]
    with pytest.raises(CorruptImageError) as info:
        fit(compose_cfg(*base), tmp_path / "run")
    assert all(f"{k}.png" in str(info.value) for k in PROBLEMS)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    with pytest.raises(CorruptImageError, match="max_skipped_fraction"):  # 4 of 18: over the default 1%
        fit(compose_cfg(*base, "data.bad_images=skip"), tmp_path / "run2")
    summary = fit(compose_cfg(*base, "data.bad_images=skip", "data.max_skipped_fraction=0.5"), tmp_path / "run3")
    assert summary["status"] == "completed"
    # the files left out are on the record: summary.json, the first metrics row, the log
    left = summary["left_out_by_preflight"]
    assert set(left) == {"train"} and left["train"]["files"] == len(PROBLEMS) and left["train"]["of"] == 18
    assert sum(left["train"]["by_reason"].values()) == len(PROBLEMS)
    assert {Path(p).name for p in left["train"]["first"]} == {f"{k}.png" for k in PROBLEMS}
    first_row = json.loads((tmp_path / "run3" / "metrics.jsonl").read_text().splitlines()[0])
    assert first_row["data/preflight_left_out/train"] == len(PROBLEMS)
    log = (tmp_path / "run3" / "train.log").read_text()
    assert f"data pre-flight: {len(PROBLEMS)} of the 18 files of the train split" in log and "left out" in log
