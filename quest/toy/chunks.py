"""A chunk of the toy study on disk (``<out>/chunks/[n<size>/]<name>-data<seed>.pt``): every run of one (formulation,
training-set size, data realisation), written by :func:`chunk_of` and believed back only through :func:`read_chunk`.

A rerun reuses a chunk its manifest says it wrote, and every chunk is aggregated into the study's CSVs and figures,
so a chunk is read as every file quest reads back is (docs/training.md, "What quest reads back"): each field of
:class:`ChunkRecord` and of each of its rows (:class:`ChunkRow`) checked for its type and range (quest.store.records),
then against the task it is read for: the config's fingerprint, one row per (lr, weight decay, initialisation) of the
grid in the order they trained, the formulation, data realisation and training-set size, one accuracy per extra test
set, key-norm trajectories of shape (runs, epochs + 1, 3). A chunk that fails is refused in one line naming the file
and the field (:class:`~quest.store.damage.DamagedFile`), before the study changes anything (docs/experiments.md).
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import math
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping, Sequence

import torch

from quest.store.damage import DamagedFile
from quest.store.records import SEED_RANGE, bounded, check_record, described, field_problem, key_of, matching, record
from quest.store.torch_files import inspect_torch_file

from .batched import ChunkResult, RunSpec
from .data import MAX_SAMPLES
from .outcomes import test_key

__all__ = ["ENGINE_VERSION", "ChunkTask", "ChunkRow", "ChunkPhases", "ChunkRecord", "fingerprint", "grid_runs",
           "chunk_of", "read_chunk"]

ENGINE_VERSION = 2  # part of every chunk's fingerprint: chunks of the engine before (vmap, version 1) are refused

#: what to do about a chunk that cannot be believed: the study trains a missing chunk again
REMEDY = "Move it out of the folder and run the study again: it trains that chunk anew"

#: an accuracy: a fraction of the samples
ACCURACY = bounded(0, 1, **described("a fraction in [0, 1]"))

#: a final training loss: a cross-entropy, NaN or infinite where the run diverged (large lrs do)
Loss = float | Literal["nan", "inf"]


def fingerprint(cfg: Mapping[str, Any], data: Mapping[str, Any], spec: Mapping[str, Any], tests: Sequence[float]) -> str:
    """What a chunk was trained with, as 16 hex digits: the grid, model, training and data settings, the variant,
    the extra test sets, the probe and the engine."""
    keys = {k: cfg[k] for k in ("grid", "model", "train")} | {
        "data": data, "variant": {k: spec[k] for k in ("attention", "param_init", "frozen")}, "tests": list(tests),
        "probe_size": cfg["probe_size"], "engine": ENGINE_VERSION}
    return hashlib.sha256(json.dumps(keys, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class ChunkTask:
    """One chunk to train or read back."""

    name: str  # attention or variant name: the "attention" column of the outputs
    spec: dict
    data: dict  # ToyDataConfig fields (train_size of this chunk)
    tests: tuple  # biased fractions of the extra test sets (sensitivity), () for the grid
    data_seed: int
    path: str
    fingerprint: str
    position: str = ""  # "chunk k/K" of the chunks this command trains, for progress lines


def grid_runs(grid: Mapping[str, Any]) -> list[RunSpec]:
    """The runs of a chunk of ``grid``, in the order they train and are stored."""
    return [RunSpec(float(lr), float(wd), int(s))
            for lr, wd, s in itertools.product(grid["lrs"], grid["weight_decays"], grid["init_seeds"])]


@dataclasses.dataclass
class ChunkRow:
    """One run of a chunk: its grid point, its accuracies on the training set and each test set, its final loss."""

    extra_values: ClassVar[Any] = float  # test_acc_b<fraction>: the accuracy on each extra test set (sensitivity)

    attention: str
    lr: float = dataclasses.field(metadata=bounded(0, open_low=True))
    weight_decay: float = dataclasses.field(metadata=bounded(0))
    data_seed: int = dataclasses.field(metadata=bounded(*SEED_RANGE))
    init_seed: int = dataclasses.field(metadata=bounded(*SEED_RANGE))
    train_size: int = dataclasses.field(metadata=bounded(1, MAX_SAMPLES))
    train_acc: float = dataclasses.field(metadata=ACCURACY)
    test_acc: float = dataclasses.field(metadata=ACCURACY)
    final_train_loss: Loss = dataclasses.field(metadata=bounded(0))


@dataclasses.dataclass
class ChunkPhases:
    """Seconds of a chunk's training steps, key-norm probes and evaluation."""

    closed: ClassVar[bool] = True

    steps: float = dataclasses.field(metadata=bounded(0))
    probe: float = dataclasses.field(metadata=bounded(0))
    eval: float = dataclasses.field(metadata=bounded(0))


@dataclasses.dataclass
class ChunkRecord:
    """A chunk file: the dict :func:`chunk_of` makes, every key required and no other."""

    closed: ClassVar[bool] = True

    fingerprint: str = dataclasses.field(metadata=matching("[0-9a-f]{16}", "16 hex digits, a toy config's fingerprint"))
    rows: list[ChunkRow]
    # (runs, epochs + 1, 3): mean raw key norm of biased answer, unbiased answer and other tokens after every epoch;
    # (runs, 0, 3) with probe_size=0
    key_norms: torch.Tensor
    seconds: float = dataclasses.field(metadata=bounded(0))  # the chunk's wall time, data and models built included
    phases: dict[str, Any] = dataclasses.field(metadata=record(ChunkPhases))


def chunk_of(task: ChunkTask, runs: Sequence[RunSpec], res: ChunkResult, seconds: float) -> dict[str, Any]:
    """The chunk file of ``task``'s ``runs`` trained to ``res`` in ``seconds``: accuracies, not outcomes (those are
    derived when results are aggregated)."""
    rows = []
    for i, run in enumerate(runs):
        row = {"attention": task.name, "lr": run.lr, "weight_decay": run.weight_decay, "data_seed": task.data_seed,
               "init_seed": run.init_seed, "train_size": task.data["train_size"],
               "train_acc": round(res.train_acc[i].item(), 6), "test_acc": round(res.test_acc[i].item(), 6)}
        for fraction in task.tests:
            row[test_key(fraction)] = round(res.test_accs[test_key(fraction)][i].item(), 6)
        row["final_train_loss"] = round(res.final_loss[i].item(), 6)
        rows.append(row)
    return {"fingerprint": task.fingerprint, "rows": rows, "key_norms": res.key_norms, "seconds": seconds,
            "phases": res.seconds}


def _loss_as_text(row: Any) -> Any:
    """``row`` with a NaN or infinite float loss (a diverged run's, as torch.save keeps it) as its text, the form
    :data:`Loss` declares (-inf, which no cross-entropy is, stays a float, to be refused as one)."""
    loss = row.get("final_train_loss") if isinstance(row, dict) else None
    if isinstance(loss, float) and (math.isnan(loss) or loss == math.inf):
        return {**row, "final_train_loss": str(loss)}
    return row


def _refuse(path: Path, problem: str) -> DamagedFile:
    return DamagedFile(path, problem, REMEDY, joined=": ")


def _check_row(path: Path, i: int, row: Mapping[str, Any], expected: Mapping[str, Any], tests: Sequence[float]) -> None:
    keys = {key_of(f) for f in dataclasses.fields(ChunkRow)} | {test_key(f) for f in tests}
    unknown, missing = sorted(set(row) - keys), sorted(keys - set(row))
    if unknown or missing:
        found = f"holds {', '.join(unknown)}" if unknown else f"has no {', '.join(missing)}"
        raise _refuse(path, f"rows[{i}] {found}, expected the keys {', '.join(sorted(keys))}")
    for key, want in expected.items():
        if row[key] != want:
            raise _refuse(path, f"rows[{i}].{key} is {row[key]!r}, expected {want!r} (run {i} of the grid, formulation "
                                "and data realisation the chunk is for)")
    for fraction in tests:
        problem = field_problem(row[test_key(fraction)], float, ACCURACY["bounds"], f"rows[{i}].{test_key(fraction)}")
        if problem:
            raise _refuse(path, problem)


def _check_key_norms(path: Path, norms: torch.Tensor, shape: tuple[int, int, int]) -> None:
    if norms.layout != torch.strided or norms.device.type != "cpu" or not norms.is_floating_point() \
            or tuple(norms.shape) != shape:
        raise _refuse(path, f"key_norms is a {norms.dtype} tensor of shape {tuple(norms.shape)} on {norms.device} "
                            f"({norms.layout}), expected a dense floating-point tensor of shape {shape} (runs, epochs "
                            "+ 1, token groups) on the CPU")
    if bool((norms < 0).any()):
        raise _refuse(path, "key_norms holds a negative value, expected norms >= 0 (NaN where a group of tokens is "
                            "empty or a run diverged)")


def read_chunk(task: ChunkTask, cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The chunk at ``task.path`` once every field is checked against its declaration and ``task`` (``cfg``: the
    study's config); :class:`~quest.store.damage.DamagedFile` naming the file and the field when one fails, a
    ValueError when the chunk is of another toy config."""
    path = Path(task.path)
    found = inspect_torch_file(path)
    if found.kind in ("empty", "not_torch", "truncated", "unsafe"):
        raise DamagedFile(path, f"not a chunk of the toy study: {found.detail}", REMEDY, joined=" is ")
    chunk, runs = found.obj, grid_runs(cfg["grid"])
    if isinstance(chunk, dict) and isinstance(chunk.get("rows"), list):
        if len(chunk["rows"]) != len(runs):  # before each row is checked: a list of millions is refused at once
            raise _refuse(path, f"rows holds {len(chunk['rows'])} runs, expected {len(runs)} (one per lr x weight "
                                "decay x initialisation of the grid)")
        chunk = {**chunk, "rows": [_loss_as_text(row) for row in chunk["rows"]]}
    try:
        check_record(ChunkRecord, chunk, path, "a chunk of the toy study")
    except DamagedFile as exc:
        raise DamagedFile(exc.path, exc.problem, REMEDY, exc.joined) from None
    if chunk["fingerprint"] != task.fingerprint:
        raise ValueError(f"{path} holds results of a different toy config (fingerprint {chunk['fingerprint']}, this "
                         f"config {task.fingerprint}); use another output directory (hydra.run.dir=... or out_dir=...)")
    for i, (row, run) in enumerate(zip(chunk["rows"], runs)):
        expected = {"attention": task.name, "lr": run.lr, "weight_decay": run.weight_decay,
                    "data_seed": task.data_seed, "init_seed": run.init_seed, "train_size": task.data["train_size"]}
        _check_row(path, i, row, expected, task.tests)
    epochs = cfg["train"]["epochs"] + 1 if cfg["probe_size"] else 0
    _check_key_norms(path, chunk["key_norms"], (len(runs), epochs, 3))
    return chunk
