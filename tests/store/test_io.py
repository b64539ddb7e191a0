"""quest.store.files, the one way quest writes and reads its files: whole files with the umask's mode, appends that start
on a line of their own, JSON records that are what they should be or a DamagedFile naming them."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quest.store import files as io
from quest.store.tree import same_file_as


@pytest.fixture
def umask():
    """Set the process umask for one test, then put the old one back."""
    old = os.umask(0o022)
    os.umask(old)
    yield lambda mask: os.umask(mask)
    os.umask(old)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mask=st.integers(0, 0o777), writer=st.sampled_from(["text", "json", "csv", "bytes", "figure"]))
def test_a_new_file_gets_the_mode_open_would_give(tmp_path_factory, umask, mask, writer):
    umask(mask)
    path = tmp_path_factory.mktemp("io") / ("out.png" if writer == "figure" else "out")
    if writer == "text":
        io.write_text_atomic(path, "x")
    elif writer == "json":
        io.write_json_atomic(path, {"a": 1})
    elif writer == "csv":
        io.write_csv_atomic(path, [{"a": 1}])
    elif writer == "bytes":
        io.atomic_write(path, lambda f: f.write(b"x"))
    else:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig = plt.figure(figsize=(1, 1))
        io.save_figure(fig, path)
        plt.close(fig)
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the format follows the suffix
    # what open(path, "w") gives a new file: 0o666 less the umask
    reference = path.with_name("reference")
    reference.write_text("")
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(reference.stat().st_mode) == 0o666 & ~mask


def test_a_replaced_file_keeps_its_mode_and_a_failed_write_keeps_the_file(tmp_path, umask):
    umask(0o022)
    path = tmp_path / "summary.json"
    io.write_json_atomic(path, {"v": 1})
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # the case: a teammate can read it
    path.chmod(0o640)
    io.write_json_atomic(path, {"v": 2})
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 and json.loads(path.read_text()) == {"v": 2}

    def fails(f):
        f.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        io.atomic_write(path, fails)
    assert json.loads(path.read_text()) == {"v": 2} and [p.name for p in tmp_path.iterdir()] == ["summary.json"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(records=st.lists(st.dictionaries(st.text(max_size=5), st.integers()), max_size=6),
       cut=st.floats(0, 1), new=st.dictionaries(st.text(max_size=5), st.integers(), max_size=3))
def test_appending_first_cuts_a_half_written_last_record(tmp_path_factory, records, cut, new):
    path = tmp_path_factory.mktemp("records") / "metrics.jsonl"
    text = "".join(json.dumps(r) + "\n" for r in records).encode()
    path.write_bytes(text[:int(cut * len(text))])  # a writer killed anywhere
    complete = text[:int(cut * len(text))].count(b"\n")
    with io.open_records(path) as f:
        f.write(json.dumps(new) + "\n")
    lines = path.read_text().splitlines()
    assert [json.loads(line) for line in lines] == records[:complete] + [new]  # every line a whole record


@pytest.mark.parametrize("content, problem", [
    (b"", "not valid JSON"), (b'{"status": "comp', "not valid JSON"), (b"\xff\xfe\x00garbage", "not valid JSON"),
    (b"[]", "holds a JSON list, expected a JSON object"), (b"null", "holds a JSON NoneType"),
    (b"3", "holds a JSON int"), (b'"text"', "holds a JSON str"),
    (b"[" * 200_000, "nested deeper than any file quest writes"),  # Python's decoder: RecursionError, not ValueError
    # beyond 64 bits: float() overflows on 10**400 later; Python will not read an integer of over 4,300 digits
    (b'{"val/top1": 1' + b"0" * 400 + b"}", "an integer of 401 digits, beyond the 64 bits"),
    (b'{"step": ' + b"9" * 5000 + b"}", "an integer of 5000 digits"),
])
def test_a_damaged_record_is_named_with_what_was_expected(tmp_path, content, problem):
    path = tmp_path / "summary.json"
    path.write_bytes(content)
    with pytest.raises(io.DamagedFile, match=problem) as exc:
        io.read_json(path)
    assert str(path) in str(exc.value) and exc.value.path == path
    assert io.read_json(tmp_path / "absent.json") is None
    (tmp_path / "ok.json").write_text('{"a": [1]}')
    assert io.read_json(tmp_path / "ok.json") == {"a": [1]}


def test_a_damaged_record_under_a_name_with_a_line_break_is_named_on_one_line(tmp_path):
    """A run folder a user named with a line break (quest refuses one on its command line, not on disk): the
    damaged-file message shows the name escaped, and the error still holds the real path."""
    path = tmp_path / "run\nx" / "summary.json"
    path.parent.mkdir()
    path.write_bytes(b'{"status": ')
    with pytest.raises(io.DamagedFile) as exc:
        io.read_json(path)
    assert len(str(exc.value).splitlines()) == 1 and "run\\nx/summary.json" in str(exc.value) and exc.value.path == path


@pytest.mark.unprivileged
def test_an_unreadable_record_names_the_file_and_the_permission(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("{}")
    path.chmod(0o000)
    with pytest.raises(PermissionError, match=r"summary\.json is not readable.*read \(r\) permission"):
        io.read_json(path)


@pytest.mark.parametrize("joined", [" is damaged: ", ": ", " "])
def test_a_damaged_file_error_crosses_a_process_boundary_whole(joined):
    """A DamagedFile raised in a worker reaches the parent with its message, path and problem (pickled as a pool
    sends it back)."""
    import pickle

    error = io.DamagedFile(Path("d/run.json"), "epoch is -1, expected a value >= 0", "Move it away", joined)
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is io.DamagedFile and str(back) == str(error) == \
        f"d/run.json{joined}epoch is -1, expected a value >= 0. Move it away"
    assert (back.path, back.problem, back.joined) == (Path("d/run.json"), "epoch is -1, expected a value >= 0", joined)


@pytest.mark.parametrize("shared", ["symlink", "symlink_to_nothing"])
def test_an_append_never_writes_through_a_link(tmp_path, shared):
    """A records file (metrics.jsonl, a ledger, a log) that is a link is moved aside whole and a new one begins: the
    file it leads to keeps its bytes, and the link is kept."""
    other = tmp_path / "elsewhere" / "theirs.jsonl"
    other.parent.mkdir()
    if shared == "symlink":
        other.write_bytes(b'{"theirs": 1}\n')
    folder = tmp_path / "run"
    folder.mkdir()
    records = folder / "metrics.jsonl"
    records.symlink_to(other)
    said: list[str] = []
    with io.open_records(records, warn=said.append) as f:
        f.write('{"mine": 1}\n')
    assert records.read_bytes() == b'{"mine": 1}\n' and not records.is_symlink()
    assert shared == "symlink_to_nothing" or other.read_bytes() == b'{"theirs": 1}\n'
    (kept,) = [d / "metrics.jsonl" for d in (folder / ".replaced").iterdir()]  # glob skips a link leading nowhere
    assert kept.parent.name.endswith("-unrecorded") and kept.is_symlink() and len(said) == 1
    assert str(kept.parent) in said[0]


def test_an_append_to_a_hard_linked_file_writes_to_its_own_copy(tmp_path):
    """A records file with another name too (a run copied with cp -al) is this folder's own copy, with its bytes,
    before anything is appended: the other name's file is as it was, and nothing is set aside."""
    backup = tmp_path / "backup" / "metrics.jsonl"
    backup.parent.mkdir()
    backup.write_bytes(b'{"step": 1}\n')
    records = tmp_path / "run" / "metrics.jsonl"
    records.parent.mkdir()
    records.hardlink_to(backup)
    with io.open_records(records) as f:
        f.write('{"step": 2}\n')
    assert records.read_bytes() == b'{"step": 1}\n{"step": 2}\n' and records.stat().st_nlink == 1
    assert backup.read_bytes() == b'{"step": 1}\n' and not (records.parent / ".replaced").exists()


def test_an_append_cuts_a_half_written_last_line_first(tmp_path):
    records = tmp_path / "metrics.jsonl"
    records.write_bytes(b'{"step": 1}\n{"step": 2, "lo')
    with io.open_records(records) as f:
        f.write('{"step": 2}\n')
    assert records.read_bytes() == b'{"step": 1}\n{"step": 2}\n'


@given(st.integers(min_value=-2**70, max_value=2**70) | st.sampled_from([2**63 - 1, 2**63, -2**63, -2**63 - 1]))
def test_an_integer_reads_back_exactly_where_it_has_64_bits_and_is_damage_beyond(value):
    from quest.store.records import field_problem

    text = json.dumps({"config": {"recipe": {"epochs": [value]}}})
    fits = -2**63 <= value < 2**63
    if fits:
        assert io.parse_json(text)["config"]["recipe"]["epochs"] == [value]
    else:
        with pytest.raises(json.JSONDecodeError, match="beyond the 64 bits"):
            io.parse_json(text)
    # a typed field read from elsewhere (a checkpoint's torch.load) holds the same line, never an OverflowError
    assert (field_problem(value, int) is None) == fits
    assert field_problem(value * 10**400, float) is not None or value == 0  # beyond a float: refused, no overflow


def test_a_file_is_synced_whole_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    """A whole-file write (atomic_write), and the copy same_file_as makes where no hard link can be, sync the new
    file, all its bytes, before the rename that makes it the file: after a power cut the file is the old one or
    the whole new one."""
    import errno

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        real_replace(src, dst)

    def no_link(src, dst):
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))  # a file system without hard links

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "link", no_link)
    written, copied = tmp_path / "summary.json", tmp_path / "best.pt"
    io.atomic_write(written, lambda f: f.write(b"x" * 1000))
    same_file_as(written, copied)
    assert [(e[0], e[2]) for e in events] == [("fsync", 1000), ("replace", str(written)),
                                              ("fsync", 1000), ("replace", str(copied))], events
    assert events[0][1] == events[1][1] and events[2][1] == events[3][1]  # the file synced is the file renamed
    assert copied.read_bytes() == written.read_bytes() == b"x" * 1000
