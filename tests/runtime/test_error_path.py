"""One error path (quest/runtime/errors.py), the mechanism: a user error is exactly its message on one line
`<program>: error: ...` with exit code 1, a bug of quest keeps its traceback and says so, memory and a full disk are
described, torchrun's ranks say an error once, the program is named as the user typed it, and a multirun's refused
job does not stop the good one. Every command's refusals through it (one line, its exit code, the folder as it was)
are rows of the refusal contract (tests/runtime/test_refusal_contract.py)."""
from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quest.runtime.errors import EXIT_BUG, EXIT_ERROR, control_character_problems, describe, program_name, reporting_errors

from ..helpers import FAST
from ..run.test_runs import _run_dir_name
from ..warm import run_app

# what a user sees: Hydra's full-error switch (set for the rest of the suite) off
ENV = {k: v for k, v in os.environ.items() if k != "HYDRA_FULL_ERROR"}


def test_each_job_of_a_multirun_reports_its_own_error_and_the_sweep_goes_on(tmp_path):
    fast = [a for a in FAST if not a.startswith("trainer.")] + ["trainer.max_steps=1"]
    out = run_app("train.py", "-m", *fast, "recipe.lr=-1,1e-3", cwd=tmp_path, env=ENV)
    assert out.returncode == EXIT_ERROR and "Traceback" not in out.stderr, out.stderr[-3000:]
    first, sweep = out.stderr.split("train.py: error: ")[1:]  # the job's error, then the sweep's
    assert "recipe.lr must be > 0" in first and sweep.startswith("1 job(s) of the sweep failed: "), out.stderr
    assert sweep.rstrip().endswith("(refused; its error is above)"), out.stderr
    ran = [str(p.parent.relative_to(tmp_path)) for p in (tmp_path / "runs").glob("*/*/summary.json")]
    assert ran == [_run_dir_name(*fast, "recipe.lr=1e-3")]  # the good job ran; the refused one left no directory


@pytest.mark.process
def test_a_sweep_of_the_installed_command_outside_the_checkout_reaches_its_jobs(tmp_path):
    """The README's editable install, its console script run from another folder (a real interpreter: Hydra lists
    its plugins as the process starts, and outside the checkout the editable install's hook cannot be listed). Its
    sweeper was made from a BasicSweeper that Hydra's listing then replaced: every sweep failed to compose."""
    import subprocess
    import sys

    script = Path(sys.executable).parent / "quest-train"
    assert script.is_file(), f"{script}: the suite runs in the venv the README installs (pip install -e)"
    out = subprocess.run([str(script), "-m", "recipe.lr=-1,-2", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
    assert out.returncode == EXIT_ERROR and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.count("recipe.lr must be > 0") == 2 and "2 job(s) of the sweep failed" in out.stderr, out.stderr


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


def _splits_or_controls(text: str) -> bool:
    """Independent of the check's own definition: a C0 control but the tab, DEL or a C1 control (what a terminal
    acts on), or a character at which Python splits lines."""
    return any((ord(c) < 32 and c != "\t") or 127 <= ord(c) <= 159 for c in text) or len(f"a{text}b".splitlines()) > 1


@given(arg=st.text(alphabet=st.characters(exclude_categories=["Cs"])) | st.sampled_from(
    ["runs/a/last.pt\nruns/b/last.pt", "x\x1b[2Jy", "a\u2028b", "tab\there", "trailing\r", "nul\x00"]))
def test_an_argument_is_refused_exactly_when_it_would_split_or_rewrite_its_error_line(arg):
    """quest-* commands refuse such an argument before any work (the refusal contract's line_break_name rows show
    it per command); the refusal itself is one line, the argument shown escaped, its printable text kept."""
    problems = control_character_problems(["eval=clean", arg])
    assert bool(problems) == _splits_or_controls(arg)
    for line in problems:
        assert not _splits_or_controls(line), line
        assert all(part in line for part in "".join(c if not _splits_or_controls(c) else "\0" for c in arg).split("\0"))


def test_user_errors_and_bugs(capsys, monkeypatch):
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    code, err = _report(ValueError("recipe.lr must be > 0"), capsys)
    assert code == EXIT_ERROR and err == "prog: error: recipe.lr must be > 0\n"
    code, err = _report(FileNotFoundError(2, "No such file or directory", "/data/x"), capsys)
    assert code == EXIT_ERROR and err == "prog: error: No such file or directory: /data/x\n"
    code, err = _report(KeyError("a bug"), capsys)  # not the user's: the traceback, and a line saying so
    assert code == EXIT_BUG and "Traceback" in err and "prog: internal error: this is a bug in quest" in err
    code, err = _report(KeyboardInterrupt(), capsys)  # Ctrl-C: the user's choice, one line, the shell's 130
    assert code == 130 and err.startswith("prog: interrupted: ") and err.count("\n") == 1


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
