"""Checks, then changes (quest.runtime.phase), for every command, held by what the operating system is asked to do.

An audit hook (``sys.addaudithook``, PEP 578) sees every file opened for writing, every folder made or removed, every
rename, link and removal this process asks for, whoever asks (quest's store, Hydra, TensorBoard, a library), with the
phase of the command running at that moment. Each command runs in this process as its console script does (its
function in quest.cli with its argv, so inside its error path and its phases) on a small real input, and the test
checks that nothing under the test's folder was changed while the command was still in its checks, except its lock
file (taken before the checks and put back by a refusal, tests/runtime/test_refusal_contract.py) and the
folders that hold it; and that its changes did begin, so that the hook saw the phase at work.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from quest import cli
from quest.run import sweep_jobs
from quest.runtime import phase
from quest.runtime.errors import EXIT_BUG, program_name, reporting_errors
from quest.store.files import atomic_write, write_text_atomic

from ..helpers import FAST

TRAIN = [*FAST, "trainer.max_steps=1"]
TOY = ["grid=quick", "grid.lrs=[0.01]", "grid.weight_decays=[0.0]", "grid.data_seeds=[0]", "grid.init_seeds=[0]",
       "data.train_size=16", "data.test_size=16", "train.epochs=1", "probe_size=8", "workers=1", "compile=false",
       "attentions=[standard]", "device=cpu"]
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@dataclass
class Change:
    event: str
    path: Path
    checking: bool | None  # None: outside any command


@dataclass
class Watch:
    """The changes under ``root`` while it is active (the hook stays installed: an audit hook cannot be removed)."""

    root: Path
    seen: list[Change] = field(default_factory=list)


_WATCHES: list[Watch] = []


def _changes(event: str, args: tuple) -> list[tuple[str, object]]:
    """(what, path) for each path an audit event changes; an open for writing is ``open-write`` (a new or truncated
    file), ``open-append`` or ``open-update`` (``r+``)."""
    if event == "open":
        path, mode, flags = args
        if isinstance(mode, str):
            kind = "append" if "a" in mode else "update" if "+" in mode and "r" in mode else "write"
            return [(f"open-{kind}", path)] if any(c in mode for c in "wax+") else []
        flags = flags or 0
        if not flags & _WRITE_FLAGS:
            return []
        kind = "append" if flags & os.O_APPEND else "write" if flags & (os.O_CREAT | os.O_TRUNC) else "update"
        return [(f"open-{kind}", path)]
    if event in ("os.mkdir", "os.remove", "os.rmdir", "os.truncate", "os.chmod", "os.utime", "shutil.rmtree"):
        return [(event, args[0])]
    if event in ("os.rename", "shutil.move"):
        return [(event, args[1]), (event, args[0])]
    if event in ("os.link", "os.symlink", "shutil.copyfile"):
        return [(event, args[1])]
    return []


def _hook(event: str, args: tuple) -> None:
    if not _WATCHES:
        return
    for what, raw in _changes(event, args):
        if isinstance(raw, int) or raw is None:  # a descriptor (the lock's truncate, mkstemp's chmod): its open was seen
            continue
        path = Path(os.path.abspath(os.fsdecode(raw)))
        current = phase.current()
        for watch in _WATCHES:
            if path.is_relative_to(watch.root):
                watch.seen.append(Change(what, path, None if current is None else current.checking))


sys.addaudithook(_hook)


def _watched(root: Path, run: Callable[[], None]) -> list[Change]:
    watch = Watch(root.resolve())
    _WATCHES.append(watch)
    try:
        run()
    finally:
        _WATCHES.remove(watch)
    return watch.seen


def _lock_or_its_folders(change: Change, seen: list[Change]) -> bool:
    """The lock file a command takes before its checks, or a folder made to hold one."""
    locks = [c.path for c in seen if c.path.name.endswith(".lock")]
    return change.path.name.endswith(".lock") or (change.event == "os.mkdir" and
                                                   any(lock.is_relative_to(change.path) for lock in locks))


def _command(main: Callable[[], None], argv: list[str], monkeypatch) -> Callable[[], None]:
    def run() -> None:
        monkeypatch.setattr(sys, "argv", argv)
        monkeypatch.setattr(sweep_jobs, "failed", [])
        try:
            main()
        except SystemExit as exc:
            assert exc.code in (0, None), f"{argv[0]} exited {exc.code}"
    return run


def _images(root: Path) -> Path:
    for split in ("train", "val"):
        for cls, seed in (("c0", 1), ("c1", 2)):
            path = root / split / cls / f"{seed}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(np.random.default_rng(seed).integers(0, 255, (20, 24, 3), dtype=np.uint8)).save(path)
    return root


def _make_shards(argv: list[str]) -> Callable[[], None]:
    def main() -> None:  # as `python -m quest.tools.make_shards` runs (its __main__ block)
        from quest.tools.make_shards import main as make_shards

        with reporting_errors(program_name("python -m quest.tools.make_shards")):
            make_shards(argv)
    return main


# every command, in the order a user meets them; each writes into its own folder under the test's, and the later ones
# read what the first wrote (the trained run, the image folder)
COMMANDS = {
    "train.py": lambda t: (cli.train, ["train.py", *TRAIN, f"hydra.run.dir={t / 'sweep' / 'run'}"]),
    "train.py (finished)": lambda t: (cli.train, ["train.py", *TRAIN, f"hydra.run.dir={t / 'sweep' / 'run'}"]),
    "eval.py": lambda t: (cli.evaluate, ["eval.py", f"checkpoint={t / 'sweep' / 'run' / 'checkpoints' / 'last.pt'}",
                                         "eval=clean", "eval.clean.max_samples=8", f"hydra.run.dir={t / 'eval'}"]),
    "quest-export": lambda t: (cli.export, ["quest-export", str(t / "sweep" / "run"), "--out", str(t / "export")]),
    "quest-report": lambda t: (cli.report, ["quest-report", str(t / "sweep"), "--out", str(t / "report")]),
    "quest-plot": lambda t: (cli.plot, ["quest-plot", "perf", str(t / "sweep" / "run"), "--out",
                                        str(t / "figures" / "perf.png")]),
    "quest-data check": lambda t: (cli.data, ["quest-data", "check", str(t / "images")]),
    "quest-data cap": lambda t: (cli.data, ["quest-data", "cap", str(t / "images"), str(t / "capped"),
                                            "--short-side", "16"]),
    "make_shards": lambda t: (_make_shards(["convert", str(t / "images"), str(t / "shards"), "--name", "toy",
                                            "--shard-size", "2"]), ["make_shards"]),
    "quest-toy": lambda t: (cli.toy, ["quest-toy", *TOY, f"hydra.run.dir={t / 'toy'}"]),
}


@pytest.fixture(scope="module")
def commands_ran(tmp_path_factory) -> dict[str, list[Change]]:
    """Every command, once, in order, each watched; what each changed under the test's folder."""
    root = tmp_path_factory.mktemp("commands")
    _images(root / "images")
    seen = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        mp.delenv("HYDRA_FULL_ERROR", raising=False)
        for name, command in COMMANDS.items():
            main, argv = command(root)
            seen[name] = _watched(root, _command(main, argv, mp))
    return seen


@pytest.mark.parametrize("name", list(COMMANDS))
def test_a_command_changes_nothing_before_its_checks_are_done(commands_ran, name):
    seen = commands_ran[name]
    early = [c for c in seen if c.checking and not _lock_or_its_folders(c, seen)]
    assert early == [], early[:5]
    assert any(c.checking is not None for c in seen), f"{name} ran outside any command's phases: {seen[:5]}"
    if name != "train.py (finished)":  # a finished run is left as it was: nothing to change
        assert any(c.checking is False for c in seen), f"{name} changed nothing after its checks: {seen[:5]}"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_file_a_command_writes_is_written_whole(commands_ran, name):
    """A file is made under a temporary name and renamed into place once complete (quest.store.files.atomic_write),
    never written at its own name, where a reader, or a crash, would find half of it; only line records and logs
    (``.jsonl``, ``.log``) grow in place, by appending whole lines (and cutting a line a killed writer left half
    written), and the lock file is the lock's own."""
    seen = commands_ran[name]
    at_its_name = [c for c in seen if c.event == "open-write" and not c.path.name.endswith((".tmp", ".lock"))]
    in_place = [c for c in seen if c.event in ("open-append", "open-update") and c.path.suffix not in (".jsonl", ".log")
                and not c.path.name.endswith(".lock")]
    assert at_its_name == [] and in_place == [], (at_its_name + in_place)[:5]


def test_a_write_during_a_commands_checks_is_a_bug_and_nothing_is_written(tmp_path, capsys):
    """The store refuses it (exit 70, quest's own mistake), and the file is not there."""
    target = tmp_path / "out" / "result.json"
    with pytest.raises(SystemExit) as exit_info, reporting_errors("quest-x"):
        write_text_atomic(target, "{}\n")
    assert exit_info.value.code == EXIT_BUG and "before its checks were done" in capsys.readouterr().err
    assert not target.exists() and not target.parent.exists()


def test_once_claimed_a_command_writes_and_what_its_checks_deferred_is_written_first(tmp_path):
    """What a check computed for later (the pre-flight's cache) waits for the changes, and a refused command never
    writes it; outside any command the store writes at once."""
    order: list[str] = []
    with reporting_errors("quest-x"):
        phase.after_checks(lambda: order.append("deferred"))
        assert order == []
        phase.begin_changes()
        atomic_write(tmp_path / "a", lambda f: order.append("written"))
    assert order == ["deferred", "written"]
    with pytest.raises(SystemExit), reporting_errors("quest-x"):
        phase.after_checks(lambda: order.append("refused"))
        raise ValueError("a refusal")
    assert order == ["deferred", "written"]
    write_text_atomic(tmp_path / "b", "outside any command\n")
    assert (tmp_path / "b").read_text() == "outside any command\n"
