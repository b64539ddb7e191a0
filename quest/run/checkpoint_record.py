"""What a training checkpoint holds: :class:`CheckpointRecord`, one versioned dataclass that every writer and reader
of ``checkpoints/*.pt`` goes through (the trainer, resume planning, ``init_from``, evaluation, export).

On disk a record is a dict of tensors and plain containers (so that it loads with ``weights_only=True``):
``{"format": FORMAT, "version": VERSION, <one key per field>}``. A file of an older layout (one written before the
``version`` key existed) is upgraded by quest.store.compat when it is loaded (quest.run.checkpoint.load_record), so a
record is only ever built from today's layout. A dict with a key this quest does not know, without a required key
or the version, or of a version it does not read is refused with an error naming the keys and the versions.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from quest.store.damage import DamagedFile
from quest.store.records import bounded, check_fields, record
from quest.store.torch_files import FORMAT

from .train_state import TrainState

__all__ = ["CheckpointRecord", "CheckpointRecordError", "config_problems", "VERSION", "SUPPORTED_VERSIONS", "STATEFUL_PARTS"]

#: The record layout this quest writes.
VERSION = 1
#: The record layouts this quest reads (an older file is given its version by quest.store.compat.upgrade_checkpoint).
SUPPORTED_VERSIONS = (1,)
#: The fields that hold the state_dicts of a run's stateful parts (Checkpointer.save/restore take these by name).
STATEFUL_PARTS = ("model", "ema", "optimizer", "scheduler", "scaler", "state")


class CheckpointRecordError(DamagedFile):
    """A checkpoint that loads whole but whose dict does not match the record: keys missing or unknown, a version this
    quest cannot read, a field of the wrong type or range. Its own class because the way out differs from a file cut
    short: another copy of the same file would not help (resume planning and evaluation pass its message on as it
    is, where a file torch cannot load is told to be restored from a copy)."""


def config_problems(config: dict[str, Any]) -> list[str]:
    """One line per value of a stored training config that breaks its train.py declaration (quest.config.schema, and
    the data set's own settings; quest.config.checks.declared_problems), "  <key> must be <allowed>, got <value>"."""
    from omegaconf import OmegaConf

    from quest.config.checks import declared_problems
    from quest.config.schema import TrainConfig
    from quest.data.registry import get_dataset, list_datasets

    stored = OmegaConf.create(config)
    problems = declared_problems(stored, TrainConfig)
    name = OmegaConf.select(stored, "data.name")
    # a data set this install does not have (a plugin's) has no settings to check here: a reader that needs the data
    # (eval.py) refuses its name itself; resume, init_from and export need only the model
    if isinstance(name, str) and name in list_datasets() and OmegaConf.is_dict(stored.data):
        seen = set(problems)  # a data set's settings (a subclass of DataConfig) add their own keys' declarations
        problems += [p for p in declared_problems(stored.data, get_dataset(name).settings, "data.") if p not in seen]
    return problems


@dataclass
class CheckpointMeta:
    """What the weights fit (``meta``): a checkpoint is loaded only into a model of these."""

    model: str
    attention: str
    num_classes: int = field(metadata=bounded(1))
    img_size: int | list[int] = 0
    attention_options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Derived:
    """Values computed from the config and the process count that a resume must reproduce (``derived``)."""

    global_batch: int = field(default=1, metadata=bounded(1))
    lr: float = field(default=0.0, metadata=bounded(0.0))
    steps_per_epoch: int = field(default=0, metadata=bounded(0))
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"


@dataclass
class DataFingerprint:
    """The data a resume must match (``data``)."""

    train_size: int = field(default=0, metadata=bounded(0))
    val_size: int = field(default=0, metadata=bounded(0))
    classes: list[str] | None = None  # None: a data set without class names
    #: how the images are stored when that changes them: a capped copy's short_side, quality and resample
    #: (quest-data cap); None: as they are. Absent in a checkpoint written before it was recorded: not compared
    storage: dict[str, Any] | None = None
    #: SHA-256 of every split's sorted (relative path, file size, label) (quest.run.directory.files_sha256); None: a
    #: data set that lists no files. Absent in a checkpoint written before it was recorded: not compared
    files_sha256: str | None = None


@dataclass
class CheckpointRecord:
    """Everything a quest training checkpoint holds. Each field's type (and, in its metadata, its range or the
    record its mapping is) is checked when a file is read (:meth:`from_dict`, quest.store.records)."""

    model: dict[str, Any]  # the model's full state_dict (gathered from the shards under FSDP)
    config: dict[str, Any]  # the resolved training config (quest.config.schema), plain containers
    #: model, attention, num_classes, img_size, attention_options: what the weights fit
    meta: dict[str, Any] = field(metadata=record(CheckpointMeta))
    #: quest.run.train_state.TrainState as a dict: step, epoch, best, counts
    state: dict[str, Any] = field(metadata=record(TrainState))
    ema: dict[str, Any] | None = None  # the EMA model's state_dict; None when trained without EMA
    optimizer: dict[str, Any] | None = None  # None under FSDP: the optimizer state is in the sharded directory
    scheduler: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None  # the fp16 loss scaler's state (a disabled scaler's is empty)
    rng: list[Any] | None = None  # every rank's RNG streams, in rank order (quest.run.checkpoint.rng_state)
    sharded: str | None = None  # FSDP: the name of the sharded ``<name>.dcp/`` directory beside this file
    choices: dict[str, str] = field(default_factory=dict)  # the config group choices (model, attention, ...)
    #: global batch, lr, steps per epoch, precision
    derived: dict[str, Any] = field(default_factory=dict, metadata=record(Derived))
    #: the data fingerprint (split sizes, classes) a resume must match
    data: dict[str, Any] | None = field(default=None, metadata=record(DataFingerprint))
    #: the size of metrics.jsonl when this state was written
    metrics_bytes: int | None = field(default=None, metadata=bounded(0))
    metrics_text: str | None = None  # metrics.jsonl up to this state (rebuilds a missing or damaged file)
    version: int = VERSION

    @classmethod
    def required(cls) -> tuple[str, ...]:
        """The fields without a default: every checkpoint has them."""
        return tuple(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)

    def to_dict(self) -> dict[str, Any]:
        """The dict written to disk (``format`` first)."""
        return {"format": FORMAT, **{f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_dict(cls, stored: dict[str, Any], path: str | Path = "checkpoint") -> "CheckpointRecord":
        """The record of a loaded checkpoint dict; CheckpointRecordError naming what does not fit."""
        if not isinstance(stored, dict) or stored.get("format") != FORMAT:
            raise CheckpointRecordError(path, f"is not a quest checkpoint (expected format {FORMAT!r})", joined=" ")
        if "version" not in stored:  # load_record upgrades a file written before the key; a dict must say it
            raise CheckpointRecordError(path, "has no record version (a file is read with load_record, which upgrades "
                                        "the layouts of older quest: quest.store.compat.upgrade_checkpoint)", joined=" ")
        version = stored["version"]
        if version not in SUPPORTED_VERSIONS:
            raise CheckpointRecordError(
                path, f"is a quest checkpoint of record version {version!r}; this quest reads version(s) "
                f"{', '.join(map(str, SUPPORTED_VERSIONS))} (written by a newer quest? update quest to read it)", joined=" ")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(stored) - names - {"format"})
        missing = [k for k in cls.required() if k not in stored]
        if unknown or missing:
            raise CheckpointRecordError(
                path, f"(record version {version}) does not match the checkpoint record of this quest: "
                + "; ".join(([f"missing {missing}"] if missing else []) + ([f"unknown {unknown}"] if unknown else []))
                + f" (a record holds {sorted(names)}, of which {list(cls.required())} are required)", joined=" ")
        try:
            check_fields(cls, stored, path)
        except DamagedFile as exc:
            raise CheckpointRecordError(exc.path, f"{exc.problem} (a damaged or hand-edited checkpoint: use another, e.g. "
                                        "checkpoints/best.pt, or start the run again)", joined=exc.joined) from None
        problems = config_problems(stored["config"]) if isinstance(stored.get("config"), dict) else []
        if problems:  # a value train.py never writes: named here, not met deep inside building the model
            raise CheckpointRecordError(path, "; ".join(f"config.{p.strip()}" for p in problems) + " (a damaged or "
                                        "hand-edited checkpoint: train.py would refuse this config; use another, e.g. "
                                        "checkpoints/best.pt, or start the run again)", joined=": ")
        sharded = stored.get("sharded")
        if sharded is not None and (Path(sharded).name != sharded or sharded in ("", ".", "..")):
            raise CheckpointRecordError(path, f"sharded is {sharded!r}, expected the name of a directory beside the "
                                        "checkpoint (no path)", joined=": ")
        return cls(**{k: v for k, v in stored.items() if k != "format"})

    def stateful(self) -> dict[str, Any]:
        """The state_dicts of the run's stateful parts, by name (see STATEFUL_PARTS)."""
        return {name: getattr(self, name) for name in STATEFUL_PARTS}
