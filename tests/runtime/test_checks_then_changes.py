"""Checks, then changes (quest.runtime.phase), for every command, held by what the operating system is asked to do.

An audit hook (``sys.addaudithook``, PEP 578) sees every file opened for writing, every folder made or removed, every
rename, link and removal this process asks for, whoever asks (quest's store, Hydra, TensorBoard, a library), with the
phase of the command running at that moment. Each command runs in this process as its console script does (its
function in quest.cli with its argv, so inside its error path and its phases) on a small real input, and the test
checks that nothing under the test's folder was changed while the command was still in its checks, except its lock
file (taken before the checks and put back by a refusal, tests/runtime/test_refusal_contract.py) and the
folders that hold it; that nothing was changed outside the command's phases (Hydra's own directories and a sweep's
``multirun.yaml`` included: quest.run.hydra_job); and that its changes did begin, so that the hook saw the phase
at work. Refused commands, single runs and sweeps, are watched the same way: the hook sees no directory made but the
lock's folders, which the refusal puts back with the lock, and nothing written.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from quest import cli
from quest.run import sweep_jobs
from quest.runtime import phase
from quest.runtime.errors import EXIT_BUG, program_name, reporting_errors
from quest.store.files import atomic_write, write_text_atomic

from ..helpers import FAST
from ..interop_helpers import make_image_folder

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
    """The lock file a command takes before its checks, or a folder made to hold one (or removed again with it)."""
    locks = [c.path for c in seen if c.path.name.endswith(".lock")]
    return change.path.name.endswith(".lock") or (change.event in ("os.mkdir", "os.rmdir") and
                                                   any(lock.is_relative_to(change.path) for lock in locks))


def _command(main: Callable[[], None], argv: list[str], monkeypatch, code: int = 0) -> Callable[[], None]:
    def run() -> None:
        monkeypatch.setattr(sys, "argv", argv)
        monkeypatch.setattr(sweep_jobs, "failed", [])
        try:
            main()
        except SystemExit as exc:
            assert (exc.code or 0) == code, f"{argv[0]} exited {exc.code}"
        else:
            assert code == 0, f"{argv[0]} was not refused"
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
    "train.py -m": lambda t: (cli.train, ["train.py", "-m", *TRAIN, "trainer.seed=3",
                                          f"hydra.sweep.dir={t / 'multirun' / 'sweep'}"]),
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
    outside = [c for c in seen if c.checking is None]  # Hydra's run_job would make the job's directory here
    assert outside == [], outside[:5]
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


def test_a_sweeps_record_is_written_with_its_first_jobs_first_change(commands_ran):
    """multirun.yaml, which Hydra's sweeper writes before the first job, is the accepted job's first change."""
    seen = [c for c in commands_ran["train.py -m"] if c.checking is False]
    record = [i for i, c in enumerate(seen) if "multirun.yaml" in c.path.name]  # its temporary file, then the rename
    assert record and record[0] == min(i for i, c in enumerate(seen) if c.event != "os.mkdir"), seen[:5]


# refused commands, each into folders that do not exist yet: a refusal by the config's checks (before the lock) and
# one by the data pre-flight (after it: an image folder beside the watched one, where the pre-flight keeps its cache);
# the sweeps refuse every job
REFUSED = {
    "train.py, a value": lambda t: (cli.train, ["train.py", *TRAIN, "recipe.lr=-1", f"hydra.run.dir={t / 'a' / 'run'}"]),
    "train.py, its data": lambda t: (cli.train, ["train.py", *[a for a in TRAIN if not a.startswith("data")],
                                                 "data=imagefolder", "data.num_classes=3",
                                                 "data.num_workers=0", f"data.root={t.parent / 'bad_images'}",
                                                 f"hydra.run.dir={t / 'b' / 'run'}"]),
    "train.py, hydra.job.chdir": lambda t: (cli.train, ["train.py", *TRAIN, "hydra.job.chdir=true",
                                                        f"hydra.run.dir={t / 'h' / 'run'}"]),
    "eval.py": lambda t: (cli.evaluate, ["eval.py", "model=vit_pico", "attention=standard", "eval=clean",
                                         "eval.batch_size=0", f"hydra.run.dir={t / 'c' / 'results'}"]),
    "quest-toy": lambda t: (cli.toy, ["quest-toy", *TOY, "data.train_size=-1", f"hydra.run.dir={t / 'd' / 'toy'}"]),
    "train.py -m": lambda t: (cli.train, ["train.py", "-m", *TRAIN, "recipe.lr=-1,-2",
                                          f"hydra.sweep.dir={t / 'e' / 'sweep'}"]),
    "eval.py -m": lambda t: (cli.evaluate, ["eval.py", "-m", "model=vit_pico", "attention=standard,quest", "eval=clean",
                                            "eval.batch_size=0", f"hydra.sweep.dir={t / 'f' / 'sweep'}"]),
    "quest-toy -m": lambda t: (cli.toy, ["quest-toy", "-m", *TOY, "data.train_size=-1,-2",
                                         f"hydra.sweep.dir={t / 'g' / 'sweep'}"]),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_a_refused_command_makes_no_directory_and_writes_nothing(name, tmp_path, monkeypatch, capsys):
    """Not made and removed again: the hook sees no directory made (Hydra's run or sweep directory, a job's) and
    no file written, multirun.yaml included; only the lock, with the folders that hold it, taken and put back."""
    watched = tmp_path / "watched"
    (watched / "cwd").mkdir(parents=True)
    images = make_image_folder(tmp_path / "bad_images", per_class=2)
    next((images / "train").rglob("*.png")).write_bytes(b"not an image")
    monkeypatch.chdir(watched / "cwd")
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    main, argv = REFUSED[name](watched)
    seen = _watched(watched, _command(main, argv, monkeypatch, code=1))
    assert "error:" in capsys.readouterr().err
    changed = [c for c in seen if not _lock_or_its_folders(c, seen)]
    assert changed == [], changed[:5]
    assert sorted(p.name for p in watched.rglob("*")) == ["cwd"]
    if name == "train.py, its data":  # refused after its lock: the lock's folders were made, and put back
        assert any(c.event == "os.rmdir" for c in seen), seen[:5]


def test_a_slurm_job_refused_on_its_node_makes_no_directory_of_its_own(tmp_path, monkeypatch, capsys):
    """``hydra/launcher=slurm_cpu``, each job run here as submitit runs it on its node (submitit's executor replaced
    by one that calls the job: no cluster is needed to see what the job does): the refused job makes no
    directory. The sweep directory and its multirun.yaml are made before the first job, as Hydra's sweeper makes them:
    the jobs' logs go there when they are submitted."""
    pytest.importorskip("submitit")
    import submitit

    class OnThisNode:  # submitit's executor, each job called here instead of submitted with sbatch
        def __init__(self, **params):
            pass

        def update_parameters(self, **params):
            pass

        def map_array(self, job, *columns):
            return [SimpleNamespace(results=lambda ret=job(*args): [ret]) for args in zip(*columns)]

    monkeypatch.setattr(submitit, "AutoExecutor", lambda cluster, **params: OnThisNode(**params))
    monkeypatch.setattr(submitit, "JobEnvironment", lambda: SimpleNamespace(job_id="42_0"))
    from quest.run import sweep_jobs

    monkeypatch.setattr(sweep_jobs, "slurm_problem", lambda: None)  # a cluster that answers: the jobs run here
    watched, sweep = tmp_path / "watched", tmp_path / "watched" / "sweep"
    (watched / "cwd").mkdir(parents=True)
    monkeypatch.chdir(watched / "cwd")
    argv = ["train.py", "-m", "hydra/launcher=slurm_cpu", *TRAIN, "recipe.lr=-1", f"hydra.sweep.dir={sweep}"]
    seen = _watched(watched, _command(cli.train, argv, monkeypatch, code=1))
    assert "recipe.lr must be > 0" in capsys.readouterr().err
    made = {c.path for c in seen if c.event == "os.mkdir" and not _lock_or_its_folders(c, seen)}
    assert made == {sweep}, made  # asked for by the sweeper and again by the plugin's submission
    assert sorted(p.name for p in sweep.iterdir()) == ["multirun.yaml"]


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
