"""The files of a run directory and of an export as typed records (quest.store.records): ``metrics.jsonl``'s rows,
``run.json``, ``summary.json`` (written by train.py) and an exported folder's ``config.json`` (written by
quest-export). Every reader of these files (resume, quest-report, quest-plot, quest-export, eval.py ``weights=``)
goes through the readers here, which check every field's type and range before anything believes it; a file that
fails is one :class:`~quest.store.damage.DamagedFile` naming the file and the field (docs/training.md, "What quest reads
back"). No torch here: quest-report and quest-plot import it.

Keys a record does not declare are allowed (a newer quest may write more); a declared key is always checked, and a
metrics row's undeclared values (per-layer diagnostics, telemetry) must be numbers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from quest.store.damage import DamagedFile
from quest.store.files import read_json
from quest.store.records import Number, bounded, check_record, record, relative_path, stored_as

__all__ = ["is_run", "run_holding", "is_run_directory", "RECORDED_THREADS", "MetricsRow", "RunRecord", "RunSummary",
           "ExportConfig", "check_metrics_row",
           "read_run_record", "read_summary", "checked_run_record", "checked_summary", "checked_export_config",
           "SUMMARY_STATUSES"]

#: a recorded count of intra-op threads, as a resume sets it again: more than any machine has is a damaged record
#: (torch.set_num_threads(10**12) raises an overflow deep in the resume; 10**5 would start that many threads)
RECORDED_THREADS = bounded(1, 4096)

#: every status a summary.json may hold (quest.train.lifecycle)
SUMMARY_STATUSES = ("completed", "stopped", "diverged", "bad_data", "interrupted", "requeued")

_PERCENT = bounded(0.0, 100.0)


def _percent(key: str) -> Any:
    return field(default=None, metadata=stored_as(key, **_PERCENT))


def _count(key: str) -> Any:
    return field(default=None, metadata=stored_as(key, **bounded(0)))


@dataclass(kw_only=True)
class Validation:
    """What a validation pass reports (quest.train.loop): a metrics row of a validation, and summary.json."""

    val_top1: float | None = _percent("val/top1")
    val_top5: float | None = _percent("val/top5")
    val_loss: Number | None = _count("val/loss")
    val_images: int | None = _count("val/images")
    val_skipped: int | None = _count("val/skipped")
    val_ema_top1: float | None = _percent("val_ema/top1")
    val_ema_top5: float | None = _percent("val_ema/top5")
    val_ema_loss: Number | None = _count("val_ema/loss")


@dataclass(kw_only=True)
class MetricsRow(Validation):
    """One line of metrics.jsonl: a training log step, a validation, a diagnostic step (quest.train.loop)."""

    extra_values: ClassVar[Any] = Number | None  # diag/<layer>/<stat>, perf/..., data/...: numbers

    step: int = field(metadata=bounded(0))
    epoch: float | None = field(default=None, metadata=bounded(0.0))
    train_loss: Number | None = _count("train/loss")
    train_grad_norm: Number | None = _count("train/grad_norm")
    train_lr: float | None = _count("train/lr")
    train_img_per_s: float | None = _count("train/img_per_s")
    train_skipped: int | None = _count("data/train_skipped")
    train_drawn: int | None = _count("data/train_drawn")


@dataclass
class RanWith:
    """What one start or resume of a run computed with, as torch reported it then (the config says what was asked;
    this says what ran): float32 matmul and convolution precision (trainer.matmul_precision) and the like."""

    extra_values: ClassVar[Any] = str | bool | int | float | None  # further facts of the same kind: plain values

    float32_matmul_precision: Literal["highest", "high", "medium"] | None = None
    cuda_matmul_allow_tf32: bool | None = None
    cudnn_allow_tf32: bool | None = None
    torch_threads: int | None = field(default=None, metadata=RECORDED_THREADS)  # a CPU run's intra-op threads


@dataclass
class HistoryEntry:
    event: Literal["start", "resume"]
    time: str = ""
    step: int = field(default=0, metadata=bounded(0))
    note: str = ""
    changed: dict[str, list[Any]] = field(default_factory=dict)  # key -> [stored, new]
    ran: dict[str, Any] = field(default_factory=dict, metadata=record(RanWith))  # absent in older run.json


@dataclass
class RunRecord:
    """run.json (quest.run.directory.RunDirectory.write_record)."""

    history: list[HistoryEntry]
    config: dict[str, Any]  # the resolved training config (checked as a config when it is compared or resumed)
    format: Literal["quest-run-v1"] = "quest-run-v1"
    created: str = ""
    checkpoint_step: int | None = field(default=None, metadata=bounded(0))


@dataclass
class SkippedImages:
    train: int | None = field(default=None, metadata=bounded(0))
    train_drawn: int | None = field(default=None, metadata=bounded(0))
    val: int | None = field(default=None, metadata=bounded(0))
    val_scored: int | None = field(default=None, metadata=bounded(0))


@dataclass(kw_only=True)
class PerfCounts:
    """What summary.json's ``perf`` gives for the whole run and for each attempt (quest.run.train_state.run_perf): counts and
    times, and every figure's ``<name>_mean`` / ``<name>_max`` (rates, shares, GiB, seconds: numbers or null)."""

    extra_values: ClassVar[Any] = float | None

    steps: int | None = field(default=None, metadata=bounded(0))
    images: int | None = field(default=None, metadata=bounded(0))
    train_s: float | None = field(default=None, metadata=bounded(0.0))
    wall_s: float | None = field(default=None, metadata=bounded(0.0))
    img_per_s: float | None = field(default=None, metadata=bounded(0.0))
    compile_s: float | None = field(default=None, metadata=bounded(0.0))
    compile_steps: int | None = field(default=None, metadata=bounded(0))
    loader_start_s: float | None = field(default=None, metadata=bounded(0.0))


@dataclass(kw_only=True)
class PerfAttempt(PerfCounts):
    first_step: int = field(default=0, metadata=bounded(0))


@dataclass(kw_only=True)
class RunPerf(PerfCounts):
    """summary.json's ``perf`` (one written before attempts were recorded has the figures only)."""

    train_flops_per_image: float | None = field(default=None, metadata=bounded(0.0))
    device_peak_tflops: float | None = field(default=None, metadata=bounded(0.0))
    attempts: list[PerfAttempt] = field(default_factory=list)


@dataclass
class SummaryDataSet:
    """summary.json's ``data_fingerprint`` (quest.run.directory.data_record): what quest-report tells data sets by."""

    train_size: int = field(metadata=bounded(0))
    val_size: int = field(metadata=bounded(0))
    num_classes: int | None = field(default=None, metadata=bounded(1))
    classes_sha256: str | None = None
    files_sha256: str | None = None  # the files' digest (quest.run.directory.files_sha256); None: none listed


@dataclass(kw_only=True)
class RunSummary(Validation):
    """summary.json (quest.train.lifecycle): the outcome, final and best metrics, what identifies the run."""

    status: Literal["completed", "stopped", "diverged", "bad_data", "interrupted", "requeued"]
    step: int = field(default=0, metadata=bounded(0))
    epoch: int = field(default=0, metadata=bounded(0))
    diverged_at_step: int | None = field(default=None, metadata=bounded(0))
    divergence_reason: str | None = None
    best_top1: float | None = _percent("best/val/top1")
    best_epoch: int | None = field(default=None, metadata=bounded(-1))  # -1: no validation yet
    choices: dict[str, str] = field(default_factory=dict)
    attention: str | None = None
    model: str | None = None
    seed: int | None = None
    num_params: int | None = field(default=None, metadata=bounded(0))
    lr: float | None = field(default=None, metadata=bounded(0.0))
    lr_peak: float | None = field(default=None, metadata=bounded(0.0))
    global_batch: int | None = field(default=None, metadata=bounded(1))
    world_size: int | None = field(default=None, metadata=bounded(1))
    train_input: str | None = None
    wall_time_s: float | None = field(default=None, metadata=bounded(0.0))
    train_img_per_s: float | None = field(default=None, metadata=bounded(0.0))
    resumed: bool = False
    run_dir: str | None = None  # where the run was written (it may have moved since): shown, never opened
    checkpoint: str | None = None  # "<path> (step N)": shown, and whether the run saved one
    skipped_images: dict[str, Any] = field(default_factory=dict, metadata=record(SkippedImages))
    left_out_by_preflight: dict[str, dict[str, Any]] = field(default_factory=dict)
    changed_on_resume: dict[str, list[Any]] = field(default_factory=dict)
    perf: dict[str, Any] = field(default_factory=dict, metadata=record(RunPerf))  # quest.run.train_state.run_perf
    data_fingerprint: dict[str, Any] | None = field(default=None, metadata=record(SummaryDataSet))
    signal: str | None = None
    saved: bool | None = None
    requeue: str | None = None
    data_failure: str | None = None


@dataclass
class ExportModelArgs:
    """config.json's ``model_args``: what quest_vit builds (the run's timm model kwargs besides these)."""

    model: str
    attention: str
    attention_options: dict[str, Any] = field(default_factory=dict)
    num_classes: int = field(default=1000, metadata=bounded(1))
    img_size: int | list[int] = field(default=224, metadata=bounded(1))


@dataclass
class ExportPretrainedCfg:
    """config.json's ``pretrained_cfg``: the preprocessing (timm's resolve_data_config reads it)."""

    input_size: list[int] = field(default_factory=lambda: [3, 224, 224])
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)
    crop_pct: float = field(default=0.875, metadata=bounded(0, 1, open_low=True))  # timm divides by it
    interpolation: str = "bicubic"
    num_classes: int = field(default=1000, metadata=bounded(0))
    fixed_input_size: bool = False
    crop_mode: str = "center"
    first_conv: str = ""
    classifier: str = ""


@dataclass
class ExportOnnx:
    file: str = field(metadata=relative_path())  # beside config.json
    opset: int = field(default=17, metadata=bounded(1))
    max_abs_diff_vs_pytorch: float = field(default=0.0, metadata=bounded(0.0))


@dataclass
class ExportProvenance:
    """config.json's ``quest``: where the weights come from."""

    weights: Literal["model", "ema"]
    checkpoint: str = ""  # the exported checkpoint, outside the folder by design: shown, never opened
    checkpoint_sha256: str = ""
    step: int | None = field(default=None, metadata=bounded(0))
    epoch: int | None = field(default=None, metadata=bounded(0))
    train_data: str = ""
    choices: dict[str, str] = field(default_factory=dict)
    quest_version: str = ""
    onnx: dict[str, Any] | None = field(default=None, metadata=record(ExportOnnx))
    val_top1: float | None = field(default=None, metadata=_PERCENT)
    run_status: str | None = None


@dataclass
class ExportConfig:
    """An exported folder's config.json (quest-export; a timm save holds the same top-level keys, model_args and
    quest aside)."""

    architecture: str
    num_classes: int | None = field(default=None, metadata=bounded(1))
    num_features: int | None = field(default=None, metadata=bounded(1))
    global_pool: str | None = None
    model_args: dict[str, Any] | None = field(default=None, metadata=record(ExportModelArgs))
    pretrained_cfg: dict[str, Any] | None = field(default=None, metadata=record(ExportPretrainedCfg))
    quest: dict[str, Any] | None = field(default=None, metadata=record(ExportProvenance))
    label_names: list[str] | None = None


def check_metrics_row(row: Any, source: Any) -> dict[str, Any]:
    """A metrics.jsonl row (``source``: the file and line), every field checked."""
    check_record(MetricsRow, row, source, "a row of metrics.jsonl, a JSON object with an integer 'step'")
    return row


def checked_run_record(data: Any, path: Path | str) -> dict[str, Any]:
    check_record(RunRecord, data, path, "run.json as train.py writes it (history and config)")
    for i, entry in enumerate(data["history"]):
        check_record(HistoryEntry, entry, f"{path}: history[{i}]", "a start or resume entry")
    return data


def checked_summary(data: Any, path: Path | str) -> dict[str, Any]:
    check_record(RunSummary, data, path, "summary.json as train.py writes it (a status and the run's metrics)")
    return data


def read_run_record(path: Path | str) -> dict[str, Any] | None:
    """run.json, checked; None when there is none. DamagedFile (not JSON, a field) naming the file."""
    data = read_json(path)
    return None if data is None else checked_run_record(data, path)


def read_summary(path: Path | str) -> dict[str, Any] | None:
    """summary.json, checked; None when there is none. DamagedFile (not JSON, a field) naming it."""
    data = read_json(path)
    return None if data is None else checked_summary(data, path)


def checked_export_config(data: Any, path: Path | str) -> dict[str, Any]:
    """An exported folder's config.json ``data`` (read from ``path``), every field checked."""
    check_record(ExportConfig, data, path, "config.json of a quest-export or timm folder (its architecture)")
    if data.get("model_args") is not None:
        check_record(ExportModelArgs, data["model_args"], f"{path}: model_args", "the model and its attention")
    if data.get("quest") is not None:
        check_record(ExportProvenance, data["quest"], f"{path}: quest", "which weights were exported")
        if data["quest"].get("onnx") is not None:
            check_record(ExportOnnx, data["quest"]["onnx"], f"{path}: quest.onnx", "the ONNX file's name")
    size = (data.get("pretrained_cfg") or {}).get("input_size")
    if size is not None and len(size) != 3:
        raise DamagedFile(path, f"pretrained_cfg.input_size is {size!r}, expected [channels, height, width]", joined=": ")
    return data


def is_run(folder: Path) -> bool:
    """Whether ``folder`` holds a training run: run.json beside checkpoints/, metrics.jsonl or .hydra/."""
    return (folder / "run.json").is_file() and any(
        (folder / name).exists() for name in ("checkpoints", "metrics.jsonl", ".hydra"))


def run_holding(path: str | Path) -> Path | None:
    """The run directory ``path`` is, or lies inside, else None: by its path as given and by the path with every link
    followed (a link to another run's checkpoints/ lies inside that run)."""
    for where in (Path(os.path.abspath(path)), Path(os.path.realpath(path))):
        found = next((folder for folder in (where, *where.parents) if is_run(folder)), None)
        if found is not None:
            return found
    return None


def is_run_directory(path: str | Path) -> bool:
    """Whether ``path`` is a training run's own directory (as given, or with every link followed)."""
    return run_holding(path) in (Path(os.path.abspath(path)), Path(os.path.realpath(path)))
