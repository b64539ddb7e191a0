"""Checks, then changes: every command of quest first makes every check that can refuse it (its overrides and values,
the state of the folders and files it reads and will write, its data, the logger's credentials) and only then
changes anything, so that a refused command leaves the file system as it was (docs/training.md, "What a command may
remove").

This is held by one mechanism instead of each command remembering it. A command runs inside :func:`command_phases`
(quest.runtime.errors.reporting_errors, which every console script and app runs its work in, enters it; so do the
library entry points, ``fit`` and ``run_evaluation``). The command starts in its checks. It moves to its changes once,
when it claims the folder it writes (``OwnedDirectory.claim``, quest.store: the lock is held and every check has
passed), or explicitly with :func:`begin_changes` where it writes without a folder of its own. Every write of the
store (an atomic write, an appended record, a folder moved aside) asks :func:`may_change` first, which raises
:class:`ChangeBeforeChecks`, a bug of quest (exit 70), for a write during the checks. Taking a lock is the one change
the checks make, and the lock puts its file back as it was when the command is refused (quest.store.owned_dir).

Outside any command (a library call, a test calling a function of the store) nothing is checked: there is no plan
to wait for.
"""
from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ChangeBeforeChecks", "Phase", "after_checks", "begin_changes", "command_phases", "current", "may_change"]


class ChangeBeforeChecks(RuntimeError):
    """A command wrote before its checks were done: a bug of quest (a refusal after it would leave a change)."""


@dataclass
class Phase:
    """The phase of one command: ``checking`` until its first change begins (:func:`begin_changes`); ``deferred``:
    what the checks want written once they have all passed (:func:`after_checks`)."""

    command: str
    checking: bool = True
    deferred: list[Callable[[], None]] = field(default_factory=list)


_CURRENT: contextvars.ContextVar[Phase | None] = contextvars.ContextVar("quest_command_phase", default=None)


def current() -> Phase | None:
    """The phase of the command running in this context, None outside any command."""
    return _CURRENT.get()


@contextmanager
def command_phases(command: str) -> Iterator[Phase]:
    """Run a command: in its checks until :func:`begin_changes`. Inside a command already running (``fit`` called by
    quest-train) it is that command's phase: one command, one plan."""
    running = _CURRENT.get()
    if running is not None:
        yield running
        return
    phase = Phase(command)
    token = _CURRENT.set(phase)
    try:
        yield phase
    finally:
        _CURRENT.reset(token)


def begin_changes() -> None:
    """Every check of the running command has passed: from now on it may write; what its checks deferred is written
    first (:func:`after_checks`)."""
    phase = _CURRENT.get()
    if phase is None or not phase.checking:
        return
    phase.checking = False
    deferred, phase.deferred = phase.deferred, []
    for write in deferred:
        write()


def after_checks(write: Callable[[], None]) -> None:
    """``write`` now when no command is checking, else once its checks have passed (a cache a check computed, such
    as the data pre-flight's): a refused command drops it and leaves nothing."""
    phase = _CURRENT.get()
    if phase is not None and phase.checking:
        phase.deferred.append(write)
    else:
        write()


def may_change(path: str | Path) -> None:
    """Called by every write of the store before it changes ``path``: :class:`ChangeBeforeChecks` while the running
    command is still in its checks."""
    phase = _CURRENT.get()
    if phase is not None and phase.checking:
        raise ChangeBeforeChecks(f"{phase.command} was about to change {path} before its checks were done (a change "
                                 "before the last check would be left behind by a refusal)")
