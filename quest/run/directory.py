"""A run directory holds one run: its name follows the config, a resume must match the stored config, a finished run
is never rewritten, and a replaced run is archived first (docs/training.md, "Runs, resume and provenance").

- Name: quest.config.run_names (``runs/<data>/<model>-<attention>-<recipe>-seed<seed>`` plus the other overrides in words).
- Resume: the config stored in ``last.pt`` is compared key by key with the new one; only the keys of
  ``quest.config.schema.RESUME_SAFE_KEYS`` may differ (``trainer.epochs`` only upwards). The data set's size and classes
  are compared too, so a moved data set resumes and a different one is refused.
- ``run.json``: the run's config and the history of its starts, resumes and the keys each one changed.

The lock, ``.replaced/`` and the key-by-key comparison are those of every directory quest owns (quest.store.owned_dir).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from quest.config.checks import ConfigError
from quest.config.differences import ABSENT, Difference, differences, flatten
from quest.config.schema import RESUME_SAFE_KEYS, TrainConfig, matches_key
from quest.data.registry import data_set_keys, get_dataset, list_datasets
from quest.runtime.errors import UserError
from quest.store.compat import upgrade_run_config
from quest.store.damage import DamagedFile
from quest.store.files import OutsideFolder, inside_folder, write_json_atomic, write_text_atomic
from quest.store.locks import LockHeld
from quest.store.owned_dir import OwnedDirectory
from quest.store.run_files import is_run, read_run_record, run_holding
from quest.store.tree import REPLACED

log = logging.getLogger("quest.train")

__all__ = ["config_differences", "check_resume", "RunDirectory", "FINAL_STATUSES"]

#: Statuses after which running the same run again has nothing to do.
FINAL_STATUSES = ("completed", "stopped", "diverged")
#: every path a run writes, relative to its directory: folders, then files. Each is checked before any change
#: (:meth:`RunDirectory.writable`): of its kind, writable, and the run's own (a link leading out of the run directory
#: would have this run write into another's files, or resume from them).
_WRITTEN_DIRS = ("checkpoints", ".hydra", ".replaced")
_WRITTEN_FILES = ("run.json", "summary.json", "metrics.jsonl", "train.log", ".hydra/config.yaml", ".hydra/hydra.yaml",
                  ".hydra/overrides.yaml", "checkpoints/last.pt", "checkpoints/best.pt")
#: files a run appends to: written through, so the user must be able to write the file itself
_APPENDED = ("metrics.jsonl", "train.log")
#: every entry a run's commands make at the top of its directory (training, its loggers, eval.py's default folder):
#: what trainer.overwrite=true moves aside as the earlier run. Anything else there is not the run's and stays
RUN_ENTRIES = ("run.json", "summary.json", "metrics.jsonl", "train.log", "checkpoints", ".hydra", "tensorboard",
               "wandb", "eval")


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _schema_defaults(data_name: Any = None) -> dict[str, Any]:
    defaults = OmegaConf.to_container(OmegaConf.structured(TrainConfig), resolve=False)
    if data_name in list_datasets():  # the data set's own options too
        defaults["data"] = OmegaConf.to_container(OmegaConf.structured(get_dataset(data_name).settings), resolve=False)
    return flatten(defaults)


def config_differences(stored: dict[str, Any], new: dict[str, Any]) -> list[Difference]:
    """Keys whose values differ between two resolved configs; a key one of them lacks counts as the schema's
    default. The stored config, of whichever quest wrote it, is upgraded to today's form first (quest.store.compat)."""
    stored = upgrade_run_config(stored, data_set_keys)
    return differences(stored, new, _schema_defaults((new.get("data") or {}).get("name")))


def check_resume(stored: dict[str, Any], new: dict[str, Any], where: Path, checkpoint: bool = False
                 ) -> list[Difference]:
    """The differences a resume may carry (resume-safe keys); raise :class:`ConfigError` naming every other one.
    ``checkpoint``: ``where`` is a checkpoint resumed into a new directory (trainer.resume=<path>), not a run."""
    diffs = config_differences(stored, new)
    blocked = [d for d in diffs if not matches_key(d.key, RESUME_SAFE_KEYS)]
    for d in diffs:
        if d.key == "trainer.epochs" and isinstance(d.stored, int) and isinstance(d.new, int) and d.new < d.stored:
            blocked.append(d)
    if blocked:
        lines = "\n".join(f"  {d}" + ("  (a run can be extended, not shortened; use trainer.max_steps to stop "
                                       "earlier)" if d.key == "trainer.epochs" else "") for d in blocked)
        way_out = (f"To train this config from that checkpoint's weights as a new run, use trainer.init_from={where} "
                   "instead of trainer.resume." if checkpoint else "To train this config, give it its own directory "
                   "(hydra.run.dir=...), or replace the old run with trainer.resume=never trainer.overwrite=true (it "
                   "is archived under .replaced/).")
        raise ConfigError(
            f"{where} holds a run with another config; these keys differ from the stored run's:\n{lines}\n"
            f"Only the keys listed in docs/training.md (\"what may change on resume\") may change. {way_out}")
    return diffs


def listed_samples(dataset: Any) -> tuple[str, list[tuple[str, int]]] | None:
    """The folder and the (path, label) list of a data set that lists its files: torchvision's ImageFolder and
    quest's (``root``, ``samples``), timm's folder reader (``reader.root``, ``reader.samples``); None for one
    that lists none (built-in, generated, streamed). A Subset (data.subset_fraction): its own samples only."""
    indices, inner = getattr(dataset, "indices", None), getattr(dataset, "dataset", None)
    if indices is not None and inner is not None:
        listed = listed_samples(inner)
        return None if listed is None else (listed[0], [listed[1][i] for i in indices])
    for holder in (dataset, getattr(dataset, "reader", None)):
        samples = getattr(holder, "samples", None)
        root = getattr(holder, "root", None)
        if isinstance(samples, list) and isinstance(root, (str, os.PathLike)):
            return os.fspath(root), samples
    return None


def files_sha256(*splits: Any) -> str | None:
    """A SHA-256 over each split's sorted lines ``<path relative to its folder>\\t<label>``: other files of the same
    count and classes are another digest, the same folder moved or copied the same one. Only the names the data set
    already listed: no file is opened or stat'ed, so it costs a start 1-2 s per million images (2.1 s for 1.28
    million names, measured; a stat per file would cost ImageNet seconds more, minutes on a network file system).
    The bytes are not in it: an image re-encoded under the same name is the same data set to this digest (a capped copy is told
    apart by ``storage``). None when a split lists no files."""
    h = hashlib.sha256(b"files-2\n")
    for split in splits:
        listed = listed_samples(split)
        if listed is None:
            return None
        root, samples = listed
        prefix = os.path.join(root, "")
        rows = sorted(f"{_relative(os.fspath(path), root, prefix)}\t{int(label)}\n" for path, label in samples)
        h.update("".join(rows).encode("utf-8", "surrogateescape") + b"\n")
    return h.hexdigest()


def _relative(path: str, root: str, prefix: str) -> str:
    # a slice for the usual path under root (os.path.relpath costs microseconds a path: seconds for ImageNet)
    rel = path[len(prefix):] if path.startswith(prefix) else os.path.relpath(path, root)
    return rel.replace(os.sep, "/")


def data_fingerprint(train_set: Any, val_set: Any, root: Any = None) -> dict[str, Any]:
    """What a moved data set must keep: split sizes, class names, the storage of the images at ``root`` (a
    capped copy's cap, quest-data cap: the same files, smaller, are other data; None: the images as they are), and
    the files themselves (:func:`files_sha256`; None for a data set that lists none)."""
    from quest.store.tool_records import read_capped

    classes = getattr(train_set, "classes", None) or getattr(getattr(train_set, "dataset", None), "classes", None)
    capped = read_capped(root)
    return {"train_size": len(train_set), "val_size": len(val_set),
            "classes": list(classes) if classes is not None else None,
            "storage": None if capped is None else {k: capped[k] for k in ("short_side", "quality", "resample")},
            "files_sha256": files_sha256(train_set, val_set)}


def data_record(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint as summary.json records it (``data_fingerprint``): the split sizes, the number of classes and
    a SHA-256 of their names in order (a thousand names are a digest, not a list, in a file people read), and the
    files' digest (:func:`files_sha256`)."""
    classes = fingerprint.get("classes")
    digest = None if classes is None else hashlib.sha256(json.dumps(list(classes)).encode("utf-8")).hexdigest()
    return {"train_size": fingerprint["train_size"], "val_size": fingerprint["val_size"],
            "num_classes": None if classes is None else len(classes), "classes_sha256": digest,
            "files_sha256": fingerprint.get("files_sha256")}


def check_data(stored: dict[str, Any] | None, now: dict[str, Any], where: Path) -> None:
    """ConfigError naming what differs between the data the run trained on (``stored``) and ``now``; a key a
    checkpoint written before it was recorded lacks (``storage``, ``files_sha256``) is not compared."""
    if not stored:
        return
    parts = [f"{k}: {stored[k]!r:.200} -> {now.get(k)!r:.200}" for k in now if k in stored and stored[k] != now[k]]
    if not parts:
        return
    raise ConfigError(f"{where} holds a run trained on another data set (its data.root may differ, but not the data "
                      "set):\n  " + "\n  ".join(parts))


class DirectoryInUse(UserError, RuntimeError):
    """Another process holds the run directory's lock."""


class RunDirectory(OwnedDirectory):
    """The files of one run directory that are not checkpoints: the lock, run.json, archiving a replaced run."""

    lock_name, what = ".lock", "this run directory"

    def has_run(self) -> bool:
        return any((self.path / name).exists() for name in ("checkpoints/last.pt", "summary.json", "metrics.jsonl"))

    def enclosing_run(self) -> Path | None:
        """The run directory this one would lie inside, else None: a run inside another's checkpoints/ or eval/ would
        be moved with that folder when the other run is replaced, and one anywhere inside it mixes two runs' files in
        one tree."""
        if self.path.parent == self.path:
            return None
        # as given and with every link followed: a link to another run's checkpoints/ is inside that run
        return run_holding(self.path.parent) or run_holding(self.path.resolve().parent)

    def inner_run(self) -> Path | None:
        """A run directory among this one's folders, else None: a run around another mixes two runs' files in one
        tree, and the inner one could no longer be resumed (it would lie inside this one). The run's own folders
        and .replaced/ are not looked into."""
        if not self.path.is_dir():
            return None
        return next((child for child in sorted(self.path.iterdir()) if child.name not in (*RUN_ENTRIES, REPLACED)
                     and child.is_dir() and is_run(child)), None)

    def record(self) -> dict[str, Any] | None:
        """run.json, or None when it is missing or damaged (not JSON, or a field of the wrong type: quest.store.run_files; a
        damaged one is kept aside before it is rewritten)."""
        try:
            return read_run_record(self.path / "run.json")
        except DamagedFile:
            return None

    def writable(self, logger: Any = None) -> None:
        """ConfigError naming the directory when this process cannot write into it, or naming each path the run
        writes (:data:`_WRITTEN_DIRS`, :data:`_WRITTEN_FILES`; ``wandb`` and ``tensorboard`` where the ``logger``
        config writes them) that is of the other kind, cannot be written by this user, or is a link leading out of
        the run directory (train.log aside: a link there is moved aside when the log opens); before any work."""
        probe = self.path if self.path.exists() else next(p for p in self.path.parents if p.exists())
        if not os.access(probe, os.W_OK | os.X_OK):
            raise ConfigError(f"the run directory {self.path} cannot be written by this user (uid {os.getuid()}; "
                              f"{probe} has mode {os.stat(probe).st_mode & 0o777:o}): pick another directory with "
                              "hydra.run.dir=..., or make it writable (chmod u+w)")
        enclosing = self.enclosing_run()
        if enclosing is not None:
            raise ConfigError(f"the run directory {self.path} lies inside the run directory {enclosing}: a run "
                              "directory holds one run; give this one a directory outside it (hydra.run.dir=...)")
        inner = self.inner_run()
        if inner is not None:
            raise ConfigError(f"the run directory {self.path} holds the run directory {inner}: a run directory holds "
                              "one run; give this one a directory of its own (hydra.run.dir=...)")
        dirs = list(_WRITTEN_DIRS)
        if logger is not None:  # the loggers' own directories, of those that are on (logger.wandb, .tensorboard)
            dirs += [name for name in ("wandb", "tensorboard") if logger.get(name)]
        wrong = [f"{name} is not a directory" for name in dirs
                 if (self.path / name).exists() and not (self.path / name).is_dir()]
        wrong += [f"{name} is a directory" for name in _WRITTEN_FILES if (self.path / name).is_dir()]
        if (self.path / REPLACED).is_symlink():  # what a start moves aside would leave the run directory
            wrong.append(f"{REPLACED} is a symbolic link to {os.readlink(self.path / REPLACED)}, not a folder of its own")
        for name in (*dirs, *_WRITTEN_FILES):
            if name == "train.log" or not (self.path / name).is_symlink() or name == REPLACED:
                continue
            try:
                inside_folder(self.path / name, self.path)
            except OutsideFolder as exc:
                wrong.append(str(exc))
        wrong += [f"{name} cannot be written by this user (mode {os.stat(self.path / name).st_mode & 0o777:o})"
                  for name in (*dirs, *_APPENDED) if (self.path / name).exists() and not os.access(
                      self.path / name, os.W_OK | (os.X_OK if (self.path / name).is_dir() else 0))]
        if wrong:
            raise ConfigError(f"the run directory {self.path} holds what this run cannot write over: "
                              f"{'; '.join(wrong)} (expected the run's own file or folder of that name, writable, "
                              "or nothing); move it away, or give the run its own directory (hydra.run.dir=...)")

    def lock(self) -> None:
        """Hold an exclusive lock for the run's lifetime: a second process in the same directory is refused rather
        than left to overwrite the first one's checkpoints. Released when the process ends, however it ends."""
        try:
            super().lock()
        except LockHeld as exc:
            raise DirectoryInUse(f"run directory {self.path} is in use by another process ({exc.holder}); wait for "
                               "it to end, or give this run its own directory (hydra.run.dir=...)") from None

    def archive(self, names: Iterable[str] | None = None, label: str = "") -> Path | None:
        """Move the previous run to ``.replaced/<UTC time>/`` (trainer.overwrite=true): by default every entry of
        :data:`RUN_ENTRIES` there (its logs, records, checkpoints, event files, evaluations, Hydra's record), with
        ``why.txt`` saying why. Nothing is deleted, nothing of the new run is written into the old one's files, and
        what no run writes (a user's notes) stays where it is, named in the log."""
        if names is None:
            names = [name for name in RUN_ENTRIES if os.path.lexists(self.path / name)]
            others = sorted(p.name for p in self.path.iterdir() if p.name not in (*RUN_ENTRIES, self.lock_name,
                                                                                   REPLACED)) \
                if self.path.is_dir() else []
            if others and self.is_main:
                log.warning("trainer.overwrite=true: left in place in %s, as no run writes them: %s", self.path,
                            ", ".join(others))
        dest = super().archive(names, label)
        if dest is not None:
            write_text_atomic(dest / "why.txt", "trainer.resume=never trainer.overwrite=true: the run this directory "
                                                "held, replaced by a new run\n")
            log.warning("trainer.overwrite=true: the previous run in %s was moved to %s", self.path, dest)
        return dest

    def note_checkpoint(self, step: int) -> None:
        """run.json records the step of the latest checkpoint, so that a run whose checkpoints went missing is told
        from an attempt that stopped before its first one."""
        record = self.record() if self.is_main else None
        if record is not None:
            record["checkpoint_step"] = step
            write_json_atomic(self.path / "run.json", record)

    def write_record(self, config: dict[str, Any], event: str, step: int, changed: list[Difference],
                     ran: dict[str, Any] | None = None) -> None:
        """run.json: the current config and one history entry per start / resume, with the keys it changed and
        ``ran``: what this start computes with as torch reports it (quest.store.run_files.RanWith)."""
        if not self.is_main:
            return
        record = self.record()
        entry: dict[str, Any] = {"event": event, "time": _now(), "step": step}
        if record is None:
            record = {"format": "quest-run-v1", "created": _now(), "history": []}
            if event == "resume":  # run.json was missing or damaged: the history before this start is unknown
                entry["note"] = "run.json rebuilt from the checkpoint; earlier history unknown"
        if ran:
            entry["ran"] = dict(ran)
        if changed:
            entry["changed"] = {d.key: [None if d.stored is ABSENT else d.stored, None if d.new is ABSENT else d.new]
                                for d in changed}
        record["history"].append(entry)
        record["config"] = config
        write_json_atomic(self.path / "run.json", record)
