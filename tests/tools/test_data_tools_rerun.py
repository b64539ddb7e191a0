"""The resumable data tools follow their source (docs/data.md, "Running a data tool again"): ``quest-data cap`` of an
image folder or of shards, and ``make_shards convert``, interrupted after every number of outputs, with each fault a
kill leaves (a partial write, an output without its manifest line, a cut manifest line), then the source changed in each
way (an image modified, added, deleted, made unreadable, grown past the cap, a class removed), then run again: the
result equals a fresh run on today's source byte for byte, outputs whose source did not change are not rewritten,
what a kill left unrecorded is kept in ``.replaced/`` with its bytes (never deleted), and until the rerun ends the
folder says it is incomplete and readers refuse it."""
from __future__ import annotations

import itertools
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from quest.data.folder import CorruptImageError
from quest.data.shard_index import ShardError, resolve_shards
from quest.store.manifest import MANIFEST_NAME
from quest.store.tool_records import read_capped
from quest.tools.capped import cap_folder, cap_shards
from quest.tools.data_check import check_root
from quest.tools.make_shards import convert_image_folder

from ..tree_state import tree_state

CAP = 32  # the short side kept: a 48 x 40 image is resized, a 20 x 16 one copied byte for byte
CHANGES = ("none", "modify", "add", "delete", "unreadable", "grow", "drop class")
FAULTS = ("stop", "partial write", "unrecorded output", "cut manifest line")
_clock = itertools.count(1)


def _image(path: Path, size: tuple[int, int], seed: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    pixels = np.random.default_rng(seed).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(path, quality=90) if path.suffix == ".JPEG" else Image.fromarray(pixels).save(path)
    tick = 1_700_000_000_000_000_000 + next(_clock) * 1_000_000_000  # a new mtime for every write, whatever the clock
    os.utime(path, ns=(tick, tick))


def _source(root: Path) -> Path:
    """train: c0 = two big JPEGs and a small PNG, c1 = a big JPEG and a small PNG; val: one image per class."""
    _image(root / "train/c0/a.JPEG", (48, 40), 1)
    _image(root / "train/c0/b.JPEG", (48, 40), 2)
    _image(root / "train/c0/s.png", (20, 16), 3)
    _image(root / "train/c1/a.JPEG", (48, 40), 4)
    _image(root / "train/c1/s.png", (20, 16), 5)
    for c in ("c0", "c1"):
        _image(root / f"val/{c}/v.JPEG", (48, 40), 6)
    return root


def _change(src: Path, change: str) -> set[str]:
    """Change the source; the training images (under train/) whose output may differ afterwards."""
    train = src / "train"
    if change == "modify":
        _image(train / "c0/a.JPEG", (48, 40), 11)
        return {"c0/a.JPEG"}
    if change == "add":
        _image(train / "c1/new.JPEG", (48, 40), 12)
        return {"c1/new.JPEG"}
    if change == "delete":
        (train / "c0/b.JPEG").unlink()
        return {"c0/b.JPEG"}
    if change == "unreadable":
        (train / "c1/a.JPEG").write_bytes(b"no longer an image")
        return {"c1/a.JPEG"}
    if change == "grow":  # a PNG under the cap grows past it: its output becomes s.JPEG, s.png must go
        _image(train / "c0/s.png", (48, 40), 13)
        return {"c0/s.png"}
    if change == "drop class":  # from every split: the shard conversion needs one class list
        shutil.rmtree(train / "c1")
        shutil.rmtree(src / "val/c1")
        return {"c1/a.JPEG", "c1/s.png"}
    return set()


def _tree(root: Path) -> dict[str, object]:
    """Every entry under ``root`` but the manifest and what a rerun kept aside (:func:`_aside`): file bytes, link
    targets, and folders."""
    out: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if rel.split("/")[0] == ".replaced":
            continue
        if path.is_symlink():
            out[rel] = ("link", os.readlink(path))
        elif path.is_dir():
            out[rel] = "folder"
        elif path.name != MANIFEST_NAME:
            out[rel] = path.read_bytes()
    return out


def _aside(root: Path) -> dict[str, bytes]:
    """What the tools kept in ``root/.replaced/<UTC time>-unrecorded/``: path under it -> bytes."""
    return {"/".join(p.relative_to(root / ".replaced").parts[1:]): p.read_bytes()
            for p in (root / ".replaced").rglob("*") if p.is_file()}


def _check_aside(root: Path, stop: int | None, fault: str, partial: str) -> None:
    """A clean stop leaves nothing unrecorded; a cut write's partial file is kept with its bytes, not deleted."""
    aside = _aside(root)
    if stop is None or fault == "stop":
        assert aside == {}, (stop, fault)
    elif fault == "partial write":
        assert aside[partial] == b"\xff\xd8 cut", (stop, fault)


def _inodes(root: Path) -> dict[str, tuple[int, int, int]]:
    """Which file each path is: its inode number alone is not enough, since a rerun removes a stale output before
    writing its successor, which may get the freed number; a file written again also has a new mtime and ctime."""
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_ctime_ns)
            for p in root.rglob("*") if p.is_file() and not p.is_symlink()}


def _stop_after(n: int | None):
    def progress(items, total):
        for i, item in enumerate(items):
            if i == n:
                raise KeyboardInterrupt
            yield item
    return progress


def _fault(dst: Path, fault: str, partial: Path) -> None:
    """What a kill -9 leaves beside a clean stop (``partial``: where a write was cut)."""
    manifest = dst / MANIFEST_NAME
    lines = manifest.read_text().splitlines(keepends=True)
    if fault == "partial write":
        partial.write_bytes(b"\xff\xd8 cut")
    elif fault == "unrecorded output" and len(lines) > 1:
        manifest.write_text("".join(lines[:-1]))  # the output is whole, its line never reached the file
    elif fault == "cut manifest line" and len(lines) > 1:
        manifest.write_text("".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])


def _cap_or_interrupt(cap, src: Path, dst: Path, stop: int | None, fault: str, partial: str) -> None:
    """``cap(src, dst)`` whole (``stop`` None), or stopped after ``stop`` outputs with ``fault`` (a partial write at
    ``partial`` under dst); the unfinished copy is then refused by a run and by quest-data check."""
    if stop is None:
        cap(src, dst, CAP)
        return
    with pytest.raises(KeyboardInterrupt):
        cap(src, dst, CAP, progress=_stop_after(stop))
    _fault(dst, fault, dst / partial)
    with pytest.raises(ValueError, match="interrupted"):
        read_capped(dst)
    assert check_root(dst, progress=False, out=open(os.devnull, "w")) == 1


def _states(outputs: int) -> list[tuple[int | None, str]]:
    return [(None, "stop")] + [(n, f) for n in range(outputs) for f in FAULTS]


@pytest.mark.parametrize("change", CHANGES)
def test_capping_a_folder_again_after_any_interruption_and_any_change_equals_a_fresh_copy(tmp_path, change):
    base = _source(tmp_path / "base")
    for k, (stop, fault) in enumerate(_states(5)):
        src, dst = tmp_path / f"src{k}", tmp_path / f"dst{k}"
        shutil.copytree(base, src)
        _cap_or_interrupt(cap_folder, src, dst, stop, fault, "train/c0/.a.JPEG.k2j3h4.tmp")
        before = _inodes(dst)
        touched = _change(src, change)
        cap_folder(src, dst, CAP)
        cap_folder(src, tmp_path / f"fresh{k}", CAP)
        assert _tree(dst) == _tree(tmp_path / f"fresh{k}"), (stop, fault)
        _check_aside(dst, stop, fault, "train/c0/.a.JPEG.k2j3h4.tmp")
        assert read_capped(dst)["complete"] is True
        if stop is None:  # a finished copy: exactly the outputs of changed sources are written again
            after = _inodes(dst)
            kept = {p for p in before if p in after and p.startswith("train/")
                    and not any(p.startswith(f"train/{Path(t).parent}/{Path(t).stem}.") for t in touched)}
            assert {p for p in kept if before[p] != after[p]} == set(), change
        shutil.rmtree(src)


def _stop_writes(monkeypatch, module, n: int | None) -> None:
    """Stop the n+1-th output write of ``module`` (make_shards writes in its own process, with no progress hook)."""
    from quest.store import files as io

    calls = itertools.count()

    def write(path, fill):
        if next(calls) == n:
            raise KeyboardInterrupt
        return io.atomic_write(path, fill)

    monkeypatch.setattr(module, "atomic_write", write)


def _convert(src: Path, out: Path, bad_images: str = "error") -> Path:
    return convert_image_folder(src, out, [("train", "train"), ("val", "val")], name="toy", shard_size=2,
                                bad_images=bad_images)


@pytest.mark.parametrize("change", CHANGES)
def test_converting_to_shards_again_after_any_interruption_and_any_change_equals_a_fresh_conversion(
        tmp_path, monkeypatch, change):
    import quest.tools.make_shards as make_shards

    base = _source(tmp_path / "base")
    for k, (stop, fault) in enumerate(_states(4)):  # train: 3 shards of 2, 2 and 1 images; val: 1 shard
        src, out = tmp_path / f"src{k}", tmp_path / f"out{k}"
        shutil.copytree(base, src)
        _stop_writes(monkeypatch, make_shards, stop)
        if stop is None:
            _convert(src, out)
        else:
            with pytest.raises(KeyboardInterrupt):
                _convert(src, out)
            _fault(out, fault, out / ".toy-train-0001.tar.k2j3h4.tmp")
            with pytest.raises(ShardError, match="complete: false"):
                resolve_shards(out, "train")
            assert check_root(out, progress=False, out=open(os.devnull, "w")) == 1
        monkeypatch.undo()
        before = _inodes(out)
        _change(src, change)
        if change == "unreadable":  # refused before any change (docs/data.md); --bad-images skip leaves it out
            held = tree_state(out)
            with pytest.raises(CorruptImageError, match="c1/a.JPEG: not an image Pillow can open"):
                _convert(src, out)
            assert tree_state(out) == held
        bad_images = "skip" if change == "unreadable" else "error"
        _convert(src, out, bad_images)
        _convert(src, tmp_path / f"fresh{k}", bad_images)
        assert _tree(out) == _tree(tmp_path / f"fresh{k}"), (stop, fault)
        _check_aside(out, stop, fault, ".toy-train-0001.tar.k2j3h4.tmp")
        if stop is None and change in ("none", "modify"):  # the same samples: only the shard holding c0/a is redone
            after = _inodes(out)
            rewritten = {p for p in before if p.endswith(".tar") and before[p] != after[p]}
            assert len(rewritten) == (change == "modify"), rewritten
        shutil.rmtree(src)


@pytest.mark.parametrize("change", ("none", "modify", "add", "drop class"))
def test_capping_shards_again_after_any_interruption_and_any_change_equals_a_fresh_copy(tmp_path, change):
    base = _source(tmp_path / "base")
    for k, (stop, fault) in enumerate(_states(3)):
        src, shards, dst = tmp_path / f"src{k}", tmp_path / f"shards{k}", tmp_path / f"dst{k}"
        shutil.copytree(base, src)
        _convert(src, shards)
        _cap_or_interrupt(cap_shards, shards, dst, stop, fault, ".toy-train-0000.tar.k2j3h4.tmp")
        _change(src, change)
        _convert(src, shards)
        cap_shards(shards, dst, CAP)
        cap_shards(shards, tmp_path / f"fresh{k}", CAP)
        assert _tree(dst) == _tree(tmp_path / f"fresh{k}"), (stop, fault)
        _check_aside(dst, stop, fault, ".toy-train-0000.tar.k2j3h4.tmp")
        shutil.rmtree(src)


def test_a_folder_holding_files_the_tool_did_not_write_is_refused_and_left_as_it_was(tmp_path):
    """The rerun removes what the source no longer makes, so it must never take somebody else's files for its own."""
    src = _source(tmp_path / "src")
    stranger = tmp_path / "dst"
    _image(stranger / "mine/photo.JPEG", (48, 40), 20)
    before = _tree(stranger)
    with pytest.raises(ValueError, match=r"already holds files quest-data cap did not write \(mine\)"):
        cap_folder(src, stranger, CAP)
    assert _tree(stranger) == before and not (stranger / MANIFEST_NAME).exists()
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "toy-train-0001.tar").write_bytes(b"somebody's file under a name the conversion would write")
    before = _tree(shards)
    with pytest.raises(ValueError, match="toy-train-0001.tar, which make_shards did not record writing"):
        _convert(src, shards)
    assert _tree(shards) == before and not (shards / MANIFEST_NAME).exists()
    cap_folder(src, tmp_path / "copy", CAP)
    before = _tree(tmp_path / "copy")
    with pytest.raises(ValueError, match="use another folder"):  # another tool, or the same one with other settings
        cap_folder(src, tmp_path / "copy", CAP, splits=("train", "val"))
    with pytest.raises(ValueError, match="was written by quest-data cap"):
        _convert(src, tmp_path / "copy")
    assert _tree(tmp_path / "copy") == before


def test_one_rerun_keeps_all_it_moves_aside_in_one_folder(tmp_path):
    """A rerun that keeps several things aside (a file nobody recorded in a class folder, an output changed by hand,
    a link at the top that leads elsewhere) keeps them in one ``.replaced/<UTC time>-unrecorded/``, with their
    bytes, so that the user restores that run's files from one place."""
    src, dst = _source(tmp_path / "src"), tmp_path / "capped"
    cap_folder(src, dst, CAP)
    (dst / "train/c0/notes.txt").write_bytes(b"mine")
    (dst / "train/c1/a.JPEG").write_bytes(b"edited")
    (dst / "val").unlink()
    (dst / "val").symlink_to(tmp_path)
    cap_folder(src, dst, CAP)
    (aside,) = (dst / ".replaced").iterdir()
    assert aside.name.endswith("-unrecorded")
    assert _aside(dst) == {"train/c0/notes.txt": b"mine", "train/c1/a.JPEG": b"edited"}
    assert os.readlink(aside / "val") == str(tmp_path)


def test_a_record_of_the_copy_edited_by_hand_is_kept_aside_before_a_rerun_writes_it_again(tmp_path):
    """_capped.json and _info.json are rewritten by every run; one changed since the tool wrote it (a note added by
    hand) is somebody's: kept in .replaced/ with its bytes, as any output changed since."""
    src = _source(tmp_path / "src")
    cap_folder(src, tmp_path / "capped", CAP)
    convert_image_folder(src, tmp_path / "shards", [("train", "train")], shard_size=2)
    for folder, name in ((tmp_path / "capped", "_capped.json"), (tmp_path / "shards", "_info.json")):
        (folder / name).write_bytes((folder / name).read_bytes().replace(b"{", b'{"my_note": "kept",', 1))
    cap_folder(src, tmp_path / "capped", CAP)
    convert_image_folder(src, tmp_path / "shards", [("train", "train")], shard_size=2)
    for folder, name in ((tmp_path / "capped", "_capped.json"), (tmp_path / "shards", "_info.json")):
        assert list(_aside(folder)) == [name] and b'"my_note": "kept"' in _aside(folder)[name]


def test_converting_one_split_of_a_source_with_other_classes_beside_kept_splits_is_refused_unchanged(tmp_path):
    """_info.json holds one class list: converting only train from a source whose classes differ, beside a kept
    validation split of the old classes, would have one label mean two classes; refused before any change."""
    src, out = _source(tmp_path / "src"), tmp_path / "shards"
    convert_image_folder(src, out, [("train", "train"), ("val", "validation")], shard_size=2)
    other = _source(tmp_path / "other")
    for c in ("c0", "c1"):
        (other / "train" / c).rename(other / "train" / f"d{c[1]}")
    before = tree_state(out)
    with pytest.raises(ValueError, match=r"holds the split\(s\) validation of another class list \(c0, c1; this "
                                         r"source's: d0, d1\)"):
        convert_image_folder(other, out, [("train", "train")], shard_size=2)
    assert tree_state(out) == before
    convert_image_folder(src, out, [("train", "train")], shard_size=2)  # the same classes: one split again is fine


SETTINGS = [{"name": "new"}, {"shard_size": 3}, {"seed": 1}, {"name": "new", "shard_size": 1, "seed": 2}]


@pytest.mark.parametrize("changed", SETTINGS, ids=["-".join(f"{k}={v}" for k, v in c.items()) for c in SETTINGS])
def test_a_rerun_with_other_settings_of_some_splits_equals_a_fresh_conversion_and_keeps_the_others(tmp_path, changed):
    """Any setting changed (--name, --shard-size, --seed, together): the converted split's shards are those of a fresh
    conversion, and its shards of the earlier settings, this tool's own stale output, are removed, not left on disk
    unlisted (a new --name once left them); a split not converted again keeps its shards, byte for byte."""
    src, out = _source(tmp_path / "src"), tmp_path / "shards"
    convert_image_folder(src, out, [("train", "train"), ("val", "validation")], name="old", shard_size=2)
    kept = {p.name: p.read_bytes() for p in out.glob("old-validation-*.tar")}
    settings = {"name": "old", "shard_size": 2, "seed": 0, **changed}
    convert_image_folder(src, out, [("train", "train")], **settings)
    convert_image_folder(src, tmp_path / "fresh", [("train", "train")], **settings)
    fresh = {p.name: p.read_bytes() for p in (tmp_path / "fresh").glob("*.tar")}
    assert {p.name: p.read_bytes() for p in out.glob("*.tar")} == {**fresh, **kept}
    assert not (out / ".replaced").exists()  # unchanged since written: removed, not kept aside
    assert [s.path.name for s in resolve_shards(out, "train")] == sorted(fresh)
    assert [s.path.name for s in resolve_shards(out, "validation")] == sorted(kept)
