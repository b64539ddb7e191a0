"""The one manifest of what a command wrote (quest/store/manifest.py): a rerun tells the tool's own unchanged outputs
from changed ones by size, then modification time, then the digest taken at write time (so that a rerun over
unchanged outputs reads none of them); a changed output or one replaced by a link is kept in ``.replaced/`` with its
bytes, never deleted; and a folder an older quest wrote (``_ledger.jsonl``, ``.written.json``) goes on working, its
record carried into the manifest on the next write."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import quest.store.manifest as manifest_module
from quest.store.manifest import MANIFEST_NAME, Manifest
from quest.store.old_manifests import OLD_LEDGER, OLD_RECORD
from quest.store.output_folder import holding
from quest.tools.capped import TOOL, cap_folder
from quest.tools.make_shards import convert_image_folder, write_index

from ..tree_state import tree_state


def _source(root: Path) -> Path:
    """Images under the cap of 16 (copied byte for byte, under their own names); val is linked, not copied."""
    for i, name in enumerate(("train/c0/a.png", "train/c0/b.png", "train/c1/a.png", "val/c0/a.png")):
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(np.full((12, 14, 3), 40 * i, dtype=np.uint8)).save(path)
    return root


def _identities(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_ino, p.stat().st_mtime_ns)
            for p in (root / "train").rglob("*") if p.is_file()}


def _aside(root: Path) -> dict[str, bytes | str]:
    """What a rerun kept in ``.replaced/<UTC time>-unrecorded/``: path under it -> bytes, or a link's target."""
    return {"/".join(p.relative_to(root / ".replaced").parts[1:]): os.readlink(p) if p.is_symlink() else p.read_bytes()
            for p in (root / ".replaced").rglob("*") if p.is_file() or p.is_symlink()}


def test_a_rerun_digests_only_what_size_and_time_leave_open_and_keeps_what_changed(tmp_path, monkeypatch):
    """A touched output of the same bytes stays (digested once: same bytes); one rewritten to the same size with other
    bytes, and one replaced by a link, are the tool's no more: kept in .replaced/ and written again. A rerun that
    finds nothing changed digests nothing."""
    src, dst = _source(tmp_path / "src"), tmp_path / "capped"
    cap_folder(src, dst, 16)
    digested: list[str] = []

    def counting(path):  # the outputs made from images (the copy's own _capped.json is digested as it is written)
        if Path(path).name != "_capped.json":
            digested.append(str(Path(path).relative_to(dst)))
        return real(path)

    real = manifest_module.file_sha256
    monkeypatch.setattr(manifest_module, "file_sha256", counting)
    before = _identities(dst)
    cap_folder(src, dst, 16)
    assert digested == [] and _identities(dst) == before
    touched, edited, linked = dst / "train/c0/a.png", dst / "train/c0/b.png", dst / "train/c1/a.png"
    os.utime(touched, ns=(1, 1))
    edited_bytes = bytes(reversed(edited.read_bytes()))  # the same size, other bytes
    edited.write_bytes(edited_bytes)
    os.utime(edited, ns=(2, 2))
    (tmp_path / "elsewhere.png").write_bytes(linked.read_bytes())
    linked.unlink()
    linked.symlink_to(tmp_path / "elsewhere.png")
    report = cap_folder(src, dst, 16)["this_run"]
    assert sorted(digested) == ["train/c0/a.png", "train/c0/b.png", "train/c0/b.png", "train/c1/a.png"]  # checks,
    # then the two outputs written again, digested as they are recorded
    assert report == {"kept": 1, "written": 2, "removed": 0, "moved": 2}  # kept in .replaced/, not deleted
    assert _aside(dst) == {"train/c0/b.png": edited_bytes, "train/c1/a.png": str(tmp_path / "elsewhere.png")}
    assert _identities(dst)["train/c0/a.png"] == (before["train/c0/a.png"][0], 1)  # not written again
    digested.clear()
    cap_folder(src, dst, 16)  # the touched output's new time is on record: not digested again
    assert digested == []
    files = {str(Path(top, name).relative_to(dst)) for top, dirs, names in os.walk(dst) for name in names
             if ".replaced" not in Path(top).parts and not name.startswith(".")}  # links to folders not followed
    assert set(Manifest(dst, TOOL).entries) == files  # every file the command wrote, _capped.json included
    monkeypatch.undo()
    cap_folder(src, tmp_path / "fresh", 16)
    assert {p: (dst / p).read_bytes() for p in _identities(dst)} == {
        p: (tmp_path / "fresh" / p).read_bytes() for p in _identities(tmp_path / "fresh")}


def _old_ledger(dst: Path) -> None:
    """``dst``'s manifest turned into the ledger quest-data cap kept before it: a header, then a line per output
    with its source, the source's stamp, and the output's size and modification time as ``made``."""
    lines = (dst / MANIFEST_NAME).read_text().splitlines()
    ((tool, params),) = json.loads(lines[0])["settings"].items()
    rows = [json.dumps({"tool": tool, "params": params})]
    for line in lines[1:]:
        entry = json.loads(line)
        if "source" not in entry:  # _capped.json, _info.json: the ledger did not list them
            continue
        rows.append(json.dumps({"key": entry["source"], "out": entry["path"], "stamp": entry["stamp"],
                                "made": f"{entry['size']}:{entry['mtime_ns']}"}))
    (dst / OLD_LEDGER).write_text("\n".join(rows) + "\n")
    (dst / MANIFEST_NAME).unlink()


def test_a_copy_an_older_quest_made_is_followed_and_its_ledger_carried_into_the_manifest(tmp_path):
    src, dst = _source(tmp_path / "src"), tmp_path / "capped"
    cap_folder(src, dst, 16)
    entries = Manifest(dst, TOOL).entries
    _old_ledger(dst)
    before = _identities(dst)
    with pytest.raises(ValueError, match="use another folder"):  # its settings, read from the ledger
        cap_folder(src, dst, 16, splits=("train", "val"))
    assert (dst / OLD_LEDGER).exists() and not (dst / MANIFEST_NAME).exists()  # a refusal carries nothing
    assert cap_folder(src, dst, 16)["this_run"] == {"kept": 3, "written": 0, "removed": 0, "moved": 0}
    assert _identities(dst) == before and not (dst / OLD_LEDGER).exists()
    carried = Manifest(dst, TOOL).entries
    assert {k: (e.size, e.mtime_ns, e.source, e.stamp) for k, e in carried.items() if e.source} == {
        k: (e.size, e.mtime_ns, e.source, e.stamp) for k, e in entries.items() if e.source}
    (src / "train/c0/b.png").unlink()  # the source changed: followed as before
    assert cap_folder(src, dst, 16)["this_run"] == {"kept": 2, "written": 0, "removed": 1, "moved": 0}
    assert not (dst / "train/c0/b.png").exists() and not (dst / ".replaced").exists()


def test_an_older_conversion_indexed_since_is_still_followed(tmp_path):
    """``make_shards index`` (which does not read the ledger) begins the manifest of a folder an older conversion
    wrote; the next conversion carries the ledger still: no shard redone or set aside."""
    src, out = _source(tmp_path / "src"), tmp_path / "shards"

    def convert():
        return convert_image_folder(src, out, [("train", "train")], name="toy", shard_size=2)

    convert()
    _old_ledger(out)
    before = {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.tar")}
    write_index(out, {"train": "toy-train-*.tar"})
    assert (out / OLD_LEDGER).exists() and (out / MANIFEST_NAME).exists()
    convert()
    assert {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.glob("*.tar")} == before
    assert not (out / OLD_LEDGER).exists()
    # only the _info.json the conversion wrote, which index wrote over (its splits kept in the new one)
    assert [p.name for p in (out / ".replaced").rglob("*") if p.is_file()] == ["_info.json"]
    assert set(before) <= set(Manifest(out, "make_shards convert").sources().values())


def test_an_older_record_is_carried_only_for_files_that_still_hold_what_it_says(tmp_path):
    """``.written.json`` kept each file's SHA-256: a file edited since is not the command's (kept in .replaced/ when
    replaced); the record is carried into the manifest on the command's first write, and only then removed."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "same.csv").write_text("a,b\n")
    (folder / "edited.csv").write_text("mine now\n")
    (folder / "events").write_text("appended to")
    sha = hashlib.sha256(b"a,b\n").hexdigest()
    (folder / OLD_RECORD).write_text(json.dumps({"files": {
        "same.csv": {"by": "quest-toy", "sha256": sha}, "edited.csv": {"by": "quest-toy", "sha256": sha},
        "events": {"by": "quest-toy"}}}))
    before = tree_state(folder)
    with holding(folder, "quest-toy"):
        pass  # a command refused after its checks: nothing written, the older record as it was
    assert tree_state(folder) == before
    with holding(folder, "quest-toy") as held:
        kept = held.make_room([folder / "same.csv", folder / "edited.csv", folder / "events"], keep_own=True)
        (folder / "edited.csv").write_text("a,b\n")
        held.manifest.note([folder / "edited.csv"])
    assert (kept / "edited.csv").read_text() == "mine now\n"
    assert not (folder / OLD_RECORD).exists()
    entries = Manifest(folder, "quest-toy").entries
    assert sorted(entries) == ["edited.csv", "events", "same.csv"]
    assert (entries["same.csv"].size, entries["same.csv"].sha256) == (4, sha) and entries["events"].size is None


def test_a_recorded_file_is_deleted_only_while_it_is_a_plain_file_inside_the_folder(tmp_path):
    """Every kind of thing that can stand where the record names a file: only the plain file inside the folder is
    deleted; a folder, a link (to a file inside or outside, or to nothing) is moved to .replaced/ with what it holds."""
    from quest.store.manifest import Manifest

    outside = tmp_path / "outside.txt"
    outside.write_text("not the folder's\n")
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "kept.txt").write_text("x\n")
    places = {"plain": lambda p: p.write_text("mine\n"), "folder": lambda p: (p.mkdir(), (p / "f").write_text("y")),
              "link_out": lambda p: p.symlink_to(outside), "link_in": lambda p: p.symlink_to(folder / "kept.txt"),
              "dangling": lambda p: p.symlink_to(tmp_path / "nothing")}
    for name, make in places.items():
        make(folder / name)
    manifest = Manifest(folder, "test")
    for name in places:
        manifest._remove_own(folder / name)
    assert sorted(p.name for p in folder.iterdir()) == [".replaced", "kept.txt"]
    moved = {p.name for p in (folder / ".replaced").rglob("*") if p.parent.parent == folder / ".replaced"}
    assert moved == {"folder", "link_out", "link_in", "dangling"}
    assert outside.read_text() == "not the folder's\n" and (folder / "kept.txt").read_text() == "x\n"


def test_only_a_file_the_command_wrote_and_nobody_changed_is_removed_as_its_own(tmp_path):
    """remove_if_owned (the run's stale TensorBoard files): the command's own unchanged file goes; one it did not
    write, one changed since (same size, other bytes), one another command wrote, and a link put in the place of its
    file stay where they are."""
    folder = tmp_path / "out"
    folder.mkdir()
    for name in ("mine", "changed", "linked", "theirs"):
        (folder / name).write_text(f"{name} 0\n")
    (folder / "unrecorded").write_text("?\n")
    manifest = Manifest(folder, "test")
    manifest.note([folder / "mine", folder / "changed", folder / "linked"])
    Manifest(folder, "another command").note([folder / "theirs"])
    manifest = Manifest(folder, "test")  # as read back by the next run
    (folder / "changed").write_text("changed 1\n")
    os.utime(folder / "changed", ns=(1, 1))
    (folder / "linked").unlink()
    (folder / "linked").symlink_to(folder / "unrecorded")
    removed = {name: manifest.remove_if_owned(folder / name) for name in ("mine", "changed", "linked", "theirs",
                                                                           "unrecorded")}
    assert removed == {"mine": True, "changed": False, "linked": False, "theirs": False, "unrecorded": False}
    assert sorted(p.name for p in folder.iterdir() if not p.name.startswith(".")) == [
        "changed", "linked", "theirs", "unrecorded"]


@pytest.mark.parametrize("path", [".replaced/20260101T000000Z/precious.png", ".replaced", MANIFEST_NAME])
def test_a_manifest_line_naming_what_quest_kept_aside_is_refused_before_any_change(tmp_path, path):
    """A line (hand-edited, with the file's true size and digest) naming a file in .replaced/ or the manifest itself
    would have the rerun delete it as a stale output: the manifest is damaged, and the copy refused unchanged."""
    src, dst = _source(tmp_path / "src"), tmp_path / "dst"
    cap_folder(src, dst, 16)
    kept = dst / ".replaced" / "20260101T000000Z" / "precious.png"
    kept.parent.mkdir(parents=True)
    kept.write_bytes(b"kept aside")
    target = dst / path
    st = target.stat() if target.is_file() else None
    row = {"by": TOOL, "path": path, "source": "train/c9/gone.png", "stamp": "1:1"}
    if st is not None:
        row.update(size=st.st_size, mtime_ns=st.st_mtime_ns, sha256=hashlib.sha256(target.read_bytes()).hexdigest())
    with open(dst / MANIFEST_NAME, "a") as f:
        f.write(json.dumps(row) + "\n")
    before = tree_state(dst)
    with pytest.raises(Exception, match=rf"{MANIFEST_NAME}.*line \d+: path .* is no command's output"):
        cap_folder(src, dst, 16)
    assert tree_state(dst) == before
