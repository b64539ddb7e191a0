"""The shard pre-flight: a tar shard cut short, not a tar, or at odds with _info.json, and every sample without a
label or with one outside the classes, is named (shard and member) before the first step (docs/data.md)."""
from __future__ import annotations

import atexit
import functools
import io
import json
import shutil
import tarfile
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from quest.data.shard_index import ShardError
from quest.data.shard_preflight import END_OF_ARCHIVE, check_shard_split
from quest.tools.make_shards import convert_image_folder
from quest.train import fit

from ..helpers import compose_cfg

SHARD = "toy-train-0001.tar"  # the shard each case damages (of 3: 4 + 4 + 2 samples)


def make_shards(tmp: Path) -> Path:
    """An image folder of 3 classes written to shards by quest's own converter (4 samples a shard)."""
    src = tmp / "folder"
    for split, count in (("train", 10), ("val", 3)):
        for i in range(count):
            d = src / split / f"c{i % 3}"
            d.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (8, 8), (i * 20, 0, 0)).save(d / f"img{i}.png")
    out = tmp / "wds"
    convert_image_folder(src, out, [("train", "train"), ("val", "validation")], name="toy", shard_size=4)
    return out


def _rewrite(shard: Path, edit) -> str:
    """Rewrite ``shard`` member by member; ``edit(name, payload)`` returns the new payload or None to drop it.
    Returns the first member name the edit changed."""
    with tarfile.open(shard) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    changed = []
    with tarfile.open(shard, "w") as tar:
        for name, payload in members:
            new = edit(name, payload)
            if new != payload:
                changed.append(name)
            if new is not None:
                info = tarfile.TarInfo(name)
                info.size = len(new)
                tar.addfile(info, io.BytesIO(new))
    return changed[0]


def _damage(root: Path, kind: str) -> str:
    """Damage shard SHARD of ``root`` in one way; returns the text the report must name besides the shard."""
    shard = root / SHARD
    data = shard.read_bytes()
    if kind == "truncated":
        shard.write_bytes(data[: len(data) // 3])
        return "cut short"
    if kind == "garbage":
        shard.write_bytes(bytes(range(256)) * 8)
        return "not a tar file"
    if kind == "empty":
        shard.write_bytes(b"")
        return "empty file"
    if kind == "info_count":  # _info.json consistent with itself, not with the shard
        info = json.loads((root / "_info.json").read_text())
        split = info["splits"]["train"]
        split["shard_lengths"][1] += 1
        split["num_samples"] += 1
        (root / "_info.json").write_text(json.dumps(info))
        return "holds 4 samples, but _info.json says 5"
    if kind == "info_filename":
        info = json.loads((root / "_info.json").read_text())
        info["splits"]["train"]["filenames"][1] = "toy-train-9999.tar"
        (root / "_info.json").write_text(json.dumps(info))
        return "toy-train-9999.tar: listed in _info.json but does not exist"
    seen: set[str] = set()

    def first_cls(new):
        def edit(name, payload):
            if name.endswith(".cls") and not seen:
                seen.add(name)
                return new
            return payload
        return edit

    if kind == "missing_cls":
        member = _rewrite(shard, first_cls(None))
        return f"{member[:-4]}: no .cls label"
    if kind == "label_out_of_range":
        member = _rewrite(shard, first_cls(b"3"))
        return f"{member}: label 3 is outside the classes 0..2"
    if kind == "label_not_a_number":
        member = _rewrite(shard, first_cls(b"cat"))
        return f"{member}: label b'cat' is not a class index"
    raise AssertionError(kind)


KINDS = ["truncated", "garbage", "empty", "info_count", "info_filename", "missing_cls", "label_out_of_range",
         "label_not_a_number"]


@pytest.mark.parametrize("kind", KINDS)
def test_every_problem_kind_is_named_before_the_first_step(tmp_path, kind):
    root = make_shards(tmp_path)
    assert check_shard_split(root, "train", 3, workers=1).problems == []  # the converter's shards are whole
    expected = _damage(root, kind)
    args = ["data=imagenet_wds", f"data.root={root}", "data.num_classes=3", "data.img_size=16", "data.batch_size=2",
            "data.num_workers=0", "model=vit_pico", "recipe=light", "trainer.epochs=1", "trainer.device=cpu"]
    with pytest.raises(ShardError) as info:
        fit(compose_cfg(*args), tmp_path / "run")
    message = str(info.value)
    assert "data pre-flight" in message and expected in message
    if kind != "info_filename":
        assert f"{root / SHARD}" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # not one step taken


def test_parallel_workers_report_what_one_process_reports(tmp_path):
    root = make_shards(tmp_path)
    _damage(root, "label_out_of_range")
    (root / "toy-train-0002.tar").write_bytes(b"junk" * 200)
    one, two = (check_shard_split(root, "train", 3, workers=w) for w in (1, 2))
    assert one.problems == two.problems and one.images == two.images == 8
    assert [Path(p.path.split(":")[0]).name for p in one.problems] == [SHARD, "toy-train-0002.tar"]


@functools.lru_cache(maxsize=1)
def _whole_shard() -> tuple[Path, bytes, int]:
    """Shards made once for every example: (root, the bytes of SHARD, where its end-of-archive blocks end)."""
    base = Path(tempfile.mkdtemp(prefix="quest-shard-cut-"))
    atexit.register(shutil.rmtree, base, ignore_errors=True)
    root = make_shards(base)
    with tarfile.open(root / SHARD) as tar:
        for _ in tar:
            pass
        end = tar.offset + END_OF_ARCHIVE  # the last byte that matters: the end of the end-of-archive blocks
    return root, (root / SHARD).read_bytes(), end


@settings(max_examples=60, deadline=None)
@given(fraction=st.floats(min_value=0, max_value=1, exclude_max=True))
def test_a_shard_cut_at_any_byte_is_named_unless_only_padding_is_lost(fraction):
    whole_root, whole, end = _whole_shard()
    cut = int(fraction * len(whole))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "wds"
        shutil.copytree(whole_root, root)
        (root / SHARD).write_bytes(whole[:cut])
        report = check_shard_split(root, "train", 3, workers=1)
    named = [p for p in report.problems if p.path.startswith(str(root / SHARD))]
    if cut < end:
        assert named, f"a cut at byte {cut} of {len(whole)} went unnoticed"
        assert any(w in named[0].reason for w in ("cut short", "empty file", "not a tar file", "no .cls label")), named
    else:  # only the zero padding of the last tar record is gone: every member and the end blocks are there
        assert report.problems == [] and report.images == 10
