"""An evaluation directory holds one evaluation: its results are keyed by everything that changes their numbers, and
``eval_results.json`` always says which state they are in.

The key (:func:`fingerprint`) is what was evaluated (the checkpoint's path and SHA-256, model or EMA weights, or the
weights file and its SHA-256), the suite, the settings of the evaluations it runs, the model's input transform and
every data root the suite reads. ``eval_results.json`` is written when the evaluation starts and again after each
evaluation, atomically, with ``status``:

- ``running``: in progress, with the evaluations finished so far; a process holds ``.eval.lock``. Found with the lock
  free, the evaluation was killed (``interrupted``);
- ``complete``: every evaluation finished;
- ``partial``: an evaluation failed (``error`` says which and why); the ones before it are kept.

A new evaluation in a directory (:meth:`EvalDirectory.begin`): empty -> it runs; the same key complete -> nothing to
do (the stored results are reported); the same key interrupted or partial -> the finished evaluations are reused and
the rest run; another key (or results of an older quest without one) -> refused, naming the keys that differ, unless
``eval.overwrite=true``, which first moves the old files to ``.replaced/<UTC time>/`` (never deleted).

The lock, ``.replaced/`` and the key-by-key comparison are those of every directory quest owns (quest.store.owned_dir): a
refused evaluation leaves ``.eval.lock`` as it found it. The lock is taken and ``eval_results.json`` read
(:meth:`EvalDirectory.open`) before the model and the data are loaded: a second evaluation into the directory is
refused at once; the key, which needs them, is compared after (:meth:`EvalDirectory.begin`).
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from quest.config.differences import differences
from quest.runtime.errors import UserError
from quest.store.damage import DamagedFile
from quest.store.files import json_text, parse_json, write_text_atomic
from quest.store.locks import LockHeld
from quest.store.owned_dir import OwnedDirectory
from quest.store.results_file import checked_results
from quest.store.tree import REPLACED

log = logging.getLogger("quest.eval")

__all__ = ["EvalDirectory", "EvalDirectoryError", "fingerprint", "fingerprint_key", "RESULTS",
           "RUNNING", "COMPLETE", "PARTIAL", "INTERRUPTED", "NOT_NUMBERS"]

RESULTS = "eval_results.json"
LOCK = ".eval.lock"
ARCHIVE = REPLACED
RUNNING, COMPLETE, PARTIAL, INTERRUPTED = "running", "complete", "partial", "interrupted"
#: settings that change how an evaluation runs but none of its numbers (every count is exact and independent of the
#: process count; the device changes at most float rounding): not part of the key, recorded in the results
NOT_NUMBERS = frozenset({"device", "num_workers", "torch_threads", "log_every_n", "log_every_s", "overwrite"})
# what eval.py writes into the directory, moved aside when results are archived (never anything else: a directory
# given with hydra.run.dir=... may hold other files; a training run's own directory is refused before this, by
# quest.evaluation.runner), its log too (quest starts eval.log only after this decision); the lock and the archive stay
RESULT_FILES = ("eval_results.json", "eval_results.csv", "eval_results.md", "explain_maps.pt", "explain.png", "wandb",
                ".hydra", "eval.log")
# what a fresh evaluation writes beside its eval_results.json (not wandb/ or .hydra/, which may be a user's own)
FRESH_FILES = ("eval_results.csv", "eval_results.md", "explain_maps.pt", "explain.png", "eval.log")


class EvalDirectoryError(UserError, RuntimeError):
    """An evaluation directory that cannot take this evaluation; the message says why and what to do."""


def state_dict_sha256(state: dict[str, Any]) -> str:
    """The weights by content, whatever holds them (a .pth or .safetensors file, an exported folder, the Hub's
    cache): names, dtypes, shapes and bytes of every tensor, in name order."""
    digest = hashlib.sha256()
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def fingerprint(settings: dict[str, Any], target: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """Everything that changes the numbers: ``settings`` (the resolved eval node), ``target`` (the report's target
    section: what was evaluated and its transform) and ``inputs`` (setting -> data root read)."""
    evaluations = set(settings.get("run") or [])
    # roots: the ones read are in ``inputs``; crop_pct / interpolation: as resolved, in ``target``
    skip = NOT_NUMBERS | {"roots", "crop_pct", "interpolation"}
    shared = {k: v for k, v in settings.items() if k not in skip and not isinstance(v, dict)}
    sections = {k: v for k, v in settings.items() if isinstance(v, dict) and k in evaluations}
    # files by content, not by path: a run directory moved or copied holds the same results
    evaluated = {k: target.get(k) for k in ("source", "checkpoint_sha256", "weights", "weights_sha256",
                                            "model", "attention", "attention_options", "num_classes", "img_size",
                                            "mean", "std", "crop_pct", "interpolation", "data", "data_config")}
    if evaluated["weights_sha256"]:
        evaluated["weights"] = "a state_dict file"  # its path aside
    return {"evaluated": evaluated, "settings": {**shared, **sections}, "inputs": inputs}


def fingerprint_key(fp: dict[str, Any]) -> str:
    return hashlib.sha256(json_text(fp, indent=None).encode()).hexdigest()[:16]


def read_results(path: Path) -> dict[str, Any]:
    """An eval_results.json as a dict in today's form, or an :class:`EvalDirectoryError` naming the file and what is
    wrong."""
    try:
        data = parse_json(path.read_bytes().decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise EvalDirectoryError(f"{path} is not valid JSON ({exc}): a copy cut short or edited by hand? Move it "
                                 "aside, or pass eval.overwrite=true to archive it to .replaced/ and evaluate again")
    except PermissionError:
        raise EvalDirectoryError(f"{path}: permission denied (reading it needs read permission on the file)") from None
    try:
        return checked_results(data, path)  # every field checked; an older quest's results upgraded (quest.store.compat)
    except DamagedFile as exc:
        raise EvalDirectoryError(f"{exc} (damaged or edited?); move it aside or pass eval.overwrite=true to archive "
                                 "it to .replaced/ and evaluate again") from None


class EvalDirectory(OwnedDirectory):
    """One evaluation directory and its lock (only the main process writes; every process reads)."""

    lock_name, what = LOCK, "this evaluation directory"
    #: (status, record) as :meth:`open` found them, under the lock
    _found: tuple[str | None, dict[str, Any] | None] | None = None

    @property
    def results_path(self) -> Path:
        return self.path / RESULTS

    def state(self) -> tuple[str | None, dict[str, Any] | None]:
        """(status, record): (None, None) when empty; ``interrupted`` for a ``running`` record whose process is
        gone."""
        if not self.results_path.exists():
            return None, None
        record = read_results(self.results_path)
        status = record["status"]
        if status == RUNNING and not self.held_elsewhere():
            status = INTERRUPTED
        return status, record

    def lock(self) -> None:
        try:
            super().lock()
        except LockHeld as exc:
            raise EvalDirectoryError(f"{self.path} is being written by another eval.py ({exc.holder}); wait for it to "
                                     "end, or give this evaluation its own directory (hydra.run.dir=...)") from None

    def open(self, overwrite: bool) -> None:
        """The checks of the directory that need nothing loaded, before the model and the data are (seconds to
        minutes): take the lock (:class:`EvalDirectoryError` naming the holder when another eval.py has it) and read
        the results file (refused when unreadable, unless ``overwrite``). Nothing is changed: a command refused after
        this, the key's comparison in :meth:`begin` included, puts the lock file back on :meth:`unlock`."""
        self.lock()
        try:
            self._found = self.state()
        except EvalDirectoryError:
            if not overwrite:
                raise
            self._found = ("unreadable", None)

    def begin(self, fp: dict[str, Any], overwrite: bool) -> tuple[str, dict[str, Any]]:
        """Decide what this evaluation does in the directory, before any work: ('run', {}) for a fresh start,
        ('resume', finished results to reuse), or ('done', the stored record). Raises :class:`EvalDirectoryError`
        for results of another key (unless ``overwrite``: archived first) or a directory in use. Opens the
        directory (:meth:`open`) unless that was done before the loads."""
        if self._found is None:
            self.open(overwrite)
        assert self._found is not None
        status, record = self._found
        if status is None:
            self.claim()
            self._keep_unrecorded()
            return "run", {}
        key = fingerprint_key(fp)
        if status == RUNNING:
            raise EvalDirectoryError(f"{self.path} is being written by another eval.py (its {RESULTS} says running "
                                     "and its lock is held); wait for it, or use another hydra.run.dir=...")
        if overwrite:
            self.claim()
            self.archive(RESULT_FILES, str(status))
            return "run", {}
        if record is not None and record.get("key") == key:
            if status == COMPLETE:
                return "done", record
            self.claim()
            return "resume", dict(record.get("results") or {})
        if record is not None and "fingerprint" in record:
            diff = "\n".join(f"  {d.show(width=120)}" for d in differences(record["fingerprint"], fp))
            what = f"these differ from the stored ones:\n{diff}"
        else:
            what = "they were written by an older quest that did not record what they depend on"
        raise EvalDirectoryError(
            f"{self.path} holds {status} results of another evaluation; {what}\nResults are never replaced "
            f"silently: give this evaluation its own directory (hydra.run.dir=...), or pass eval.overwrite=true to "
            f"move the old results to {self.path / ARCHIVE}/<time>/ first")

    def _keep_unrecorded(self) -> None:
        """A fresh evaluation: no results record claims files of the names it writes, so any found are somebody
        else's (or a killed attempt's before its first record): kept in ``.replaced/<UTC time>-unrecorded/``, never
        overwritten or appended to. A training run's own ``.hydra/`` and ``wandb/`` are not among them."""
        dest = super().archive(FRESH_FILES, "unrecorded")
        if dest is not None:
            log.warning("%s held files of the names eval.py writes that no %s records: moved to %s", self.path,
                        RESULTS, dest)

    def archive(self, names: Iterable[str] = RESULT_FILES, label: str = "") -> Path | None:
        """Move eval.py's result files (:data:`RESULT_FILES`) to ``.replaced/<UTC time>-<label>/`` (the status of
        the results moved)."""
        dest = super().archive(names, label)
        if dest is not None:
            log.warning("eval.overwrite=true: the previous results in %s were moved to %s", self.path, dest)
        return dest

    def write(self, record: dict[str, Any]) -> Path:
        """eval_results.json, atomically (quest.store.files)."""
        return write_text_atomic(self.results_path, json_text(record))
