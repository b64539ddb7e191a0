"""The directories a command made, so that a refused one removes exactly those and never one that was there before.

Hydra makes a job's output directory, with every missing parent, before the app runs (``hydra.core.utils.run_job``:
``hydra.run.dir``, or ``hydra.sweep.dir/<subdir>`` in a multirun), and a multirun's sweep directory, with Hydra's
``multirun.yaml`` in it, before its first job. quest's checks run in the app, after that. A command they refuse must
leave the file system as it was: no directory of its own left behind, empty or not, and none that was there before
removed (an empty ``runs/`` the user made, the working directory's parents).

:class:`MadeDirectories` is a Hydra callback (``hydra.callbacks.quest_dirs`` in each app's config) that looks before
Hydra makes anything: ``on_run_start`` / ``on_multirun_start`` note which of the directories to be made are missing,
``on_job_start`` (in the job's own process, a SLURM job's too: the callback travels pickled with the job) hands the
job's list to :func:`remove_made`, which the app calls on a refusal. ``on_multirun_end`` undoes a sweep that changed
nothing else: the sweep directory it made goes, or the ``multirun.yaml`` it rewrote is put back.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from quest.store.files import atomic_write
from quest.store.tree import remove_made_dirs

__all__ = ["MadeDirectories", "missing_dirs", "remove_made"]

SWEEP_RECORD = "multirun.yaml"  # what Hydra's sweeper writes into the sweep directory before the first job


def missing_dirs(path: str | Path) -> list[Path]:
    """``path`` (made absolute the way Hydra does, symlinks kept) and its parents that do not exist, deepest first."""
    path, out = Path(os.path.abspath(path)), []
    while not os.path.lexists(path) and path != path.parent:
        out.append(path)
        path = path.parent
    return out


def _snapshot(root: Path) -> dict[str, Any]:
    """Every entry under ``root``, relative path -> "dir" or (size, mtime_ns): what a sweep may have changed."""
    found: dict[str, Any] = {}
    for top, dirs, files in os.walk(root):
        for name in dirs:
            found[os.path.relpath(os.path.join(top, name), root)] = "dir"
        for name in files:
            st = os.lstat(os.path.join(top, name))
            found[os.path.relpath(os.path.join(top, name), root)] = (st.st_size, st.st_mtime_ns)
    return found


@dataclass
class _Before:
    """What was there before Hydra made anything: ``root`` (the run or sweep directory), the directories of it and
    its parents that were missing (deepest first), and, for a sweep directory that existed, its entries and record."""

    root: Path
    made: list[Path]
    entries: dict[str, Any] = field(default_factory=dict)
    record: bytes | None = None


# the job in this process: its output directory and the directories made for it, deepest first (set on_job_start)
_job: tuple[Path, list[Path]] | None = None


def _resolved(config: DictConfig, key: str) -> Path | None:
    """``key`` of Hydra's config resolved as run_job resolves it (its ``${hydra:...}`` read HydraConfig), or None
    when it cannot be (run_job then raises the error itself)."""
    hydra_config = HydraConfig.instance()
    held, hydra_config.cfg = hydra_config.cfg, config  # what ${hydra:...} reads; put back at once
    try:
        value = OmegaConf.select(config, key)
    except Exception:
        return None
    finally:
        hydra_config.cfg = held
    return Path(os.path.abspath(str(value))) if value is not None else None


def output_dir_problem(path: str) -> str | None:
    """What keeps ``path`` (an output directory, relative to the working directory) from being made, in words, or
    None: a name longer than the file system allows, or a part that exists and is not a directory (Hydra would fail
    on either making it, with its own traceback, before quest runs), or a leading ``~`` (it would be made as a
    directory named ``~``, not the home directory the user meant)."""
    import os

    limit = 255
    try:
        limit = os.pathconf(".", "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        pass
    parts = Path(path).parts
    if parts and parts[0].startswith("~"):  # the shell expands ~ only outside quotes; Hydra never does
        return (f"{parts[0]} is not expanded here: Hydra would make a directory named {parts[0]!r} in the working "
                f"directory; write the path out ({os.path.expanduser(parts[0])}/...)")
    long = next((part for part in parts if len(os.fsencode(part)) > limit), None)
    if long is not None:
        return (f"the directory name {long[:40]}... is {len(os.fsencode(long))} bytes long; this file system allows "
                f"{limit} per name (choose a shorter one)")
    here = Path(".")
    for part in Path(path).parts:
        here = here / part
        if here.exists() and not here.is_dir():
            return f"{here} exists and is not a directory (expected a directory to write the run into)"
    return None


def _exit_if_unmakeable(config: DictConfig, key: str, root: Path | None) -> None:
    """A directory Hydra cannot make (a part of it is a file, a name too long): one line and exit 1, instead of
    Hydra's traceback from its mkdir. The command line's own ``hydra.run.dir=`` was checked before Hydra ran
    (quest.config.overrides); this is the configured one (``runs/...``, ``multirun/...``)."""
    from quest.runtime.errors import EXIT_ERROR, print_error, program_name

    problem = output_dir_problem(str(root)) if root is not None else None
    if problem:
        print_error(program_name('quest-' + str(config.hydra.job.name)), f"{key}={root}: {problem}")
        sys.exit(EXIT_ERROR)


class MadeDirectories(Callback):
    """Hydra callback: note the missing directories before Hydra makes them (module docstring)."""

    def __init__(self) -> None:
        self.before: _Before | None = None
        self.sweep = False

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        root = _resolved(config, "hydra.run.dir")
        _exit_if_unmakeable(config, "hydra.run.dir", root)
        self.before = _Before(root, missing_dirs(root)) if root is not None else None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.sweep = True
        root = _resolved(config, "hydra.sweep.dir")
        _exit_if_unmakeable(config, "hydra.sweep.dir", root)
        if root is None:
            return
        self.before = _Before(root, missing_dirs(root))
        if not self.before.made and root.is_dir():  # a sweep directory of an earlier sweep
            self.before.entries = _snapshot(root)
            record = root / SWEEP_RECORD
            self.before.record = record.read_bytes() if record.is_file() else None

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        global _job
        out = Path(str(config.hydra.runtime.output_dir))
        before, made = self.before, []
        if before is not None and not self.sweep and out == before.root:
            made = before.made
        elif before is not None and self.sweep and before.root in out.parents:
            # the job's own directories below the sweep directory (which is the sweep's, undone at its end)
            made = [d for d in [out, *out.parents] if before.root in d.parents and
                    os.path.relpath(d, before.root) not in before.entries]
        _job = (out, made)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        before = self.before
        if before is None or not before.root.is_dir():
            return
        record = before.root / SWEEP_RECORD
        if before.made:  # made by this sweep: removed when no job left anything in it
            if [p.name for p in before.root.iterdir()] == [SWEEP_RECORD]:
                record.unlink()
                remove_made_dirs(before.made)
            return
        now = _snapshot(before.root)
        now.pop(SWEEP_RECORD, None)
        if now == {k: v for k, v in before.entries.items() if k != SWEEP_RECORD}:  # no job changed anything
            if before.record is None:
                record.unlink(missing_ok=True)
            else:
                saved = before.record
                atomic_write(record, lambda f: f.write(saved))  # Hydra rewrote it: the earlier sweep's back


def remove_made(output_dir: str | Path) -> None:
    """A refused job: remove the directories made for it (``output_dir`` and the parents Hydra made), deepest first,
    while they are empty. Nothing when the callback did not see this job start (the app called some other way)."""
    if _job is not None and _job[0] == Path(os.path.abspath(output_dir)):
        remove_made_dirs(_job[1])
