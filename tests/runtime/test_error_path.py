"""One error path (quest/runtime/errors.py): every mistake a user can make reaches them as one line `<program>: error: ...`
with exit code 1, never a traceback, also when the refusal comes from inside the run; a refused command leaves the
directory it ran in as it was (no run directory, no lock file); a bug of quest keeps its traceback and says so."""
from __future__ import annotations

import contextlib
import hashlib
import io
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from quest.runtime.errors import EXIT_BUG, EXIT_ERROR, describe, program_name, reporting_errors
from quest.store.locks import lock_file

from ..helpers import FAST
from ..interop_helpers import make_image_folder
from ..warm import run_app

# what a user sees: Hydra's full-error switch (set for the rest of the suite) off
ENV = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}


def _tree(root: Path) -> dict[str, str]:
    """Every path under root with a hash of its content (directories too): what a command must leave as it was.
    Not the pre-flight's cache of a data root's check (.quest-preflight.json, docs/data.md): kept on purpose, so
    that the corrected command does not read every image again."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(root.rglob("*")) if p.name != ".quest-preflight.json"}


def _refused(tmp_path: Path, *args: str, names: str) -> str:
    before = _tree(tmp_path)
    base = FAST if not any(a.startswith("data=") for a in args) else [a for a in FAST if not a.startswith("data.fake")]
    out = run_app("train.py", *base, *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env=ENV)
    text = out.stdout + out.stderr
    assert out.returncode == EXIT_ERROR, text[-3000:]
    assert "Traceback" not in text and "Error executing job" not in text, text[-3000:]
    # one error, the last thing printed (its message may go on over indented lines, one per problem)
    assert out.stderr.count("train.py: error: ") == 1, out.stderr[-3000:]
    error = out.stderr[out.stderr.index("train.py: error: "):]
    assert names in error, out.stderr[-3000:]
    assert _tree(tmp_path) == before, "the refused command changed the directory it ran in"
    return error


# refusals raised inside the run (after Hydra composed the config): the examples, each naming its key
@pytest.mark.parametrize("args, names", [
    (["recipe.lr=-1"], "recipe.lr"),
    (["data.batch_size=0"], "data.batch_size"),
    (["trainer.epochs=0"], "trainer.epochs"),
    (["model.img_size=30"], "img_size"),
    (["trainer.precision=fp8"], "trainer.precision"),
    (["data=imagefolder", "data.num_classes=2"], "data.root"),
])
def test_a_refusal_from_inside_the_run_is_one_line_and_leaves_nothing(tmp_path, args, names):
    _refused(tmp_path, *args, names=names)


def test_a_data_preflight_refusal_is_one_line_and_leaves_nothing(tmp_path):
    data = make_image_folder(tmp_path / "data", per_class=2)
    bad = next((data / "train").rglob("*.png"))
    bad.write_bytes(b"not an image")
    _refused(tmp_path, "data=imagefolder", f"data.root={data}", "data.num_classes=3", "data.num_workers=0",
             names=bad.name)


def test_a_run_directory_in_use_is_one_line_and_keeps_the_holders_lock(tmp_path):
    run = tmp_path / "run"
    fd = lock_file(run / ".lock", "test")  # another process's run: this test holds its lock
    os.pwrite(fd, b"pid 1 on elsewhere\n", 0)
    try:
        line = _refused(tmp_path, names="in use by another process")
        assert "pid 1 on elsewhere" in line
    finally:
        os.close(fd)


def test_an_unreadable_checkpoint_version_is_one_line(tmp_path):
    run = tmp_path / "run"
    ok = run_app("train.py", *FAST, "trainer.max_steps=1", f"hydra.run.dir={run}", cwd=tmp_path, env=ENV)
    assert ok.returncode == 0, ok.stderr[-3000:]
    last = run / "checkpoints" / "last.pt"
    ckpt = torch.load(last, weights_only=True)
    ckpt["version"] = 999
    torch.save(ckpt, last)
    (run / "summary.json").unlink()  # an interrupted run: the next command resumes from last.pt
    _refused(tmp_path, "trainer.max_steps=2", names="last.pt")


def test_each_job_of_a_multirun_reports_its_own_error_and_the_sweep_goes_on(tmp_path):
    fast = [a for a in FAST if not a.startswith("trainer.")] + ["trainer.max_steps=1"]
    out = run_app("train.py", "-m", *fast, "recipe.lr=-1,1e-3", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                  cwd=tmp_path, env=ENV)
    assert out.returncode == EXIT_ERROR and "Traceback" not in out.stderr, out.stderr[-3000:]
    first, sweep = out.stderr.split("train.py: error: ")[1:]  # the job's error, then the sweep's
    assert "recipe.lr must be > 0" in first and sweep.startswith("1 job(s) of the sweep failed: "), out.stderr
    assert sweep.rstrip().endswith("(refused; its error is above)"), out.stderr
    summaries = list((tmp_path / "sweep").glob("*/summary.json"))
    assert len(summaries) == 1  # the good job ran; the refused one left no directory


# --- the mechanism itself, in-process ---------------------------------------------------------------------------
def _report(exc: BaseException, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_, reporting_errors("prog"):
        raise exc
    return exit_.value.code, capsys.readouterr().err


@given(message=st.text(min_size=1).filter(lambda t: t.strip() and "\n" not in t and "\r" not in t))
def test_a_user_error_is_exactly_its_message_on_one_line(message):
    err = io.StringIO()
    with mock.patch.dict(os.environ), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        os.environ.pop("HYDRA_FULL_ERROR", None)
        with reporting_errors("prog"):
            raise ValueError(message)
    assert exit_.value.code == EXIT_ERROR and err.getvalue() == f"prog: error: {message}\n"


def test_user_errors_and_bugs(capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    code, err = _report(ValueError("recipe.lr must be > 0"), capsys)
    assert code == EXIT_ERROR and err == "prog: error: recipe.lr must be > 0\n"
    code, err = _report(FileNotFoundError(2, "No such file or directory", "/data/x"), capsys)
    assert code == EXIT_ERROR and err == "prog: error: No such file or directory: /data/x\n"
    code, err = _report(KeyError("a bug"), capsys)  # not the user's: the traceback, and a line saying so
    assert code == EXIT_BUG and "Traceback" in err and "prog: internal error: this is a bug in quest" in err


def _as_rank(monkeypatch, rank: int, world: int = 2) -> None:
    """This process as rank ``rank`` of ``world`` under torchrun: the environment torchrun gives its workers."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_RANK", str(rank))


@pytest.mark.parametrize("joined", [False, True])
def test_under_torchrun_an_error_every_rank_finds_is_printed_by_rank_0_alone(joined, capsys, monkeypatch):
    """Before the processes joined their group, every check reads what they all share (the command line, the
    config): rank 0 says the error, the others exit with the same code silently. After, an error marked every_rank
    (a broadcast decision, a check over every rank's data) the same; any other may be the process's own (its node's
    files): each rank that finds it says it, naming itself."""
    import quest.runtime.errors
    from quest.runtime.errors import every_rank

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.setattr(quest.runtime.errors, "_joined", joined)
    said = {}
    for rank in (0, 1, 2):
        _as_rank(monkeypatch, rank, world=3)
        said[rank] = (_report(every_rank(ValueError("the results directory holds another evaluation")), capsys),
                      _report(FileNotFoundError(2, "No such file or directory", "/data/x"), capsys))
    shared, own = "prog: error: the results directory holds another evaluation\n", "No such file or directory: /data/x"
    assert [said[r][0] for r in (0, 1, 2)] == [(EXIT_ERROR, shared), (EXIT_ERROR, ""), (EXIT_ERROR, "")]
    assert said[0][1] == (EXIT_ERROR, f"prog: error: {own}\n")
    assert [said[r][1] for r in (1, 2)] == ([(EXIT_ERROR, f"prog: error: rank {r}: {own}\n") for r in (1, 2)] if joined
                                            else [(EXIT_ERROR, "")] * 2)
    _as_rank(monkeypatch, 1)
    code, err = _report(KeyError("a bug"), capsys)  # a bug's traceback: from every process that has one
    assert code == EXIT_BUG and "Traceback" in err


def test_a_full_disk_names_the_file_and_the_space_left(tmp_path):
    text = describe(OSError(28, "No space left on device", str(tmp_path / "out" / "shard-0003.tar")))
    assert text.startswith(f"No space left on device: {tmp_path / 'out' / 'shard-0003.tar'} (")
    assert "MiB left on that file system" in text


def test_too_little_memory_for_the_config_is_the_users_one_line_with_the_size(capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    cpu = RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                       "tried to allocate 256000000000000 bytes. Error code 12 (Cannot allocate memory)")
    code, err = _report(cpu, capsys)  # data.num_classes=10**12: the head's weight (256 * 10**12 floats)
    assert code == EXIT_ERROR and err.startswith("prog: error: out of memory (an allocation of 238,418.6 GiB): ")
    assert "data.batch_size" in err and err.count("\n") == 1
    code, err = _report(MemoryError(), capsys)  # Python's own: a list of 10**12 indices
    assert code == EXIT_ERROR and err.startswith("prog: error: out of memory: MemoryError. Lower")
    code, err = _report(RuntimeError("mat1 and mat2 shapes cannot be multiplied"), capsys)  # any other: a bug
    assert code == EXIT_BUG and "Traceback" in err


@pytest.mark.parametrize("tool, argv", [
    ("quest.tools.data_check", ["cap", "{missing}", "{tmp}/out", "--short-side", "64", "--no-progress"]),
    ("quest.tools.data_check", ["check", "{missing}", "--no-progress"]),
    ("quest.tools.export", ["{missing}", "--out", "{tmp}/out"]),
    ("quest.report.__main__", ["{missing}"]),
    ("quest.report.plot", ["diagnostics", "{missing}", "--out", "{tmp}/out.png"]),
])
def test_a_tool_refusing_its_input_prints_one_error_line_and_exits_2(tmp_path, capsys, tool, argv):
    """The tools' own refusals have the format of every other error, `<program>: error: <message>`; their exit code
    is 2 (as argparse's), since 1 means "ran and found problems" (docs/training.md, "Errors")."""
    import importlib

    main = importlib.import_module(tool).main
    missing = tmp_path / "no-such-run"
    code = main([a.format(missing=missing, tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and ": error: " in lines[0] and str(missing) in lines[0], err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv0, expected", [
    ("train.py", "train.py"), ("/usr/bin/quest-eval", "quest-eval"),
    (str(Path(__file__).parents[2] / "quest" / "tools" / "data_check.py"), "python -m quest.tools.data_check"),
    (str(Path(__file__).parents[2] / "quest" / "toy" / "__main__.py"), "python -m quest.toy"),
    # another program under the same tree (a venv inside the checkout): not a quest module
    (str(Path(__file__).parents[2] / ".venv" / "lib" / "pytest" / "__main__.py"), "fallback"),
    ("/somewhere/else.py", "fallback"), ("", "fallback"),
])
def test_the_program_is_named_as_the_user_typed_it(monkeypatch, argv0, expected):
    monkeypatch.setattr("sys.argv", [argv0])
    assert program_name("fallback") == expected
