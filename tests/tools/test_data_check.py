"""``quest-data check ROOT``: the data pre-flight on its own, on image folders and shard directories, run as a
console script (docs/data.md)."""
from __future__ import annotations

import os
import re
import subprocess
import tomllib
from pathlib import Path

from PIL import Image

from ..data.test_shard_preflight import SHARD, _damage, make_shards
from ..helpers import ROOT
from ..warm import APPS, run_app


def _quest_data(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """``quest-data`` (quest.cli:data) as a command: exit status, stdout and stderr (the progress bar) of a process
    of its own, forked from the warm zygote; its worker processes fork that process, not pytest's."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "XDG_CACHE_HOME": str(tmp_path / "cache")}
    return run_app("quest.tools.data_check", *args, cwd=tmp_path, env=env, timeout=300)


def test_the_warm_app_is_the_console_script():
    """What _quest_data runs is what pyproject.toml installs as quest-data."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["quest-data"] == ":".join(APPS["quest.tools.data_check"]) == "quest_cli:data"


def _folder(root: Path, splits=("train", "val")) -> Path:
    for split in splits:
        for c in ("cat", "dog"):
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (10, 10), (i * 50, 0, 0)).save(d / f"{i}.png")
    return root


def _counts(stdout: str) -> dict[str, int]:
    """The per-reason lines: '       2  empty file' -> {'empty file': 2}."""
    return {m.group(2): int(m.group(1)) for m in re.finditer(r"^ +(\d+)  (\S.*)$", stdout, re.M)}


def test_a_clean_image_folder_exits_0_with_a_progress_bar(tmp_path):
    root = _folder(tmp_path / "data")
    out = _quest_data(tmp_path, "check", str(root), "--workers", "1")
    assert out.returncode == 0, out.stderr
    assert "train: 6 usable images, 0 problem(s)" in out.stdout and "val: 6 usable images, 0 problem(s)" in out.stdout
    assert out.stdout.rstrip().endswith(f"{root}: clean")
    assert "6/6" in out.stderr  # the progress bar (tqdm) or the counter line
    again = _quest_data(tmp_path, "check", str(root))  # the cache of the first run answers
    assert again.returncode == 0 and "(cached result)" in again.stdout


def test_an_image_folder_with_problems_exits_1_counting_each_reason(tmp_path):
    root = _folder(tmp_path / "data")
    (root / "train" / "cat" / "empty.png").write_bytes(b"")
    (root / "train" / "dog" / "empty.jpg").write_bytes(b"")
    (root / "val" / "dog" / "notes.png").write_bytes(b"not pixels")
    out = _quest_data(tmp_path, "check", str(root), "--no-progress")
    assert out.returncode == 1, out.stderr
    assert _counts(out.stdout) == {"empty file": 2, "not an image Pillow can open": 1}
    for name in ("train/cat/empty.png", "train/dog/empty.jpg", "val/dog/notes.png"):
        assert name in out.stdout
    assert out.stdout.rstrip().endswith("3 problem(s)") and out.stderr == ""
    split = _quest_data(tmp_path, "check", str(root / "val"), "--no-progress")  # one split folder
    assert split.returncode == 1 and "val: 6 usable images, 1 problem(s)" in split.stdout


def test_shard_directories(tmp_path):
    root = make_shards(tmp_path)
    out = _quest_data(tmp_path, "check", str(root))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "shards train: 10 samples" in out.stdout and "shards validation: 3 samples" in out.stdout
    _damage(root, "label_out_of_range")
    (root / "toy-train-0002.tar").write_bytes((root / "toy-train-0002.tar").read_bytes()[:700])  # inside the first image
    (root / "stray.tar").write_bytes(b"")
    out = _quest_data(tmp_path, "check", str(root), "--no-progress")
    assert out.returncode == 1
    assert _counts(out.stdout) == {"bad label": 1, "cut short": 1, "a tar file no split of _info.json lists": 1}
    assert f"{root / SHARD}:" in out.stdout and "stray.tar" in out.stdout


def test_not_a_data_set_exits_2(tmp_path):
    (tmp_path / "flat").mkdir()
    (tmp_path / "flat" / "a.png").write_bytes(b"")
    for target in (tmp_path / "flat", tmp_path / "missing"):
        out = _quest_data(tmp_path, "check", str(target))
        assert out.returncode == 2 and "quest-data check:" in out.stderr
