"""What a command replaces is moved into ``.replaced/`` all or nothing (quest.store.tree.move_aside): a file that
cannot be moved (``chattr +i``, a folder this user cannot write) leaves every file where it was, no copy and no
empty folder in ``.replaced/``, and one line saying which file and why. Root ignores file permissions and chattr
needs root, so the refusal is simulated at the system call: ``os.rename`` (and ``os.unlink``) of that one path."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from quest.store.output_folder import holding
from quest.store.tree import REPLACED, MoveAsideError, move, move_aside, replaced_dir

from ..tree_state import tree_state


def refuse_moving(monkeypatch: pytest.MonkeyPatch, path: Path, rename_errno: int = errno.EPERM,
                  unlink: bool = False) -> None:
    """``os.rename`` of ``path`` fails with ``rename_errno``; with ``unlink`` its removal fails too (an immutable file:
    a copy of it can be made, the original never goes)."""
    real_rename, real_unlink = os.rename, os.unlink

    def rename(src, dst, *args, **kwargs):
        if Path(src) == path:
            raise OSError(rename_errno, os.strerror(rename_errno), str(src), str(dst))
        return real_rename(src, dst, *args, **kwargs)

    def refused_unlink(target, *args, **kwargs):
        if Path(target) == path:
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), str(target))
        return real_unlink(target, *args, **kwargs)

    monkeypatch.setattr(os, "rename", rename)
    if unlink:
        monkeypatch.setattr(os, "unlink", refused_unlink)


def _folder(root: Path) -> list[Path]:
    (root / "sub").mkdir(parents=True)
    files = [root / "a.bin", root / "sub" / "b.bin", root / "c.bin"]
    for i, path in enumerate(files):
        path.write_bytes(bytes([i]) * 64)
    return files


@pytest.mark.parametrize("refused", [0, 1, 2])
@pytest.mark.parametrize("how", ["rename", "immutable", "other_file_system"])
def test_a_file_that_cannot_be_moved_aside_leaves_everything_in_place(tmp_path, monkeypatch, refused, how):
    files = _folder(tmp_path)
    before = tree_state(tmp_path)
    # immutable: neither rename nor unlink (shutil.move's fallback copied it, then failed to remove it); another file
    # system: the rename says EXDEV, the copy is made and the original cannot be removed
    refuse_moving(monkeypatch, files[refused], errno.EXDEV if how == "other_file_system" else errno.EPERM,
                  unlink=how != "rename")
    with pytest.raises(MoveAsideError) as info:
        move_aside(tmp_path, files)
    monkeypatch.undo()
    assert tree_state(tmp_path) == before  # every file back, no .replaced/, no copy
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"cannot replace {files[refused]}: it could not be moved into "
                                                      f"{tmp_path / REPLACED} (")
    assert message.endswith("(Operation not permitted); nothing was replaced") and info.value.errno == errno.EPERM


def test_a_failed_move_aside_keeps_what_replaced_held_before(tmp_path, monkeypatch):
    files = _folder(tmp_path)
    earlier = replaced_dir(tmp_path)
    (earlier / "old.bin").write_bytes(b"kept from an earlier run")
    before = tree_state(tmp_path)
    refuse_moving(monkeypatch, files[1])
    with pytest.raises(MoveAsideError):
        move_aside(tmp_path, files)
    monkeypatch.undo()
    assert tree_state(tmp_path) == before  # only this call's <UTC time>/ folder went


def test_a_move_across_file_systems_still_moves_by_copy(tmp_path, monkeypatch):
    files = _folder(tmp_path)
    content = [p.read_bytes() for p in files]
    refuse_moving(monkeypatch, files[0], errno.EXDEV)  # the rename refused, the copy and the removal allowed
    dest = move_aside(tmp_path, files)
    assert dest is not None and not any(p.exists() for p in files)
    assert [(dest / p.relative_to(tmp_path)).read_bytes() for p in files] == content


@pytest.mark.parametrize("source_kind", ["file", "folder"])
@pytest.mark.parametrize("target_kind", ["file", "folder", "link"])
@pytest.mark.parametrize("rename_errno", [None, errno.EXDEV, errno.EPERM])  # renamed, copied across, refused
def test_a_move_onto_anything_already_there_is_refused_and_changes_nothing(tmp_path, monkeypatch, source_kind,
                                                                           target_kind, rename_errno):
    """``move`` never replaces: the failed copy's clean-up (and a rename over a file) would otherwise remove what was
    at the target, which the call had not made."""
    src, there = tmp_path / "src", tmp_path / "there"
    if source_kind == "file":
        src.write_bytes(b"x")
    else:
        src.mkdir()
        (src / "x.bin").write_bytes(b"x")
    if target_kind == "file":
        there.write_bytes(b"kept")
    elif target_kind == "folder":
        there.mkdir()
        (there / "kept.bin").write_bytes(b"kept")
    else:
        there.symlink_to(tmp_path / "nowhere")
    if rename_errno is not None:
        refuse_moving(monkeypatch, src, rename_errno)
    before = tree_state(tmp_path)
    with pytest.raises(FileExistsError):
        move(src, there)
    assert tree_state(tmp_path) == before


def test_an_output_folder_that_cannot_make_room_is_left_as_it_was(tmp_path, monkeypatch):
    """The mechanism every command replacing its outputs goes through (OutputFolder.make_room)."""
    files = _folder(tmp_path)
    before = tree_state(tmp_path)
    refuse_moving(monkeypatch, files[2], unlink=True)
    with pytest.raises(MoveAsideError, match="nothing was replaced"):
        with holding(tmp_path, "quest-test", transient=True) as folder:
            folder.make_room(files)
    monkeypatch.undo()
    assert tree_state(tmp_path) == before  # the lock file it made gone too
