"""Which entries of an image folder are data (quest/data/entries.py, docs/data.md "Which entries are data"): every
reader of an image folder (the training data set, the pre-flight, ``quest-data check``, make_shards, ``quest-data
cap``, the evaluation folders) x every kind of entry that is not data (names starting with '.') or cannot be a class
(class folders that are the same place), and the one rule for an image shared by the data set and its pre-flight."""
from __future__ import annotations

import io
import json
import os
import tarfile
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS

from quest.data.entries import LayoutError
from quest.data.folder import SafeImageFolder
from quest.data.preflight import check_image_folder_files, folder_files
from quest.evaluation.imagenet_data import imagenet_wnids, real_files, v2_samples, wnid_samples
from quest.tools.data_check import check_root

IMAGES_PER_CLASS = 2


def _png(path: Path, shade: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), (shade, 40, 80)).save(path, format="PNG")


def _split(root: Path, classes: list[str]) -> Path:
    for c in classes:
        for i in range(IMAGES_PER_CLASS):
            _png(root / c / f"img{i}.png", 30 * i)
    return root


# --- the readers: each gives {class name: images it reads} of a split folder ----------------------------------------
def _training(split: Path, tmp: Path) -> dict[str, int]:
    ds = SafeImageFolder(split)
    return dict(Counter(ds.classes[t] for _, t in ds.samples))


def _preflight(split: Path, tmp: Path) -> dict[str, int]:
    report = check_image_folder_files(split, workers=1, use_cache=False)
    usable = [f for f in folder_files(split) if str(f) not in report.bad_paths()]
    assert report.images == len(usable) and not report.problems, report.describe()
    return dict(Counter(f.relative_to(split).parts[0] for f in usable))


def _check(split: Path, tmp: Path) -> dict[str, int]:
    out, err = io.StringIO(), io.StringIO()
    code = check_root(split, workers=1, use_cache=False, progress=False, out=out, err=err)
    if code == 2:
        raise LayoutError(err.getvalue())
    assert code == 0, out.getvalue()
    return {"*": int(out.getvalue().split(": ", 1)[1].split(" ", 1)[0])}  # "<split>: N usable images, ..."


def _make_shards(split: Path, tmp: Path) -> dict[str, int]:
    from quest.tools.make_shards import convert_image_folder

    out = tmp / "shards"
    try:
        convert_image_folder(split.parent, out, [(split.name, "train")])
    except LayoutError:
        assert not out.exists()  # refused before the first shard
        raise
    classes = json.loads((out / "_info.json").read_text())["classes"]
    labels: Counter = Counter()
    for shard in out.glob("*.tar"):
        with tarfile.open(shard) as tar:
            labels.update(classes[int(tar.extractfile(m).read())] for m in tar if m.name.endswith(".cls"))
    return dict(labels)


def _cap(split: Path, tmp: Path) -> dict[str, int]:
    from quest.tools.capped import cap_folder

    dst = tmp / "capped"
    try:
        cap_folder(split.parent, dst, short_side=16, splits=[split.name])
    except LayoutError:
        assert not dst.exists()  # refused before the copy was begun
        raise
    return {c.name: len(list(c.iterdir())) for c in sorted((dst / split.name).iterdir())}


def _eval_wnids(split: Path, tmp: Path) -> dict[str, int]:
    return dict(Counter(imagenet_wnids()[t] for _, t in wnid_samples(split, imagenet_wnids(), "val", "t")))


def _eval_v2(split: Path, tmp: Path) -> dict[str, int]:
    return dict(Counter(str(t) for _, t in v2_samples(split, "t")))


def _eval_real(split: Path, tmp: Path) -> dict[str, int]:
    return {"*": len(real_files(split, "t"))}


@dataclass(frozen=True)
class Reader:
    read: Callable[[Path, Path], dict[str, int]]
    classes: tuple[str, ...]  # three class names the reader accepts; the third becomes the bad one


WNIDS = tuple(imagenet_wnids()[:3])
READERS = {
    "training image folder": Reader(_training, ("cat", "dog", "eel")),
    "pre-flight": Reader(_preflight, ("cat", "dog", "eel")),
    "quest-data check": Reader(_check, ("cat", "dog", "eel")),
    "make_shards convert": Reader(_make_shards, ("cat", "dog", "eel")),
    "quest-data cap": Reader(_cap, ("cat", "dog", "eel")),
    "evaluation wnid folders": Reader(_eval_wnids, WNIDS),
    "evaluation v2 folders": Reader(_eval_v2, ("0", "1", "2")),
    "evaluation real": Reader(_eval_real, WNIDS),
}


def _hidden_entries(split: Path, classes: tuple[str, ...]) -> None:
    """Everything whose name starts with '.', and valid images all of them: none may count."""
    (split / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    _png(split / ".ipynb_checkpoints" / "img0-checkpoint.png")  # a folder of images beside the classes
    _png(split / classes[0] / ".ipynb_checkpoints" / "img0-checkpoint.png")  # inside a class
    _png(split / classes[0] / "._img0.png")  # macOS's AppleDouble file, an image name
    (split / classes[1] / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")


# the kinds of class folder that are another's images: (what the third class folder is, how to make it)
SAME_PLACE = {
    "a link to another class": lambda split, c: (split / c[2]).symlink_to(c[0]),
    "a link to the split itself": lambda split, c: (split / c[2]).symlink_to("."),
    "a link inside another class": lambda split, c: (_png(split / c[0] / "sub" / "x.png"),
                                                     (split / c[2]).symlink_to(Path(c[0]) / "sub")),
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_entries_named_with_a_dot_are_never_classes_or_images(tmp_path, reader):
    spec = READERS[reader]
    classes = list(spec.classes[:2])
    clean = spec.read(_split(tmp_path / "a" / "data" / "train", classes), tmp_path / "a")
    expected = {c: IMAGES_PER_CLASS for c in classes}
    assert clean == (expected if "*" not in clean else {"*": sum(expected.values())})
    split = _split(tmp_path / "b" / "data" / "train", classes)
    _hidden_entries(split, spec.classes)
    assert spec.read(split, tmp_path / "b") == clean


@pytest.mark.parametrize("kind", sorted(SAME_PLACE))
@pytest.mark.parametrize("reader", sorted(READERS))
def test_class_folders_that_are_the_same_place_are_refused_naming_both(tmp_path, reader, kind):
    spec = READERS[reader]
    split = _split(tmp_path / "data" / "train", list(spec.classes[:2]))
    SAME_PLACE[kind](split, spec.classes)
    with pytest.raises(LayoutError) as refused:
        spec.read(split, tmp_path)
    message = str(refused.value)
    assert str(split / spec.classes[2]) in message
    assert str(split / spec.classes[0]) in message or "split folder" in message


def test_a_class_folder_of_no_image_is_refused_by_the_data_set_and_the_preflight_alike(tmp_path):
    split = _split(tmp_path / "train", ["cat", "dog"])
    (split / "eel").mkdir()
    (split / "eel" / "notes.txt").write_text("no pixels")
    for read in (SafeImageFolder, folder_files):
        with pytest.raises(LayoutError, match=r"eel holds 1 file\(s\) and none is an image"):
            read(split)


def _animated_gif(path: Path) -> None:
    frames = [Image.new("P", (8, 8), i) for i in range(3)]
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=50, loop=0)


def test_an_animated_gif_is_named_by_the_preflight_as_never_read(tmp_path):
    """Pillow decodes it, ImageFolder never lists it: the pre-flight counts only what the data set reads."""
    split = _split(tmp_path / "train", ["cat", "dog"])
    _animated_gif(split / "cat" / "moving.gif")
    report = check_image_folder_files(split, workers=1, use_cache=False)
    assert report.images == len(SafeImageFolder(split).samples) == 2 * IMAGES_PER_CLASS
    assert [(Path(p.path).name, p.reason.startswith("not read by the data set: .gif")) for p in report.problems] == [
        ("moving.gif", True)]


# --- the one rule, as a property: any tree of names, the data set's images are the pre-flight's usable files -----
NAME = st.sampled_from(["a", "a-b", "b", ".h", "._a", "x.y"])  # 'a-b' sorts between 'a' and 'a/...'
EXT = st.sampled_from([".png", ".PNG", ".jpg", ".JPEG", ".gif", ".txt", ".webp", ""])
ENTRY = st.tuples(st.sampled_from(["cat", "dog"]), st.lists(NAME, max_size=2), NAME, EXT)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ENTRY, max_size=8))
@example([("cat", ["a", "b"], "b", ".png"), ("cat", ["a-b"], "b", ".png")])  # walk order != torchvision's sort
def test_the_data_set_reads_exactly_what_the_preflight_counts_usable(entries):
    with tempfile.TemporaryDirectory() as tmp:
        split = _split(Path(tmp) / "train", ["cat", "dog"])
        for cls, folders, stem, ext in entries:
            path = split.joinpath(cls, *folders, stem + ext)
            if not path.exists() and not any(p.is_file() for p in path.parents):
                _png(path)  # PNG bytes whatever the name: Pillow decodes every one of them
        # the reference, from the names alone: visible at every depth, an extension torchvision's ImageFolder reads
        every = [p for p in split.rglob("*") if p.is_file()]
        visible = {p for p in every if not any(part.startswith(".") for part in p.relative_to(split).parts)}
        images = {str(p) for p in visible if p.suffix.lower() in IMG_EXTENSIONS}
        # torchvision's ImageFolder told the reference, for the order: the same samples in the same order
        told = ImageFolder(str(split), is_valid_file=lambda path: path in images).samples
        assert SafeImageFolder(split).samples == told and {path for path, _ in told} == images
        report = check_image_folder_files(split, workers=1, use_cache=False)
        assert report.images == len(images)
        assert report.bad_paths() == {str(p) for p in visible} - images


def test_quest_data_check_of_a_folder_that_is_not_a_data_set_says_so_before_walking_it(tmp_path, monkeypatch):
    """Bounded work: one listing per top-level folder, no walk, when one of them holds files and no image."""
    import quest.data.entries as entries

    def no_walk(*args, **kwargs):
        raise AssertionError("the tree was walked before the verdict")

    monkeypatch.setattr(entries.os, "walk", no_walk)
    fake = tmp_path / "usr"
    for name in ("ls", "cat", "python3"):
        (fake / "bin" / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / "bin" / name).write_bytes(b"\x7fELF")
    _png(fake / "share" / "icons" / "a.png")
    roots = [fake] + ([tmp_path / "link"] if Path("/usr/bin").is_dir() else [])
    if len(roots) > 1:
        os.symlink("/usr", roots[1])
    for root in roots:
        out, err = io.StringIO(), io.StringIO()
        assert check_root(root, workers=1, progress=False, out=out, err=err) == 2
        assert "is neither an image folder" in err.getvalue() and "none is an image" in err.getvalue()
        assert out.getvalue() == ""


@pytest.mark.parametrize("kind", ["a linked duplicate class", "a class of files and no image"])
def test_a_training_start_refuses_the_layout_in_its_checks_before_any_work(tmp_path, kind):
    """The start's checks (quest.train.checks, which list directories only) name the bad class folder."""
    from quest.train.checks import check_train_config

    from ..helpers import compose_cfg

    for split in ("train", "val"):
        _split(tmp_path / "data" / split, ["cat", "dog"])
    if kind == "a linked duplicate class":
        (tmp_path / "data" / "val" / "eel").symlink_to("cat")
        _png(tmp_path / "data" / "train" / "eel" / "x.png")
        match = r"class folders .*val/cat and .*val/eel are the same images"
    else:
        (tmp_path / "data" / "train" / "eel").mkdir()
        (tmp_path / "data" / "train" / "eel" / "notes.txt").write_text("no pixels")
        match = r"train/eel holds 1 file\(s\) and none is an image"
    cfg = compose_cfg("data=imagefolder", f"data.root={tmp_path / 'data'}", "data.num_classes=3")
    with pytest.raises(LayoutError, match=match):
        check_train_config(cfg)
