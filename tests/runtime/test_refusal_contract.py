"""The refusal contract: a refused command prints one line ``<program>: error: ...`` naming what was wrong (one per
job of a sweep, and the sweep's), exits with its documented code (1; a tool's 2 for an input that makes it
impossible), shows no traceback, and leaves every entry under the test's folder as it was: the same names, kinds,
bytes, permission bits, modification times, link counts and link targets, no directory left behind (the one Hydra
made, its parents outside the working directory), none removed that was there before.

One runner (:func:`run_refused`) for every row of the tables in tests/runtime/refusal_cases.py and
tests/runtime/refusal_inputs.py, each command run in this process as its console script runs it (the
``quest.cli`` function, or the module's ``__main__`` block, with its argv), so that a missing package, a held lock
or an unwritable folder can be simulated. The damaged inputs feed the same runner: there a command may also read
the file right or repair it (exit 0), never exit 70 (a bug)."""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quest import cli
from quest.evaluation import register_eval_configs, run_evaluation
from quest.run import sweep_jobs
from quest.runtime.errors import EXIT_BUG, reporting_errors
from quest.store import made_dirs
from quest.store.tree import remove_made_dirs

from ..helpers import ROOT, compose_cfg, eval_cfg
from ..interop_helpers import make_image_folder
from .refusal_cases import (
    ROWS,
    SHARDS,
    SMALL_EVAL,
    TOY_SMALL,
    TRAIN,
    UNDER_TORCHRUN,
    ExitCodeDiffers,
    Refusal,
    Scene,
    TimesDiffer,
)
from .refusal_faults import Case, build_case, fault_cases, mounted_under, open_under
from .refusal_inputs import BELOW_ROWS, WANDB_ROWS, damage, damaged_cases


def _make_shards() -> None:
    """``python -m quest.tools.make_shards``: its ``__main__`` block."""
    from quest.runtime.errors import reporting_errors
    from quest.tools.make_shards import main

    with reporting_errors(SHARDS):
        main()


ENTRY = {"train.py": cli.train, "eval.py": cli.evaluate, "quest-toy": cli.toy, "quest-export": cli.export,
         "quest-report": cli.report, "quest-plot": cli.plot, "quest-data": cli.data, SHARDS: _make_shards}
register_eval_configs()
ARGV0 = {SHARDS: str(ROOT / "quest" / "tools" / "make_shards.py")}  # what program_name() reads back


def snapshot(root: Path) -> dict[str, tuple]:
    """Relative path -> (kind, permission bits, content, modification time, link count) of every entry under
    ``root``, never following a link (a link's content is its target). Two times are left out: a directory's own
    (making and removing an entry in it, a directory Hydra made and quest removed, changes it though nothing under
    it changed), and a lock file's, whose holder line a command writes before its checks (the folder must be held
    while they read it) and a refusal puts back: its bytes are compared."""
    out: dict[str, tuple] = {}
    for top, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(top, name)
            info = path.lstat()
            kind = stat.S_IFMT(info.st_mode)
            if stat.S_ISLNK(info.st_mode):
                content: str | None = os.readlink(path)
            elif stat.S_ISREG(info.st_mode):
                try:
                    content = hashlib.sha256(path.read_bytes()).hexdigest()
                except PermissionError:  # a damaged input made unreadable: its mode and time still count
                    content = None
            else:
                content = None
            when = None if stat.S_ISDIR(info.st_mode) or name.endswith(".lock") else info.st_mtime_ns
            out[str(path.relative_to(root))] = (kind, stat.S_IMODE(info.st_mode), content, when, info.st_nlink)
    return dict(sorted(out.items()))


def run_command(program: str, argv: list[str], cwd: Path, monkeypatch, capsys,
                entry: Callable[[], None] | None = None) -> tuple[int, str, str]:
    """``program`` with ``argv`` run in this process as a shell would (or ``entry``, the part of it a case runs):
    (exit code, stdout, stderr)."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [ARGV0.get(program, program), *argv])
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)  # what a user sees
    monkeypatch.setattr(sweep_jobs, "failed", [])  # this command's sweep only
    capsys.readouterr()
    code = 0
    try:
        (entry or ENTRY[program])()
    except SystemExit as exc:
        code = exc.code or 0
    said = capsys.readouterr()
    return int(code), said.out, said.err


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """What the commands read, made once: a run stopped at trainer.max_steps (.hydra/, train.log, checkpoints, ...),
    the same with an evaluation beside it, a run of before run.json (quest-report reads Hydra's copy of its config),
    its export, an image folder (checked), one with a file that is not an image, a capped copy, shards and a finished
    toy study."""
    from quest.tools.data_check import main as data_main
    from quest.tools.make_shards import main as shards_main

    base = tmp_path_factory.mktemp("inputs")
    run = base / "runs" / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(base)
        mp.setattr(sys, "argv", ["train.py", *TRAIN, f"hydra.run.dir={run}"])
        cli.train()
        evaluated = Path(shutil.copytree(run, base / "evaluated" / "run", symlinks=True))
        mp.setattr(sys, "argv", ["eval.py", f"checkpoint={evaluated}/checkpoints/last.pt", *SMALL_EVAL])
        cli.evaluate()
        mp.setattr(sys, "argv", ["quest-export", str(run), "--out", str(base / "export")])
        with pytest.raises(SystemExit, match="0"):
            cli.export()
        mp.setattr(sys, "argv", ["quest-toy", *TOY_SMALL, f"hydra.run.dir={base / 'toy'}"])
        cli.toy()
    old = Path(shutil.copytree(run, base / "old" / "run", symlinks=True))
    (old / "run.json").unlink()
    (old / ".hydra" / "config.yaml").write_text("model:\n  name: vit_pico_patch4_16\n")
    images = make_image_folder(base / "images", per_class=2, size=20)
    bad = Path(shutil.copytree(images, base / "bad_images"))
    next((bad / "train").rglob("*.png")).write_bytes(b"not an image")
    with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None):
        assert data_main(["cap", str(images), str(base / "capped"), "--short-side", "16", "--no-progress",
                          "--workers", "1"]) == 0
        assert data_main(["check", str(images), "--no-progress", "--workers", "1"]) == 0
        shards_main(["convert", str(images), str(base / "shards"), "--shard-size", "4"])
    assert (evaluated / "eval" / "clean" / "last-model" / "eval_results.json").is_file()
    return {"run": run, "runs": run.parent, "evaluated": evaluated, "old": old, "export": base / "export",
            "images": images, "bad_images": bad, "capped": base / "capped", "shards": base / "shards",
            "toy": base / "toy"}


def _scene(row: Refusal, tmp: Path, inputs: dict[str, Path], monkeypatch, capsys) -> Scene:
    """The places of ``row``'s case under ``tmp``, its folder in the row's state (refusal_cases' docstring)."""
    cwd = tmp / "cwd"
    cwd.mkdir()
    target = {"new": tmp / "elsewhere" / "a" / "b" / "run", "under_empty_parent": cwd / "runs" / "x" / "run"}.get(
        row.state, tmp / ("run" if row.state in ("earlier", "evaluated") else "out"))
    if row.state == "under_empty_parent":
        (cwd / "runs").mkdir()  # the user's, empty: it stays
    elif row.state in ("earlier", "evaluated", "toy"):
        shutil.copytree(inputs["run" if row.state == "earlier" else row.state], target, symlinks=True)
    scene = Scene(tmp, cwd, target, inputs, monkeypatch)
    if row.state == "first":  # a rerun: the folder as this command left it
        code, _, err = run_command(row.program, _args(row, scene), cwd, monkeypatch, capsys)
        assert code == 0, err[-3000:]
    return scene


def _places(scene: Scene) -> dict[str, Path]:
    return {**scene.inputs, "tmp": scene.tmp, "cwd": scene.cwd, "target": scene.target}


def _args(row: Refusal, scene: Scene) -> list[str]:
    return [a.format(**_places(scene)) for a in row.args]


def run_refused(row: Refusal, scene: Scene, capsys, ranks: int = 1) -> None:
    """The contract: ``row``'s command is refused as the row says and every entry under ``scene.tmp`` is as it was.
    ``ranks`` 2: run as each process of a torchrun group would (the environment torchrun gives it): rank 0 says the
    line, the others exit with the same code silently."""
    if row.setup is not None:
        row.setup(scene)
    before = snapshot(scene.tmp)
    said = []
    try:
        for rank in range(ranks):
            if ranks > 1:
                for name in ("RANK", "LOCAL_RANK"):
                    scene.monkeypatch.setenv(name, str(rank))
                scene.monkeypatch.setenv("WORLD_SIZE", str(ranks))
            said.append(run_command(row.program, _args(row, scene), scene.cwd, scene.monkeypatch, capsys))
    finally:
        for fd in scene.held:
            os.close(fd)
    code, out, err = said[0]
    text = (out + err)[-3000:]
    assert code not in (0, EXIT_BUG), text
    assert "Traceback" not in out + err and "Error executing job" not in out + err, text
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == row.errors and all(_by(row.program, line) for line in errors), text
    said_first = err[err.index(errors[0]):]  # its message may go on over more lines (one per problem, the way on)
    for words in row.says:
        assert words.format(**_places(scene)) in said_first, text
    # said once: not also as a log record on standard output
    assert errors[0].split(": error: ", 1)[1][:200] not in out, text
    assert all(other[0] == code and other[2] == "" for other in said[1:]), said[1:]
    if row.check is not None:
        row.check(scene)
    after = snapshot(scene.tmp)
    if row.claimed:  # its lock now names this command, in the folders made to hold it: nothing else changed
        lock = str((scene.target / ".lock").relative_to(scene.tmp))
        assert (scene.target / ".lock").read_text().startswith(f"pid {os.getpid()} "), "not claimed"
        made = {str(p.relative_to(scene.tmp)) for p in (scene.target, *scene.target.parents)
                if p.is_relative_to(scene.tmp)} - set(before)
        # a folder made under one that was there adds to that one's link count: a directory's is not compared here
        after, before = ({k: (*v[:4], None) if stat.S_ISDIR(v[0]) else v for k, v in state.items()
                          if k != lock and k not in made} for state in (after, before))
    assert _untimed(after) == _untimed(before), "the refused command changed the folder"
    if code != row.code:
        raise ExitCodeDiffers(f"exit {code}, expected {row.code}: {text}")
    if after != before:
        raise TimesDiffer(f"modification times changed: {sorted(k for k in after if after[k] != before.get(k))}")


def _by(program: str, line: str) -> bool:
    """``line`` is ``program``'s error line (``quest-data cap: error: ...`` is quest-data's)."""
    return re.match(rf"{re.escape(program)}( [a-z_]+)?: error: ", line) is not None


def _untimed(state: dict[str, tuple]) -> dict[str, tuple]:
    return {path: (*entry[:3], entry[4]) for path, entry in state.items()}


def _row(row: Refusal):
    marks = [pytest.mark.xfail(strict=True, raises=row.bug[0], reason=row.bug[1])] if row.bug else []
    return pytest.param(row, id=row.id, marks=marks)


@pytest.mark.parametrize("row", [_row(row) for row in [*ROWS, *WANDB_ROWS, *BELOW_ROWS]])
def test_a_refused_command_says_one_line_and_changes_nothing(row, tmp_path, inputs, monkeypatch, capsys):
    run_refused(row, _scene(row, tmp_path, inputs, monkeypatch, capsys), capsys)


@pytest.mark.parametrize("row", [_row(row) for row in ROWS if row.id in UNDER_TORCHRUN])
def test_under_torchrun_a_refused_start_is_said_once(row, tmp_path, inputs, monkeypatch, capsys):
    """Every process of a torchrun group runs the same command and finds the same refusal before it joined the
    group."""
    import quest.runtime.errors

    monkeypatch.setattr(quest.runtime.errors, "_joined", False)
    run_refused(row, _scene(row, tmp_path, inputs, monkeypatch, capsys), capsys, ranks=2)


def _work(program: str, args: list[str]) -> Callable[[], None]:
    """train.py's or eval.py's work once Hydra composed its config (quest.cli's _train, _evaluate): fit or
    run_evaluation inside the same error path, before any directory is made (quest.run.hydra_job). What reads the
    files is this part; the config is composed once, not twice as Hydra's app does."""
    overrides = [a for a in args if not a.startswith("hydra.run.dir=")]
    given = next((a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")), None)

    def work() -> None:
        from quest.train import exit_code, fit

        checkpoint = next((Path(a.split("=", 1)[1]) for a in overrides if a.startswith("checkpoint=")), None)
        out = Path(given) if given else checkpoint.parents[1] / "eval" / "clean" / "last-model"
        with reporting_errors(program):
            if program == "train.py":
                code = exit_code(fit(compose_cfg(*overrides), out))
            else:
                run_evaluation(eval_cfg(*overrides), out)
                code = 0
        if code:
            sys.exit(code)
    return work



def _damaged(reader, name: str, how: str):
    marks = [pytest.mark.unprivileged] if how == "unreadable" else []
    return pytest.param(reader, name, how, id=f"{reader.name}-{name}-{how}", marks=marks)


@pytest.mark.parametrize("reader, name, how", [_damaged(*case) for case in damaged_cases()])
def test_a_damaged_input_is_one_line_naming_it_or_read_right_never_a_bug(reader, name, how, tmp_path, inputs,
                                                                         monkeypatch, capsys):
    """The generated rows: exit 0 (read right, or repaired), or a refusal under the contract naming the file (a
    quest-data run that found problems may name it in its report instead); never exit 70, never a traceback."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    target = Path(shutil.copytree(inputs[reader.folder], tmp_path / "runs" / reader.folder, symlinks=True))
    damage(target / name, how)
    scene = Scene(tmp_path, cwd, target, inputs, monkeypatch)
    before = snapshot(tmp_path)
    args = _args(Refusal(f"{name} {how}", reader.program, reader.args, ()), scene)
    entry = _work(reader.program, args) if reader.program in ("train.py", "eval.py") else None
    code, out, err = run_command(reader.program, args, cwd, monkeypatch, capsys, entry)
    text = (out + err)[-3000:]
    assert code != EXIT_BUG and code in (0, 1, 2) and "Traceback" not in err, text
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) <= 1 and all(_by(reader.program, line) for line in errors), text
    if code:
        assert Path(name).name in (errors[0] if errors else out), text
    if errors:
        after = snapshot(tmp_path)
        assert _untimed(after) == _untimed(before), "the refused command changed the folder"
        if after != before:
            raise TimesDiffer(f"modification times changed: {sorted(k for k in after if after[k] != before.get(k))}")


def _fault(case: Case):
    marks = [pytest.mark.unprivileged] if case.fault == "read_only" else []
    return pytest.param(case, id=case.id, marks=marks)


@pytest.mark.parametrize("case", [_fault(case) for case in fault_cases()])
def test_a_fault_from_below_is_one_line_naming_it_never_a_bug(case, tmp_path, inputs, monkeypatch, capsys, request):
    """The generated faults (tests/runtime/refusal_faults.py): exit 0, 1 or 2, never 70, no traceback, at most one
    error line (a sweep: one per job and its own) naming the path, file or key; a refusal before any change leaves
    the folder as it was, and one at a full disk leaves no temporary file behind. Standard error escapes a name that
    is not UTF-8 as Python's own does (backslashreplace); standard output is strict, as a UTF-8 terminal's."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    scene = Scene(tmp_path, cwd, tmp_path / "out", inputs, monkeypatch)
    request.addfinalizer(lambda: [subprocess.run(["umount", "--lazy", point], check=True) for point in mounted_under(tmp_path)])
    args, names, writes, refused = build_case(case, scene)
    before = snapshot(tmp_path)
    sys.stderr.reconfigure(errors="backslashreplace")
    code, out, err = run_command(case.writer.program, args, cwd, monkeypatch, capsys)
    text = (out + err)[-3000:]
    assert code in (0, 1, 2) and code != EXIT_BUG, text
    assert "Traceback" not in out + err and "Error executing job" not in out + err, text
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) <= case.writer.errors and all(_by(case.writer.program, line) for line in errors), text
    assert not open_under(tmp_path), f"left open: {open_under(tmp_path)}"  # a job's lock or log kept by a failure
    if code == 0:
        assert not refused, f"{case.id}: written without asking whether it may: {text}"
        return
    said_first = err[err.index(errors[0]):] if errors else ""  # with its indented lines (one per problem)
    assert errors and all(name in said_first for name in names), text
    after = snapshot(tmp_path)
    if writes:
        assert not [p for p in after if p.endswith(".tmp")], "a temporary file was left behind"
        return
    assert _untimed(after) == _untimed(before), "the refused command changed the folder"
    assert after == before, f"modification times changed: {sorted(k for k in after if after[k] != before.get(k))}"


def test_a_rerun_of_a_finished_run_changes_nothing_either(tmp_path, inputs, monkeypatch, capsys):
    """Not a refusal, but the same promise: the finished run is reported, its directory as it was. A file named
    like the directory of a logger that is off (wandb, with logger=jsonl) is not in the way."""
    row = Refusal("rerun", "train.py", (*TRAIN, "hydra.run.dir={target}"), ())
    scene = _scene(row, tmp_path, inputs, monkeypatch, capsys)
    (scene.target / "wandb").write_text("the user's file\n")
    before = snapshot(tmp_path)
    code, _, err = run_command("train.py", _args(row, scene), scene.cwd, monkeypatch, capsys)
    assert code == 0, err[-3000:]
    assert snapshot(tmp_path) == before


# --- the mechanism: which directories a command made -------------------------------------------------------------
@settings(max_examples=60)
@given(existing=st.sets(st.sampled_from(["a", "a/b", "a/b/c", "d", "d/e"])),
       target=st.sampled_from(["a/b/c/run", "a/x/run", "d/e", "d/e/f/g", "q/r", "a"]))
def test_only_the_directories_that_were_missing_are_removed(existing, target, tmp_path_factory):
    """Whatever existed before (an empty directory too) stays; what a refused command's lock made goes."""
    root = tmp_path_factory.mktemp("m")
    for name in existing:
        (root / name).mkdir(parents=True, exist_ok=True)
    before = set(root.rglob("*"))
    made = made_dirs.missing_dirs(root / target)
    assert all(not p.exists() for p in made) and (made[-1].parent.exists() if made else True)
    (root / target).mkdir(parents=True, exist_ok=True)  # as the lock makes it
    remove_made_dirs(made)
    assert set(root.rglob("*")) == before
