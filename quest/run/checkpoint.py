"""Checkpoints: tensors and plain containers only, written atomically, loaded with ``weights_only=True``.

What a file holds is a :class:`~quest.run.checkpoint_record.CheckpointRecord`. ``save_checkpoint`` /
``load_record`` write and read one file; :class:`Checkpointer` saves and restores a whole training run (its stateful
parts by name: model, full or sharded, EMA, optimizer, scheduler, loss scaler; every rank's RNG streams; the run's
record) so that a resumed run continues bit-identically.
"""
from __future__ import annotations

import errno
import logging
import os
import random
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from quest.runtime.distributed import DistContext, gather_objects
from quest.store.compat import upgrade_checkpoint
from quest.store.files import atomic_write, cut_write_temporaries
from quest.store.torch_files import FORMAT, checkpoint_problem, inspect_torch_file, load_weights_only
from quest.store.tree import remove, same_file_as
from quest.store.weights_check import check_weights

from .checkpoint_record import STATEFUL_PARTS, VERSION, CheckpointRecord, CheckpointRecordError

log = logging.getLogger("quest.train")

__all__ = ["CheckpointWriteError", "save_checkpoint", "load_checkpoint", "load_record", "read_init_from", "check_compatible",
           "replace_with_link", "rng_state", "set_rng_state", "Checkpointer", "CheckpointRecord", "CheckpointRecordError",
           "check_resumed_weights"]

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (full disk, quota); the previous file at that path is intact."""


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError behind ``exc``: torch's zip writer reports a full disk as a RuntimeError raised from one."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def _write_error(path: Path, exc: OSError) -> CheckpointWriteError:
    try:
        free = f"{shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    what = "no space left on the device" if exc.errno in _NO_SPACE else exc.strerror or str(exc)
    return CheckpointWriteError(exc.errno, f"cannot write checkpoint {path}: {what} ({free} in {path.parent}); "
                                           f"the previous {path.name}, if any, is intact")


def save_checkpoint(path: str | Path, record: CheckpointRecord | dict[str, Any]) -> None:
    """Write ``record`` (a dict is checked against CheckpointRecord first) atomically (quest.store.files.atomic_write: a
    temporary file, fsync, rename): a crash never leaves half a file, and a failed write (full disk) leaves neither a
    temporary file nor a damaged previous checkpoint."""
    path = Path(path)
    if not isinstance(record, CheckpointRecord):
        record = CheckpointRecord.from_dict({"version": VERSION, **record, "format": FORMAT}, path)
    state = record.to_dict()
    try:
        atomic_write(path, lambda f: torch.save(state, f))
    except (OSError, RuntimeError) as exc:
        cause = _os_error(exc)
        if cause is None:
            raise
        raise _write_error(path, cause) from exc


def replace_with_link(source: Path, target: Path) -> None:
    """Make ``target`` the same file as ``source`` (quest.store.tree.same_file_as: a hard link, else a copy; a full
    disk is not worked around by a copy), or :class:`CheckpointWriteError` naming it and the space left."""
    try:
        same_file_as(source, target, keep_errnos=_NO_SPACE)
    except OSError as exc:
        raise _write_error(target, exc) from exc


def load_record(path: str | Path, map_location: str | torch.device = "cpu",
                option: str = "checkpoint") -> CheckpointRecord:
    """The record in ``path``, loaded with ``weights_only=True``, for every reader of a checkpoint (resume, eval.py's
    ``checkpoint=``, ``trainer.init_from=``, quest-export): a missing file or a directory (OSError) or a file that is
    not a whole quest checkpoint (ValueError: text, a plain state_dict, a pickled module, a cut or corrupt file, as
    quest.store.torch_files tells them apart) refused in one line naming ``<option>=path`` and saying which case it
    is; CheckpointRecordError when it is one this quest cannot read (naming the keys and versions)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{option}={path} " + ("is a directory; pass a checkpoint file such as "
                                "<run>/checkpoints/last.pt" if path.is_dir() else "does not exist"))
    found = inspect_torch_file(path)  # every member's CRC checked: torch.load would read damaged bytes as they are
    if found.kind != "quest_checkpoint":
        raise ValueError(checkpoint_problem(path, found, option=option))
    obj = found.obj if str(map_location) == "cpu" else load_weights_only(path, map_location)
    return CheckpointRecord.from_dict(upgrade_checkpoint(obj), path)


def read_init_from(path: str | Path) -> CheckpointRecord:
    """The checkpoint ``trainer.init_from=path`` names (:func:`load_record`'s checks, named by that key)."""
    return load_record(path, option="trainer.init_from")


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """The record in ``path`` as a plain dict (``format``, ``version`` and one key per field), for scripts and
    tests that index it; quest's own readers use :func:`load_record`."""
    return load_record(path, map_location).to_dict()


def check_compatible(record: CheckpointRecord, expected: dict[str, Any], path: str | Path) -> None:
    """Fail with both descriptions when a checkpoint was written for another model, attention or class count."""
    found = record.meta
    diffs = [k for k in expected if found.get(k) != expected[k]]
    if diffs:
        have = ", ".join(f"{k}={found.get(k)!r}" for k in diffs)
        want = ", ".join(f"{k}={expected[k]!r}" for k in diffs)
        raise ValueError(f"checkpoint {path} was written for {have}, but this run is {want}")


def rng_state() -> dict[str, Any]:
    """Every RNG a training step may draw from (augmentation, mixup, drop path), as tensors and plain values."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *map(_plain, np_state[2:])],
        "python": _plain(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _plain(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.generic):
        return value.item()
    return value


class Checkpointer:
    """``checkpoints/last.pt`` (and ``best.pt``) of one run directory, for DDP (one file) and FSDP (a small file
    beside a sharded ``<name>.dcp/`` directory). ``every_n_steps`` (trainer.checkpoint_every_n_steps; 0: at epoch
    ends only) is its cadence inside an epoch (:meth:`due`); ``on_save`` is told the step of every checkpoint
    written."""

    def __init__(self, ckpt_dir: Path, ctx: DistContext, sharded: bool, every_n_steps: int = 0,
                 on_save: Callable[[int], None] | None = None):
        self.dir, self.ctx, self.sharded = Path(ckpt_dir), ctx, sharded
        self.every_n_steps, self.on_save = every_n_steps or 0, on_save
        self.saved_step: int | None = None  # the step of the last checkpoint written or resumed from

    def due(self, step: int) -> bool:
        """Whether a checkpoint is written after optimizer step ``step`` inside an epoch."""
        return bool(self.every_n_steps) and step % self.every_n_steps == 0

    def saved(self) -> str | None:
        """``last.pt`` and the step it holds, when this run wrote or resumed from one."""
        if self.saved_step is None or not self.last.is_file():
            return None
        return f"{self.last} (step {self.saved_step})"

    @property
    def last(self) -> Path:
        return self.dir / "last.pt"

    @property
    def best(self) -> Path:
        return self.dir / "best.pt"

    def clean_temporaries(self) -> list[Path]:
        """Remove what a killed write left behind (the caller holds the run directory's lock): only temporaries named
        as this class's writes name theirs (``.last.pt.<random>.tmp``, ``last.dcp.tmp``); a command removes only what
        it wrote (docs/training.md, "What a command may remove")."""
        dcp = [self.dir / f"{name}.dcp.tmp" for name in ("last", "best")]  # a sharded save's folder
        stale = [*cut_write_temporaries(self.dir / "last.pt"), *cut_write_temporaries(self.best),
                 *(p for p in dcp if os.path.lexists(p))]
        for p in stale:
            remove(p)
        if stale:
            log.info("removed %d temporary file(s) of an interrupted checkpoint write: %s", len(stale),
                     ", ".join(p.name for p in stale))
        return stale

    def save(self, parts: dict[str, Any], record: dict[str, Any], best: bool = False) -> None:
        """Write the run's state: ``parts`` its stateful parts by name (STATEFUL_PARTS: model, ema, optimizer,
        scheduler, scaler, state (the run's counters, quest.run.train_state.TrainState); an absent EMA or scaler is
        None), ``record`` the CheckpointRecord's other fields. With
        ``best``, to ``best.pt`` first and then ``last.pt`` as the same file, so that no ``last.pt`` ever records a
        best epoch whose ``best.pt`` is missing. Collective under DDP/FSDP."""
        self._write(parts, record, best)
        self.saved_step = parts["state"].step
        if self.on_save is not None:
            self.on_save(self.saved_step)

    def _write(self, parts: dict[str, Any], record: dict[str, Any], best: bool) -> None:
        _check_parts(parts)
        model, optimizer = parts["model"], parts["optimizer"]
        rngs = gather_objects(rng_state(), self.ctx)  # every rank draws its own augmentation randomness
        sharded_dir = None
        if self.sharded:  # collectives: every rank writes its shard and helps gather the full weights
            from quest.runtime.fsdp import full_model_state_dict, save_sharded

            sharded_dir = "last.dcp"
            save_sharded(self.dir / sharded_dir, model, optimizer, self.ctx)
            weights = full_model_state_dict(model)
        if not self.ctx.is_main:
            return
        # under FSDP the gathered weights, and the optimizer state only in the shards
        local = {"model": weights, "optimizer": None} if self.sharded else {}
        states = {name: local[name] if name in local else part.state_dict() if part is not None else None
                  for name, part in parts.items()}
        saved = CheckpointRecord(**states, rng=rngs, sharded=sharded_dir, **record)
        if best:
            save_checkpoint(self.best, saved)
            replace_with_link(self.best, self.last)
        else:
            save_checkpoint(self.last, saved)

    def restore(self, saved: CheckpointRecord, path: Path, parts: dict[str, Any], schedule: bool = True) -> None:
        """Load a checkpoint's state into the run's ``parts`` (by name, as for save) and this rank's RNG streams.
        ``schedule=False`` keeps the scheduler as built (a run extended to more epochs follows the longer schedule
        from its current step)."""
        _check_parts(parts)
        if bool(saved.sharded) != self.sharded:
            raise ValueError(f"checkpoint {path} was written with strategy "
                             f"{'fsdp' if saved.sharded else 'ddp'}, this run uses "
                             f"{'fsdp' if self.sharded else 'ddp'}")
        missing = [k for k in ("scheduler", "rng") + (() if self.sharded else ("optimizer",))
                   if getattr(saved, k) is None]
        if missing:
            raise CheckpointRecordError(path, f"is a checkpoint that holds no {missing}: it cannot be resumed (it can "
                                        "be evaluated, or used with trainer.init_from=)", joined=" ")
        check_resumed_weights(saved, path, parts, self.sharded)  # before any part changes
        if self.sharded:
            from quest.runtime.fsdp import load_sharded

            load_sharded(path.parent / saved.sharded, parts["model"], parts["optimizer"])
        else:
            parts["model"].load_state_dict(saved.model)
            parts["optimizer"].load_state_dict(saved.optimizer)
        if parts["ema"] is not None and saved.ema is not None:
            parts["ema"].load_state_dict(saved.ema)
        if schedule:
            parts["scheduler"].load_state_dict(saved.scheduler)
        if parts["scaler"] is not None and saved.scaler is not None:
            parts["scaler"].load_state_dict(saved.scaler)
        parts["state"].load_state_dict(saved.state)
        rngs = saved.rng
        if len(rngs) != self.ctx.world_size:
            log.warning("checkpoint was written by %d processes, this run has %d: RNG streams restart from rank 0's",
                        len(rngs), self.ctx.world_size)
        set_rng_state(rngs[self.ctx.rank] if len(rngs) == self.ctx.world_size else rngs[0])
        self.saved_step = saved.state["step"]


def check_resumed_weights(saved: CheckpointRecord, path: Path, parts: dict[str, Any], sharded: bool) -> None:
    """The model's and the EMA's weights of ``saved`` checked (quest.store.weights_check) against the parts they are loaded
    into: a damaged file refused before the run starts, never trained on and recorded as the run's divergence.
    Under FSDP the model's shapes are the shards' (its weights load from them): only the values are checked."""
    advice = "restore it from a copy, or resume from another checkpoint (best.pt)"
    check_weights(saved.model, path, "model weights", None if sharded else parts["model"].state_dict(),
                  advice=advice)
    if parts["ema"] is not None and saved.ema is not None:
        check_weights(saved.ema, path, "EMA weights", parts["ema"].state_dict(), advice=advice)


def _check_parts(parts: dict[str, Any]) -> None:
    if set(parts) != set(STATEFUL_PARTS):
        raise TypeError(f"Checkpointer takes the stateful parts {list(STATEFUL_PARTS)} by name, got {sorted(parts)}")
