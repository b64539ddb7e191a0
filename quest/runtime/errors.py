"""One error path for every entry point: a mistake the user can fix reaches them as one line,
``<program>: error: <message>``, and a documented exit code; a bug of quest keeps its traceback, with one line
saying that it is one.

Every command (train.py and each job of a multirun, eval.py, the toy study, every ``quest-*`` tool) runs its work
inside :func:`reporting_errors`. What counts as the user's (:func:`is_user_error`): a bad value or file
(``ValueError``: quest's ConfigError, DamagedFile, ShardError, ... and the checks of the libraries it calls), the file
system (``OSError``: a missing or unreadable path, a full disk, a read-only directory, a directory another process
holds), too little memory for what the config asks (MemoryError, torch's allocators), a missing optional package
(MissingExtra), a config the schema refuses (OmegaConf's errors), and any exception class that says so with
:class:`UserError`. Everything else is a bug: its traceback is printed.

``HYDRA_FULL_ERROR=1`` (Hydra's own switch) shows the traceback of a user error too.

Under torchrun or srun every process runs the same command, so a refused start would say the same line once per
process. A user error is printed by rank 0 alone, the others exiting with the same code silently, where every
process is known to find the same one: before the process joined its group (:func:`joined_group`; the checks until
then read the command line and the config, which every process shares), or when the exception is marked
:func:`every_rank` (a decision of rank 0 broadcast to the others, a check whose message every rank computes from
what all of them gathered). Any other user error of a process other than rank 0 may be its own (its node's files,
its GPU's memory): it is printed, ``rank <n>: `` before the message, by the process that found it. A bug's
traceback is printed by every process that has one.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import inspect
import os
import re
import shutil
import sys
import traceback
import unicodedata
from collections.abc import Iterator, Sequence
from pathlib import Path

from quest.runtime.phase import command_phases

__all__ = ["UserError", "EXIT_ERROR", "EXIT_BUG", "EXIT_USAGE", "EXIT_INTERRUPTED", "input_error", "is_user_error",
           "out_of_memory", "describe", "escaping_stdout", "reporting_errors", "program_name", "doc_summary", "every_rank",
           "joined_group", "print_error", "control_character_problems", "parse_arguments", "printable"]

EXIT_ERROR = 1  # the user's mistake: a bad value, file, permission, full disk, missing extra, a directory in use
EXIT_BUG = 70  # a bug of quest (sysexits' EX_SOFTWARE): the traceback is printed, please report it
#: the tools (quest-data, quest-export, quest-report, quest-plot) exit 2 when their input makes the command impossible,
#: as argparse does for a bad argument: their 1 means "ran, and found problems" (quest-data check, an unreadable image)
EXIT_USAGE = 2
#: a command stopped by Ctrl-C (SIGINT) outside training's own handler: the shell's 128 + 2, as training's
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """Mixin for an exception the user can fix from its message alone (no traceback is shown)."""


def is_user_error(exc: BaseException) -> bool:
    from omegaconf.errors import OmegaConfBaseException

    from quest.runtime.extras import MissingExtra

    return isinstance(exc, (UserError, ValueError, OSError, MissingExtra, OmegaConfBaseException)) or out_of_memory(exc)


def out_of_memory(exc: BaseException) -> bool:
    """The machine's memory (or the GPU's) was too small for what the config asks: a user's to fix, like a full disk.
    torch's CPU allocator says so in a RuntimeError, CUDA's in torch.OutOfMemoryError."""
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or (
        isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc))


def describe(exc: BaseException) -> str:
    """The message for the one error line: the exception's own, and for the file system the path and, when the
    disk is full, the space left where it was writing."""
    if isinstance(exc, OSError) and exc.strerror:  # the system's error: strerror and the path, no class name
        # of two paths (a rename, a link), the second is where it was going: the file the user knows (the first is
        # a temporary of quest.store.files.atomic_write)
        path = exc.filename2 or exc.filename
        text = f"{exc.strerror}" + (f": {path}" if path else "")
        if exc.errno in (errno.ENOSPC, errno.EDQUOT) and path:
            folder = next((p for p in [Path(path), *Path(path).parents] if p.exists()), None)
            if folder is not None:
                text += f" ({shutil.disk_usage(folder).free / 2**20:.1f} MiB left on that file system)"
        return text
    if out_of_memory(exc):
        tried = re.search(r"tried to allocate (\d+) bytes", str(exc))
        size = f" (an allocation of {int(tried.group(1)) / 2**30:,.1f} GiB)" if tried else ""
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else "MemoryError"
        return (f"out of memory{size}: {first}. Lower what the config makes large (data.batch_size, "
                "data.num_classes, model, data.num_workers, a data set's size) or use a machine with more memory")
    return str(exc) or type(exc).__name__


_joined = False  # whether this process has joined its torchrun / srun group (quest.runtime.distributed)


def joined_group() -> None:
    """This process joined its group: from now on a user error may be its own (module docstring)."""
    global _joined
    _joined = True


def every_rank(exc: BaseException) -> BaseException:
    """``exc``, marked as raised alike by every process of the group: printed by rank 0 alone."""
    exc.quest_every_rank = True  # type: ignore[attr-defined]
    return exc


def group_rank() -> tuple[int, int]:
    """(rank, number of processes) of this process in its torchrun or srun group, from the environment the
    launcher set (quest.runtime.distributed reads the same); (0, 1) for a process on its own."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env:
        return int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    return 0, 1


def print_error(program: str, message: str, alike: bool = True) -> bool:
    """The one error line, ``<program>: error: <message>``, on standard error; on a process other than rank 0 of
    a group, nothing when every process finds the same error (``alike``), else with ``rank <n>: `` before the
    message. Whether it printed."""
    rank, world = group_rank()
    if world > 1 and rank != 0:
        if alike:
            return False
        message = f"rank {rank}: {message}"
    print(f"{program}: error: {message}", file=sys.stderr, flush=True)
    return True


def input_error(program: str, exc: BaseException) -> int:
    """A tool's refusal of its input: the one error line, ``<program>: error: <message>``; returns EXIT_USAGE."""
    print(f"{program}: error: {describe(exc)}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def _unprintable(char: str) -> bool:
    """A control character (a tab aside: it splits no line), or Unicode's line and paragraph separators."""
    return char != "\t" and unicodedata.category(char) in ("Cc", "Zl", "Zp")


def printable(text: str) -> str:
    """``text`` with each control character escaped as Python writes it (``\\n``, ``\\x1b``): a name found on disk
    (a file of a data set) put into a message or a listing stays on its one line."""
    return "".join(repr(c)[1:-1] if _unprintable(c) else c for c in text)


def control_character_problems(args: Sequence[str]) -> list[str]:
    """One line per argument holding a line break or another control character (an escape sequence, a NUL): shown
    escaped, because printed as it is it would split, or rewrite, the one error line that names it. A line break
    usually comes from a shell's ``$(...)`` that matched two paths. (A name that is not UTF-8 is held as lone
    surrogates: quest.config.overrides.not_utf8_problems says that one.)"""
    problems = []
    for i, arg in enumerate(args):
        if any(_unprintable(c) for c in arg):
            shown = printable(arg)
            if i and args[i - 1].startswith("-") and "=" not in args[i - 1]:  # an option's value: named with it
                shown = f"{args[i - 1]} {shown}"
            what = "a line break" if len(f"{arg}.".splitlines()) > 1 else "a control character"
            problems.append(f"the argument {shown} holds {what}: quest takes no control characters in its arguments "
                            "(a path or value with one would split or rewrite the lines that name it); a line break "
                            "often comes from a shell's $(...) that matched two paths: give one")
    return problems


def parse_arguments(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """A tool's ``parser.parse_args(argv)`` (``argv`` None: the command line's), after refusing an argument that holds
    a control character (:func:`control_character_problems`): one error line each, exit EXIT_USAGE, as argparse
    answers a bad argument."""
    args = sys.argv[1:] if argv is None else list(argv)
    problems = control_character_problems(args)
    if problems:
        for line in problems:
            print_error(parser.prog, line)
        raise SystemExit(EXIT_USAGE)
    return parser.parse_args(args)


def program_name(default: str) -> str:
    """What the user typed: ``train.py`` / ``eval.py``, a ``quest-*`` script, ``python -m quest.<module>``, or
    ``default``."""
    path = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    if path.name in ("train.py", "eval.py") or path.name.startswith("quest-"):
        return path.name
    package = Path(__file__).resolve().parents[1]  # the quest package
    try:
        module = path.resolve().relative_to(package.parent).with_suffix("")
    except ValueError:
        return default
    if module.parts[:1] != (package.name,):  # another program in the same tree (a venv inside the checkout)
        return default
    parts = module.parts[:-1] if module.name == "__main__" else module.parts
    return "python -m " + ".".join(parts)


def doc_summary(doc: str | None) -> str:
    """The first paragraph of a docstring as one line of plain text: a command's ``--help`` description (beside
    :func:`program_name`, its ``prog``) and a config key's (quest.config.help). The whole paragraph, never its first
    source line, which ends wherever the source was wrapped (quest-plot's ended 'perf: the'); reST's ``literal`` and
    :role:`target` marks dropped, which argparse would print as they are."""
    if not doc:
        return ""
    text = " ".join(inspect.cleandoc(doc).split("\n\n")[0].split())
    return re.sub(r":[\w:]+:`~?([^`]*)`", r"\1", text).replace("``", "")


#: the environment variable holding whether the user asked for tracebacks (HYDRA_FULL_ERROR=1) when quest's app set
#: HYDRA_FULL_ERROR for Hydra itself (quest.cli), carried to the job's processes with the rest of the environment
FULL_ERROR_ASKED = "QUEST_FULL_ERROR_ASKED"


def full_error_asked() -> bool:
    """Whether the user asked for full tracebacks of their mistakes too (HYDRA_FULL_ERROR=1)."""
    return os.environ.get(FULL_ERROR_ASKED, os.environ.get("HYDRA_FULL_ERROR", "0")) == "1"


@contextlib.contextmanager
def escaping_stdout() -> Iterator[None]:
    """Standard output escapes what its encoding cannot hold, as Python's standard error does (``backslashreplace``),
    while a command runs: a name that is not UTF-8 (Python holds its bytes as ``\\udce9``) in a message or a log line
    is printed escaped, where a UTF-8 terminal's strict encoder would end the command, its work done, with an
    encoder's error naming no file."""
    stream = sys.stdout
    reconfigure = getattr(stream, "reconfigure", None)
    held = getattr(stream, "errors", None)
    if reconfigure is None or held != "strict":
        yield
        return
    reconfigure(errors="backslashreplace")
    try:
        yield
    finally:
        if not stream.closed:
            stream.reconfigure(errors=held)


@contextlib.contextmanager
def reporting_errors(program: str) -> Iterator[None]:
    """Run a command's work, its checks first (:func:`quest.runtime.phase.command_phases`), its output escaped where
    the terminal's encoding cannot hold it (:func:`escaping_stdout`): a user error exits EXIT_ERROR with one line, a
    bug EXIT_BUG with its traceback and a line saying so, Ctrl-C EXIT_INTERRUPTED with one line (a Ctrl-C is the
    user's choice, not a fault: no traceback). SystemExit (an exit code already chosen) passes through."""
    try:
        with command_phases(program), escaping_stdout():
            yield
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.stdout.flush()
        print(f"{program}: interrupted: every file it had finished is kept whole, and none is left half-written",
              file=sys.stderr, flush=True)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except BaseException as exc:  # noqa: BLE001  (the last place an exception can be reported well)
        sys.stdout.flush()
        if is_user_error(exc):
            if full_error_asked():
                traceback.print_exc()
            print_error(program, describe(exc), alike=not _joined or getattr(exc, "quest_every_rank", False))
            raise SystemExit(EXIT_ERROR) from None
        traceback.print_exc()
        print(f"{program}: internal error: this is a bug in quest, not a mistake of yours; please report it with "
              "the traceback above", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_BUG) from None
