"""quest-data cap: a resolution-capped copy of an image folder or a shard directory (docs/data.md, "Resolution-capped
storage"): the pixels against PIL written out here, small images copied byte for byte, unreadable files reported,
other splits linked, and a run on the copy labelled as such. Interruptions and reruns after the source changed:
tests/tools/test_data_tools_rerun.py."""
from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from PIL import Image

from quest.store.tool_records import CAPPED_INFO, read_capped
from quest.tools.capped import cap_folder, cap_image, cap_shards
from quest.tools.data_check import main as quest_data


def _photo(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    base = np.stack([np.sin(xx / rng.uniform(8, 30) + yy / rng.uniform(10, 40)) * 90 + 128 for _ in range(3)], -1)
    return Image.fromarray(np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8))


def _folder(root: Path, corrupt: bool = False) -> Path:
    """train/ and val/, 2 classes: 160 x 120 JPEGs (capped at 64 -> 85 x 64), a 50 x 40 PNG (kept), maybe a broken file."""
    for split in ("train", "val"):
        for c in range(2):
            d = root / split / f"c{c}"
            d.mkdir(parents=True)
            for i in range(3):
                _photo(160, 120, 10 * c + i).save(d / f"big{i}.JPEG", quality=95)
            _photo(50, 40, 99 + c).save(d / "small.png")
    if corrupt:
        (root / "train" / "c1" / "broken.JPEG").write_bytes(b"not a jpeg at all")
    return root


def _decoded(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB")).astype(np.int16)


def test_an_image_above_the_cap_is_resized_with_pil_s_bicubic_and_one_below_is_kept_byte_for_byte():
    img = _photo(160, 120, 0)
    buf = io.BytesIO()
    img.save(buf, "PNG")
    payload, resized = cap_image(buf.getvalue(), 64, 90)
    assert resized
    out = Image.open(io.BytesIO(payload))
    assert out.format == "JPEG" and out.size == (85, 64)  # 160 * 64 / 120 = 85.3
    reference = io.BytesIO()  # the conversion written out: PIL's bicubic to short side 64, JPEG quality 90
    img.resize((85, 64), Image.Resampling.BICUBIC).save(reference, "JPEG", quality=90)
    assert payload == reference.getvalue()
    other = io.BytesIO()  # the comparison sees another resampling
    img.resize((85, 64), Image.Resampling.BILINEAR).save(other, "JPEG", quality=90)
    assert payload != other.getvalue()
    portrait = io.BytesIO()
    _photo(90, 200, 1).save(portrait, "JPEG", quality=95)
    assert Image.open(io.BytesIO(cap_image(portrait.getvalue(), 64, 90)[0])).size == (64, 142)
    assert cap_image(buf.getvalue(), 120, 90) == (buf.getvalue(), False)  # short side 120 <= 120: unchanged
    with pytest.raises(ValueError, match="not a readable image"):
        cap_image(b"not an image", 64, 90)


def test_the_copy_caps_train_links_val_names_unreadable_files_and_writes_its_record_last(tmp_path):
    src = _folder(tmp_path / "src", corrupt=True)
    capped = cap_folder(src, tmp_path / "dst", 64, quality=90)
    dst = tmp_path / "dst"
    assert (dst / "val").is_symlink() and (dst / "val").resolve() == (src / "val").resolve()
    for c in ("c0", "c1"):
        assert Image.open(dst / "train" / c / "big0.JPEG").size == (85, 64)
        assert (dst / "train" / c / "small.png").read_bytes() == (src / "train" / c / "small.png").read_bytes()
    assert not (dst / "train" / "c1" / "broken.JPEG").exists()
    assert capped["splits"]["train"]["images"] == 8
    assert list(capped["splits"]["train"]["unreadable"]) == [str(src.resolve() / "train" / "c1" / "broken.JPEG")]
    assert capped.pop("this_run") == {"kept": 0, "written": 8, "removed": 0, "moved": 0}
    assert read_capped(dst) == json.loads((dst / CAPPED_INFO).read_text()) == capped
    assert capped["short_side"] == 64 and capped["quality"] == 90 and capped["linked"] == ["val"]


@pytest.mark.timeout(120)  # a FIFO read would block for ever
def test_a_fifo_or_a_link_that_leads_nowhere_among_the_images_is_left_out_naming_why(tmp_path):
    src = _folder(tmp_path / "src")
    os.mkfifo(src / "train" / "c0" / "pipe.png")
    (src / "train" / "c1" / "gone.JPEG").symlink_to(tmp_path / "nowhere.JPEG")
    capped = cap_folder(src, tmp_path / "dst", 64, quality=90)
    root = src.resolve() / "train"
    assert capped["splits"]["train"] == {"images": 8, "unreadable": {
        str(root / "c0" / "pipe.png"): "not a regular file", str(root / "c1" / "gone.JPEG"): "a link that leads nowhere"}}
    assert sorted(p.name for p in (tmp_path / "dst" / "train" / "c0").iterdir()) == ["big0.JPEG", "big1.JPEG",
                                                                                     "big2.JPEG", "small.png"]


def test_the_cli_reports_and_refuses_with_exit_codes(tmp_path, capsys):
    src = _folder(tmp_path / "src")
    assert quest_data(["cap", str(src), str(tmp_path / "dst"), "--short-side", "64", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "train: 8 images capped at short side 64" in out and f"{tmp_path / 'dst'}: complete" in out
    assert "this run: 8 written, 0 removed, 0 kept" in out
    (src / "train" / "c0" / "big0.JPEG").unlink()
    assert quest_data(["cap", str(src), str(tmp_path / "dst"), "--short-side", "64", "--no-progress"]) == 0
    assert "this run: 0 written, 1 removed, 7 kept from an earlier run" in capsys.readouterr().out
    assert quest_data(["cap", str(src), str(tmp_path / "dst"), "--short-side", "96", "--no-progress"]) == 2
    assert "capped at short side 64, quality 90; a different cap needs another folder" in capsys.readouterr().err
    assert quest_data(["cap", str(src), str(src / "inside"), "--short-side", "64", "--no-progress"]) == 2
    assert "must not lie inside its source" in capsys.readouterr().err
    assert quest_data(["cap", str(src), str(tmp_path / "d2"), "--short-side", "64", "--split", "test"]) == 2
    assert "has no split folder 'test'" in capsys.readouterr().err
    (src / "train" / "c0" / "broken.JPEG").write_bytes(b"nope")
    assert quest_data(["cap", str(src), str(tmp_path / "d3"), "--short-side", "64", "--no-progress"]) == 1
    assert "1 unreadable (left out)" in capsys.readouterr().out


def test_shards_are_capped_under_the_same_names_and_read_back(tmp_path):
    from quest.data.shard_index import resolve_shards
    from quest.data.shards import WdsDataset
    from quest.tools.make_shards import convert_image_folder

    convert_image_folder(_folder(tmp_path / "src"), tmp_path / "shards", [("train", "train"), ("val", "val")],
                         shard_size=3)
    capped = cap_shards(tmp_path / "shards", tmp_path / "capped", 64)
    assert capped["splits"] == {"train": {"shards": 3}} and capped["linked"] == ["val"]
    before = WdsDataset(resolve_shards(tmp_path / "shards", "train"), train=False, num_classes=2)
    after = WdsDataset(resolve_shards(tmp_path / "capped", "train"), train=False, num_classes=2)
    pairs = list(zip(before, after))
    assert len(pairs) == 8
    for (img_a, label_a), (img_b, label_b) in pairs:
        assert label_a == label_b
        expected = img_a.size if min(img_a.size) <= 64 else (85, 64)
        assert img_b.size == expected
    with tarfile.open(next((tmp_path / "capped").glob("*train*.tar"))) as tar:
        assert all(m.name.endswith((".jpg", ".png", ".cls")) for m in tar)
    assert all(p.is_symlink() for p in (tmp_path / "capped").glob("*val*.tar"))


def test_a_run_on_a_capped_copy_says_so(tmp_path):
    from quest.train import fit

    from ..helpers import compose_cfg

    cap_folder(_folder(tmp_path / "src"), tmp_path / "dst", 64)
    summary = fit(compose_cfg("data=imagefolder", f"data.root={tmp_path / 'dst'}", "data.num_classes=2",
                              "data.img_size=16", "data.batch_size=4", "data.num_workers=0", "model=vit_pico",
                              "trainer.epochs=1", "data.pipeline=split"), tmp_path / "run")
    assert summary["status"] == "completed"
    assert "storage: image folder capped at short side 64 (quest-data cap" in summary["train_input"]


def _replace_member(shard: Path, pick, payload: Callable[[bytes], bytes]) -> str:
    """Rewrite ``shard`` with the first image member that ``pick(name)`` selects holding ``payload(its bytes)``; its
    name."""
    with tarfile.open(shard) as tar:
        members = [(m, tar.extractfile(m).read()) for m in tar]
    name = next(m.name for m, _ in members if m.name.endswith(".jpg") and pick(m.name))
    with tarfile.open(shard, "w") as tar:
        for member, data in members:
            data = payload(data) if member.name == name else data
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return name


def test_a_shard_member_that_does_not_decode_is_named_with_its_shard_and_the_rerun_redoes_only_that_shard(
        tmp_path, capsys):
    from quest.tools.make_shards import convert_image_folder

    convert_image_folder(_folder(tmp_path / "src"), tmp_path / "shards", [("train", "train")], shard_size=3)
    shards = sorted((tmp_path / "shards").glob("*.tar"))
    kept = {p: p.read_bytes() for p in shards[:2]}
    garbage = _replace_member(shards[0], lambda n: True, lambda data: b"not an image")
    cut = _replace_member(shards[1], lambda n: "big" in n, lambda data: data[: len(data) // 2])  # above the cap
    argv = ["cap", str(tmp_path / "shards"), str(tmp_path / "dst"), "--short-side", "64", "--no-progress"]
    assert quest_data(argv) == 1  # some could not be read
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("quest-data cap: error: 2 shard(s) could not be capped: "), err
    assert f"{shards[0].resolve()}: member {garbage}: not a readable image" in err[0]
    assert f"{shards[1].resolve()}: member {cut}: not a readable image (image file is truncated" in err[0]
    assert "stays marked incomplete" in err[0]
    with pytest.raises(ValueError, match="complete: false"):  # nothing reads the unfinished copy
        read_capped(tmp_path / "dst")
    for shard, data in kept.items():  # the two shards fixed: the rerun redoes them, the third is kept
        shard.write_bytes(data)
    assert quest_data(argv) == 0
    assert "this run: 2 written, 0 removed, 1 kept from an earlier run" in capsys.readouterr().out


def test_a_damaged_shard_is_refused_in_one_line_naming_it_and_its_member_before_the_copy_is_begun(tmp_path, capsys):
    from quest.tools.make_shards import convert_image_folder

    convert_image_folder(_folder(tmp_path / "src"), tmp_path / "shards", [("train", "train")], shard_size=3)
    shard = sorted((tmp_path / "shards").glob("*.tar"))[0]
    with tarfile.open(shard) as tar:
        first, second = tar.getmembers()[:2]
    shard.write_bytes(shard.read_bytes()[: second.offset_data + 10])  # cut inside the second member's data
    assert quest_data(["cap", str(tmp_path / "shards"), str(tmp_path / "dst"), "--short-side", "64",
                       "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "found before anything was written" in err[0], err
    assert f"{shard.resolve()}: cut short or damaged after 0 samples, after member {second.name}" in err[0]
    assert not (tmp_path / "dst").exists()


@pytest.mark.parametrize("split", ["train", "val"])  # capped, or linked as it is
def test_a_shard_listed_in_info_but_missing_is_refused_before_the_copy_whichever_split(tmp_path, capsys, split):
    from quest.tools.make_shards import convert_image_folder

    convert_image_folder(_folder(tmp_path / "src"), tmp_path / "shards", [("train", "train"), ("val", "val")],
                         shard_size=3)
    gone = sorted((tmp_path / "shards").glob(f"*-{split}-*.tar"))[-1]
    gone.unlink()
    assert quest_data(["cap", str(tmp_path / "shards"), str(tmp_path / "dst"), "--short-side", "64",
                       "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lists shards that do not exist" in err[0] and gone.name in err[0], err
    assert not (tmp_path / "dst").exists()  # a link to the missing shard would have made a copy marked complete


def test_two_images_whose_capped_copies_would_share_a_name_are_refused_naming_both(tmp_path):
    src = _folder(tmp_path / "src")
    _photo(160, 120, 7).save(src / "train" / "c0" / "big0.png")  # big0.JPEG beside it: both would be big0.JPEG
    with pytest.raises(ValueError, match=r"big0\.JPEG and .*big0\.png share a name stem"):
        cap_folder(src, tmp_path / "dst", 64)
    assert not (tmp_path / "dst").exists()
