"""A run directory holds one run: its name follows the config, a resume must match the stored config, a finished run
is never rewritten, and a replaced run is archived first (docs/training.md, "Runs, resume and provenance").

- Name: quest.run_names (``runs/<data>/<model>-<attention>-<recipe>-seed<seed>`` plus the other overrides in words).
- Resume: the config stored in ``last.pt`` is compared key by key with the new one; only the keys of
  ``quest.schema.RESUME_SAFE_KEYS`` may differ (``trainer.epochs`` only upwards). The data set's size and classes
  are compared too, so a moved data set resumes and a different one is refused.
- ``run.json``: the run's config and the history of its starts, resumes and the keys each one changed.
"""
from __future__ import annotations

import datetime as _dt
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from quest.compat import upgrade_run_config
from quest.config_checks import ConfigError
from quest.data.registry import data_set_keys, get_dataset, list_datasets
from quest.errors import UserError
from quest.io import DamagedFile, LockHeld, lock_file, move_aside, read_json, replaced_dir, write_json_atomic
from quest.schema import RESUME_SAFE_KEYS, TrainConfig, matches_key

log = logging.getLogger("quest.train")

__all__ = ["config_differences", "check_resume", "RunDirectory", "FINAL_STATUSES"]

#: Statuses after which running the same run again has nothing to do.
FINAL_STATUSES = ("completed", "stopped", "diverged")
_RUN_FILES = ("checkpoints", "metrics.jsonl", "summary.json", "run.json", "wandb", "eval")
_ABSENT = object()


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out if out or not prefix else {prefix: {}}
    return {prefix: tree}


@dataclass(frozen=True)
class Difference:
    key: str
    stored: Any
    new: Any

    def __str__(self) -> str:
        show = lambda v: "(absent)" if v is _ABSENT else repr(v)  # noqa: E731
        return f"{self.key}: {show(self.stored)} -> {show(self.new)}"


def _schema_defaults(data_name: Any = None) -> dict[str, Any]:
    defaults = OmegaConf.to_container(OmegaConf.structured(TrainConfig), resolve=False)
    if data_name in list_datasets():  # the data set's own options too
        defaults["data"] = OmegaConf.to_container(OmegaConf.structured(get_dataset(data_name).settings), resolve=False)
    return _flatten(defaults)


def config_differences(stored: dict[str, Any], new: dict[str, Any]) -> list[Difference]:
    """Keys whose values differ between two resolved configs; a key one of them lacks counts as the schema's
    default. The stored config, of whichever quest wrote it, is upgraded to today's form first (quest.compat)."""
    stored = upgrade_run_config(stored, data_set_keys)
    a, b, defaults = _flatten(stored), _flatten(new), _schema_defaults((new.get("data") or {}).get("name"))
    diffs = []
    for key in sorted(set(a) | set(b)):
        old, now = a.get(key, defaults.get(key, _ABSENT)), b.get(key, defaults.get(key, _ABSENT))
        if old != now:
            diffs.append(Difference(key, old, now))
    return diffs


def check_resume(stored: dict[str, Any], new: dict[str, Any], where: Path) -> list[Difference]:
    """The differences a resume may carry (resume-safe keys); raise :class:`ConfigError` naming every other one."""
    diffs = config_differences(stored, new)
    blocked = [d for d in diffs if not matches_key(d.key, RESUME_SAFE_KEYS)]
    for d in diffs:
        if d.key == "trainer.epochs" and isinstance(d.stored, int) and isinstance(d.new, int) and d.new < d.stored:
            blocked.append(d)
    if blocked:
        lines = "\n".join(f"  {d}" + ("  (a run can be extended, not shortened; use trainer.max_steps to stop "
                                       "earlier)" if d.key == "trainer.epochs" else "") for d in blocked)
        raise ConfigError(
            f"{where} holds a run with another config; these keys differ from the stored run's:\n{lines}\n"
            "Only the keys listed in docs/training.md (\"what may change on resume\") may change. To train this "
            "config, give it its own directory (hydra.run.dir=...), or replace the old run with "
            "trainer.resume=never trainer.overwrite=true (it is archived under .replaced/).")
    return diffs


def data_fingerprint(train_set: Any, val_set: Any) -> dict[str, Any]:
    """What a moved data set must keep: split sizes and class names."""
    classes = getattr(train_set, "classes", None) or getattr(getattr(train_set, "dataset", None), "classes", None)
    return {"train_size": len(train_set), "val_size": len(val_set),
            "classes": list(classes) if classes is not None else None}


def check_data(stored: dict[str, Any] | None, now: dict[str, Any], where: Path) -> None:
    if not stored or stored == now:
        return
    parts = [f"{k}: {stored.get(k)!r:.200} -> {now.get(k)!r:.200}" for k in now if stored.get(k) != now.get(k)]
    raise ConfigError(f"{where} holds a run trained on another data set (its data.root may differ, but not the data "
                      "set):\n  " + "\n  ".join(parts))


class DirectoryInUse(UserError, RuntimeError):
    """Another process holds the run directory's lock."""


class RunDirectory:
    """The files of one run directory that are not checkpoints: the lock, run.json, archiving a replaced run."""

    def __init__(self, path: Path, is_main: bool = True):
        self.path, self.is_main = Path(path), is_main
        self._lock_fd: int | None = None
        self._lock_before, self._claimed, self._lock_was_there = b"", False, False

    def has_run(self) -> bool:
        return any((self.path / name).exists() for name in ("checkpoints/last.pt", "summary.json", "metrics.jsonl"))

    def record(self) -> dict[str, Any] | None:
        """run.json, or None when it is missing or damaged (a damaged one is kept aside before it is rewritten)."""
        try:
            return read_json(self.path / "run.json")
        except DamagedFile:
            return None

    def writable(self) -> None:
        """ConfigError naming the directory when this process cannot write into it, before any work."""
        probe = self.path if self.path.exists() else next(p for p in self.path.parents if p.exists())
        if not os.access(probe, os.W_OK | os.X_OK):
            raise ConfigError(f"the run directory {self.path} cannot be written by this user (uid {os.getuid()}; "
                              f"{probe} has mode {os.stat(probe).st_mode & 0o777:o}): pick another directory with "
                              "hydra.run.dir=..., or make it writable (chmod u+w)")

    def lock(self) -> None:
        """Hold an exclusive lock for the run's lifetime: a second process in the same directory is refused rather
        than left to overwrite the first one's checkpoints. Released when the process ends, however it ends."""
        if not self.is_main:
            return
        self._lock_was_there = (self.path / ".lock").exists()
        try:
            fd = lock_file(self.path / ".lock", "this run directory")
        except LockHeld as exc:
            raise DirectoryInUse(f"run directory {self.path} is in use by another process ({exc.holder}); wait for "
                               "it to end, or give this run its own directory (hydra.run.dir=...)") from None
        # name the holder for a second process; a command refused before claim() puts the old content back
        self._lock_before = os.pread(fd, 4096, 0)
        self._write_lock(fd, f"pid {os.getpid()} on {os.uname().nodename}\n".encode())
        self._lock_fd, self._claimed = fd, False

    @staticmethod
    def _write_lock(fd: int, content: bytes) -> None:
        os.ftruncate(fd, 0)
        os.pwrite(fd, content, 0)

    def claim(self) -> None:
        """Every check has passed: the lock file keeps naming this process after it ends (a refused command
        changes nothing, the lock file's content included)."""
        self._claimed = True

    def unlock(self) -> None:
        if self._lock_fd is not None:
            if not self._claimed:  # refused: the lock file as it was, or gone if this command made it
                if self._lock_was_there:
                    self._write_lock(self._lock_fd, self._lock_before)
                else:
                    (self.path / ".lock").unlink(missing_ok=True)  # still held: no other process has it open
            os.close(self._lock_fd)
            self._lock_fd = None

    def archive(self) -> Path | None:
        """Move the previous run's files to ``.replaced/<UTC time>/`` (trainer.overwrite=true): nothing is deleted,
        and the new run's metrics never mix with the old one's."""
        if not self.is_main:
            return None
        dest = move_aside(self.path, [self.path / name for name in _RUN_FILES])
        if dest is None:
            return None
        log.warning("trainer.overwrite=true: the previous run in %s was moved to %s", self.path, dest)
        return dest

    def replaced_dir(self) -> Path:
        """A new ``.replaced/<UTC time>/``: where files that a start replaces are kept."""
        return replaced_dir(self.path)

    def note_checkpoint(self, step: int) -> None:
        """run.json records the step of the latest checkpoint, so that a run whose checkpoints went missing is told
        from an attempt that stopped before its first one."""
        record = self.record() if self.is_main else None
        if record is not None:
            record["checkpoint_step"] = step
            write_json_atomic(self.path / "run.json", record)

    def write_record(self, config: dict[str, Any], event: str, step: int, changed: list[Difference]) -> None:
        """run.json: the current config and one history entry per start / resume, with the keys it changed."""
        if not self.is_main:
            return
        record = self.record()
        entry: dict[str, Any] = {"event": event, "time": _now(), "step": step}
        if record is None:
            record = {"format": "quest-run-v1", "created": _now(), "history": []}
            if event == "resume":  # run.json was missing or damaged: the history before this start is unknown
                entry["note"] = "run.json rebuilt from the checkpoint; earlier history unknown"
        if changed:
            entry["changed"] = {d.key: [None if d.stored is _ABSENT else d.stored, None if d.new is _ABSENT else d.new]
                                for d in changed}
        record["history"].append(entry)
        record["config"] = config
        write_json_atomic(self.path / "run.json", record)
