"""quest.store.owned_dir by itself: the lock (a refused command changes nothing, the lock file included), the archive to
``.replaced/<UTC time>/``, and the one config flatten + diff that run and evaluation directories share."""
from __future__ import annotations

import datetime
import os
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quest.config.differences import ABSENT, Difference, differences, flatten
from quest.store.locks import LockHeld, holder_text
from quest.store.owned_dir import OwnedDirectory
from quest.store.tree import replaced_dir

STAMP = re.compile(r"^\d{8}T\d{6}\.\d{6}Z$")


def test_a_second_holder_is_refused_naming_the_first_and_the_lock_file_is_unchanged(tmp_path):
    first, second = OwnedDirectory(tmp_path), OwnedDirectory(tmp_path)
    first.lock()
    try:
        held = (tmp_path / ".lock").read_bytes()
        assert held == holder_text() == f"pid {os.getpid()} on {os.uname().nodename}\n".encode()
        with pytest.raises(LockHeld) as refused:  # flock is per open file: a second open in this process is refused
            second.lock()
        assert refused.value.holder == held.decode().strip()
        assert (tmp_path / ".lock").read_bytes() == held
        assert second.held_elsewhere() and not first.held_elsewhere()
        second.unlock()  # never held: nothing to put back, the holder's lock untouched
        assert (tmp_path / ".lock").read_bytes() == held and second.held_elsewhere()
    finally:
        first.unlock()
    assert not second.held_elsewhere()


def test_a_lock_held_by_another_process_is_refused_and_freed_when_it_dies(tmp_path):
    ready_r, ready_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other process: lock, say so, wait, then die without unlocking
        try:
            OwnedDirectory(tmp_path).lock()
            os.write(ready_w, b"1")
            os.read(go_r, 1)
        finally:
            os._exit(0)
    os.read(ready_r, 1)
    try:
        with pytest.raises(LockHeld, match=f"pid {pid} on "):
            OwnedDirectory(tmp_path).lock()
        assert OwnedDirectory(tmp_path).held_elsewhere()
    finally:
        os.write(go_w, b"1")
        os.waitpid(pid, 0)
        for fd in (ready_r, ready_w, go_r, go_w):
            os.close(fd)
    mine = OwnedDirectory(tmp_path)
    mine.lock()  # the OS released the dead holder's lock
    mine.claim()
    mine.unlock()
    assert (tmp_path / ".lock").read_bytes() == holder_text()


@pytest.mark.parametrize("before", [None, b"pid 1 on elsewhere\n", bytes(range(256)) * 40])  # 10 KiB: every byte back
def test_an_unclaimed_lock_puts_the_file_back_and_a_claimed_one_names_this_process(tmp_path, before):
    path = tmp_path / ".lock"
    if before is not None:
        path.write_bytes(before)
    refused = OwnedDirectory(tmp_path)
    refused.lock()
    assert path.read_bytes() == holder_text()
    refused.unlock()  # a command refused after taking the lock
    assert (path.read_bytes() if path.exists() else None) == before
    accepted = OwnedDirectory(tmp_path)
    accepted.lock()
    accepted.claim()
    accepted.unlock()
    assert path.read_bytes() == holder_text()


def test_a_lock_file_hard_linked_with_another_folders_becomes_its_own_when_the_command_claims(tmp_path):
    """A folder copied with ``cp -al`` shares its lock file with the original: while one folder's command checks, the
    other's is refused, saying so; once it claims, each folder has a lock file of its own (same mode), the shared one
    says what it said before, and the folders' commands no longer hold each other."""
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / ".lock").write_bytes(b"pid 4242 on elsewhere\n")
    os.chmod(a / ".lock", 0o640)
    os.link(a / ".lock", b / ".lock")
    first = OwnedDirectory(a)
    first.lock()
    try:
        with pytest.raises(LockHeld, match="one of 2 hard links to one file, as in a folder copied with cp -al"):
            OwnedDirectory(b).lock()
        first.claim()
        mine, theirs = os.stat(a / ".lock"), os.stat(b / ".lock")
        assert mine.st_ino != theirs.st_ino and mine.st_nlink == theirs.st_nlink == 1
        assert (a / ".lock").read_bytes() == holder_text() and (mine.st_mode & 0o777) == 0o640
        assert (b / ".lock").read_bytes() == b"pid 4242 on elsewhere\n"
        other = OwnedDirectory(b)
        other.lock()  # b's own commands are free
        other.unlock()
        with pytest.raises(LockHeld):  # and a is still held, through its own file
            OwnedDirectory(a).lock()
        assert sorted(p.name for p in a.iterdir()) == [".lock"]  # no temporary left
    finally:
        first.unlock()
    assert (a / ".lock").read_bytes() == holder_text()  # a claimed lock keeps naming its command


def test_other_processes_of_a_distributed_command_neither_lock_nor_archive(tmp_path):
    (tmp_path / "a").write_text("a")
    follower = OwnedDirectory(tmp_path, is_main=False)
    follower.lock()
    assert not (tmp_path / ".lock").exists() and follower.archive(["a"]) is None and (tmp_path / "a").exists()
    follower.unlock()


def test_archive_moves_what_it_is_given_but_never_the_lock_nor_the_archive(tmp_path):
    (tmp_path / "a.txt").write_text("a")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("b")
    (tmp_path / "other.txt").write_text("not ours")
    owner = OwnedDirectory(tmp_path)
    owner.lock()
    try:
        earlier = replaced_dir(owner.path)
        (earlier / "old.txt").write_text("old")
        dest = owner.archive(["a.txt", "sub", ".lock", ".replaced", "missing.txt"])
    finally:
        owner.unlock()
    assert dest is not None and dest.parent == tmp_path / ".replaced" and STAMP.match(dest.name)
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*")) == ["a.txt", "sub", "sub/b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".replaced", "other.txt"]  # the unclaimed lock: removed
    assert (earlier / "old.txt").read_text() == "old"
    assert owner.archive(["missing.txt"]) is None


def test_two_archives_in_the_same_clock_tick_do_not_collide(tmp_path, monkeypatch):
    class Frozen(datetime.datetime):
        @classmethod
        def now(cls, tz=None):
            return cls(2026, 1, 2, 3, 4, 5, 678901, tzinfo=tz)

    monkeypatch.setattr(datetime, "datetime", Frozen)
    owner = OwnedDirectory(tmp_path)
    dests = []
    for run in ("first", "second"):
        (tmp_path / "result.txt").write_text(run)
        dests.append(owner.archive(["result.txt"], label="complete"))
    assert [d.name for d in dests] == ["20260102T030405.678901Z-complete", "20260102T030405.678901Z-2-complete"]
    assert [(d / "result.txt").read_text() for d in dests] == ["first", "second"]


STORED = {"model": {"name": "vit", "depth": 12, "mean": [0.5, 0.5]}, "trainer": {"epochs": 10, "extra": {}},
          "seed": 1, "blocks": [{"heads": 3}]}
NEW = {"model": {"name": "vit", "depth": 6, "mean": [0.5, 0.4]}, "trainer": {"epochs": 10}, "seed": 1,
       "blocks": [{"heads": 4}], "tag": "x"}


def test_flatten_and_differences_of_nested_dicts_and_lists():
    # lists are values (a list-valued key differs as a whole); an empty dict below the top is a value
    assert flatten(STORED) == {"model.name": "vit", "model.depth": 12, "model.mean": [0.5, 0.5],
                               "trainer.epochs": 10, "trainer.extra": {}, "seed": 1, "blocks": [{"heads": 3}]}
    assert flatten({}) == {}
    assert differences(STORED, NEW) == [
        Difference("blocks", [{"heads": 3}], [{"heads": 4}]),
        Difference("model.depth", 12, 6),
        Difference("model.mean", [0.5, 0.5], [0.5, 0.4]),
        Difference("tag", ABSENT, "x"),
        Difference("trainer.extra", {}, ABSENT),
    ]
    # a key one side lacks counts as its default (a config an older quest stored)
    assert [d.key for d in differences(STORED, NEW, defaults={"tag": "x", "trainer.extra": {}})] == [
        "blocks", "model.depth", "model.mean"]
    assert [str(d) for d in differences({"a": 1}, {"b": "x"})] == ["a: 1 -> (absent)", "b: (absent) -> 'x'"]
    assert Difference("k", "abcdefgh", [1, 2]).show(width=4) == "k: 'abc -> [1, "


KEYS = st.text("abcxyz_", min_size=1, max_size=3)
LEAVES = st.none() | st.booleans() | st.integers(-3, 3) | st.text("ab", max_size=2) | st.lists(st.integers(0, 2),
                                                                                                  max_size=2)
CONFIGS = st.dictionaries(KEYS, st.recursive(LEAVES, lambda inner: st.dictionaries(KEYS, inner, max_size=3),
                                              max_leaves=8), max_size=4)


@settings(max_examples=150, deadline=None)
@given(a=CONFIGS, b=CONFIGS)
def test_differences_are_exactly_the_flattened_keys_whose_values_differ(a, b):
    assert differences(a, a) == []
    fa, fb = flatten(a), flatten(b)
    found = differences(a, b)
    assert [d.key for d in found] == sorted(k for k in set(fa) | set(fb) if fa.get(k, ABSENT) != fb.get(k, ABSENT))
    for d in found:
        assert (d.stored, d.new) == (fa.get(d.key, ABSENT), fb.get(d.key, ABSENT))
