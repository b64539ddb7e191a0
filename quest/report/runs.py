"""Loading run directories for the reports: a run is a directory with ``summary.json`` (written by
quest.train.fit), ``run.json`` (its config; older runs: ``.hydra/config.yaml``, written by Hydra for
``python train.py``) and ``eval/<suite>/<checkpoint stem>-<model|ema>/eval_results.json`` (written by ``eval.py``).
"""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from quest.store.damage import DamagedFile
from quest.store.files import OutsideFolder, inside_folder, parse_json
from quest.store.results_file import checked_results
from quest.store.run_files import checked_run_record, checked_summary

log = logging.getLogger("quest.report")

__all__ = ["ReportInputError", "RunLeftOut", "Runs", "RunResult", "load_runs", "flatten", "number"]


class ReportInputError(ValueError):
    """Input that cannot be reported on; the message names the path or option and what was expected."""


class RunLeftOut(ReportInputError):
    """A run the report notes and leaves out (a config value of the wrong type for its key, a summary.json that is
    not a file): the message names the file and the key."""


class Runs(list):
    """The runs :func:`load_runs` found, and ``left_out``: one line per run noted and left out, naming its file and
    why (shown under the report's tables)."""

    def __init__(self, runs: Sequence["RunResult"] = (), left_out: Sequence[str] = ()):
        super().__init__(runs)
        self.left_out = list(left_out)


#: the telemetry shown beside the accuracy (summary.json's ``perf``: time-weighted means, the memory's maximum)
PERF_METRICS = {"perf/img_per_s_per_device": "img_per_s_per_device_mean", "perf/data_wait": "data_wait_mean",
                "perf/peak_mem_gib": "peak_mem_gib_max", "perf/mfu": "mfu_mean"}


# --- loading ----------------------------------------------------------------------------------------------------
@dataclass
class RunResult:
    """One run directory: status completed | stopped | diverged | incomplete (no summary.json yet)."""

    path: Path
    status: str
    summary: dict[str, Any]  # summary.json, nested dicts flattened to dotted keys ("choices.model")
    config: dict[str, Any] | None  # run.json's config (or .hydra/config.yaml), resolved and flattened; None without
    metrics: dict[str, float]  # numbers of summary.json and of eval/<suite>/<stem>-<weights>/eval_results.json
    #: per evaluation column prefix ("imagenet_v2", "clean_ema"): what its numbers depend on besides the weights (the
    #: settings, the input transform, the data by content), so that runs pool an evaluation only where it agrees
    evaluations: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: evaluations under the run that are not of its current weights, each with why (left out of its numbers)
    older: list[str] = field(default_factory=list)

    def value(self, key: str) -> Any:
        """A setting: ``attention`` / ``model`` (the formulation and timm name), else a config key, else a summary
        field."""
        if key in ("attention", "model"):
            if isinstance(self.summary.get(key), str):
                return self.summary[key]
            return (self.config or {}).get(f"{key}.name")
        if self.config is not None and key in self.config:
            return self.config[key]
        return self.summary.get(key)

    @property
    def lr(self) -> float | None:
        lr = self.summary.get("lr")  # the lr the run actually used (base_lr already scaled by the batch)
        lr = lr if lr is not None else (self.config or {}).get("recipe.lr")
        return float(lr) if isinstance(lr, (int, float)) else None


def flatten(tree: Any, prefix: str = "", sep: str = ".") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for key, value in tree.items():
            out.update(flatten(value, f"{prefix}{sep}{key}" if prefix else str(key), sep))
        return out
    return {prefix: tuple(tree) if isinstance(tree, list) else tree}


def number(value: Any) -> float | None:
    """JSON numbers, and the strings 'nan' / 'inf' that the writers use for non-finite values; not booleans."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.strip().lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value)
    return None


def _read_json(path: Path, what: str, check: Any = None) -> dict[str, Any]:
    """A JSON object of a run directory, every field checked by ``check`` (quest.store.run_files) when given."""
    try:
        data = parse_json(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ReportInputError(f"{path}: cannot read {what} ({err})") from None
    if not isinstance(data, dict):
        raise ReportInputError(f"{path}: expected a JSON object ({what}), got {type(data).__name__}")
    if check is not None:
        try:
            check(data, path)
        except DamagedFile as exc:
            raise ReportInputError(str(exc)) from None
    return data


def _own(run_dir: Path, path: Path) -> Path:
    """``path``, a file of ``run_dir``, when it is the run's own (quest.store.files.inside_folder): a link to another run's
    file is refused, never counted as this run's."""
    try:
        return inside_folder(path, run_dir)
    except OutsideFolder as exc:
        raise ReportInputError(str(exc)) from None


def _read_config(run_dir: Path) -> dict[str, Any] | None:
    """The run's own record of its config (run.json, written by quest.train.fit), else Hydra's copy of the latest
    command's config for runs written before run.json existed."""
    record = _own(run_dir, run_dir / "run.json")
    if record.is_file():
        config = _read_json(record, "the run record written by train.py", checked_run_record).get("config")
        if isinstance(config, dict):
            _check_config(config, record)
            return flatten(config)
    path = _own(run_dir, run_dir / ".hydra" / "config.yaml")
    if not path.is_file():
        return None
    import yaml
    from omegaconf import OmegaConf

    try:
        cfg = OmegaConf.load(path)
    except (OSError, ValueError, yaml.YAMLError) as exc:  # cut short, not YAML, unreadable
        raise ReportInputError(f"{path}: cannot read the run's config written by Hydra ({exc})") from None
    if not OmegaConf.is_dict(cfg):
        raise ReportInputError(f"{path}: holds a {type(cfg).__name__}, expected the run's config (a mapping)")
    try:
        tree = OmegaConf.to_container(cfg, resolve=True)
    except Exception:  # an interpolation that needs Hydra's runtime: compare the unresolved text instead
        tree = OmegaConf.to_container(cfg, resolve=False)
    return flatten(tree)


def _check_config(config: dict[str, Any], path: Path) -> None:
    """Refuse (:class:`RunLeftOut`) a config whose value has the wrong type or range for its key as
    quest.config.schema declares it (``recipe.lr`` the string "0.002", or nan): the report would group by a value the
    run never trained with."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from quest.config.checks import declared_problems
    from quest.config.schema import TrainConfig

    try:
        problems = declared_problems(OmegaConf.create(config), TrainConfig)
    except (OmegaConfBaseException, ValueError, TypeError) as exc:  # a value OmegaConf cannot hold
        raise RunLeftOut(f"{path}: config: cannot be read as a config ({exc})") from None
    if problems:
        raise RunLeftOut(f"{path}: config.{problems[0].strip()}")


def _eval_suffix(target: dict[str, Any]) -> str:
    """How an evaluation's columns say which weights were evaluated: nothing for last.pt's model weights (the
    headline, as DeiT reports), ``_ema`` for the EMA weights (like val_ema/), ``@<stem>`` for another checkpoint."""
    suffix = "_ema" if target.get("weights") == "ema" else ""
    checkpoint = target.get("checkpoint")
    if isinstance(checkpoint, str) and Path(checkpoint).stem != "last":
        suffix += f"@{Path(checkpoint).stem}"
    return suffix


#: what identifies the weights in an evaluation's fingerprint: the run's own, not a setting of the evaluation
_WEIGHTS_KEYS = ("source", "checkpoint_sha256", "weights", "weights_sha256", "model", "attention",
                 "attention_options", "num_classes")


def _not_current(target: dict[str, Any], summary: dict[str, Any]) -> str | None:
    """Why an evaluation of the run's ``last.pt`` or ``best.pt`` is not of the weights the run holds now (a resumed
    run trained on after it; a later epoch became the best), None when it is or cannot be told."""
    if target.get("source") != "checkpoint":
        return None
    stem = Path(str(target.get("checkpoint_file") or target.get("checkpoint") or "")).stem
    step, epoch = target.get("train_step"), target.get("train_epoch")
    if stem == "last":
        found = re.search(r"\(step (\d+)\)$", str(summary.get("checkpoint") or ""))
        now = int(found[1]) if found else None
        if now is not None and isinstance(step, int) and step != now:
            return f"it evaluated last.pt at step {step}, and the run's last.pt now holds step {now}"
    if stem == "best":
        best = summary.get("best_epoch")
        if isinstance(best, int) and best >= 0 and isinstance(epoch, int) and epoch != best:
            return f"it evaluated best.pt of epoch {epoch}, and the run's best epoch is now {best}"
    return None


#: what a run's records say of the run itself, and where its config holds the same: a summary or an evaluation of
#: another run (a copied file) names another attention, model or seed
_OWN_KEYS = {"attention": "attention.name", "model": "model.name", "seed": "trainer.seed"}


def _another_run(record: dict[str, Any], config: dict[str, Any] | None) -> str | None:
    """How ``record`` (a summary, an evaluation's target) shows it is of another run than the one ``config`` (the
    run's flattened config) describes, else None (nothing to compare: an older record, or no config)."""
    for key, where in _OWN_KEYS.items():
        said, own = record.get(key), (config or {}).get(where)
        if said is not None and own is not None and said != own:
            return f"it names {key} {said!r}, and the run's config {own!r}"
    return None


def _eval_setting(report: dict[str, Any], evaluation: str) -> dict[str, Any]:
    """What ``evaluation``'s numbers in ``report`` depend on besides the weights: the settings shared by the suite and
    its own section, the input transform, and the data it read, by content where the record knows it (a data set
    moved to another path is the same data), else by path."""
    fp = report.get("fingerprint") if isinstance(report.get("fingerprint"), dict) else {}
    settings = fp.get("settings") if isinstance(fp.get("settings"), dict) else {}
    # the batch size aside: a model in eval mode scores each image on its own (as the training report's
    # data.eval_batch_size: quest.report.settings)
    shared = {k: v for k, v in settings.items() if not isinstance(v, dict) and k != "batch_size"}
    evaluated = fp.get("evaluated") if isinstance(fp.get("evaluated"), dict) else {}
    transform = {k: v for k, v in evaluated.items() if k not in _WEIGHTS_KEYS}
    known = report.get("data") if isinstance(report.get("data"), dict) else {}
    data = {}
    for key, path in (report.get("inputs") or {}).items():
        identity = known.get(key) if isinstance(known.get(key), dict) else {}
        data[key] = identity if identity.get("files_sha256") else {**identity, "path": path}
    if isinstance(transform.get("data_config"), dict) and all(d.get("files_sha256") for d in data.values()):
        transform["data_config"] = {k: v for k, v in transform["data_config"].items() if k != "root"}
    return flatten({"eval": {**shared, evaluation: settings.get(evaluation)}, "input": transform, "data": data})


def _eval_metrics(run_dir: Path, summary: dict[str, Any] | None = None, config: dict[str, Any] | None = None
                  ) -> tuple[dict[str, float], dict[str, dict[str, Any]], list[str]]:
    """Numbers of every <run>/eval/<suite>/<stem>-<model|ema>/eval_results.json (and the older
    <run>/eval/<suite>/eval_results.json) as '<evaluation><suffix>/<path>' (e.g. 'imagenet_c/mce',
    'imagenet_v2_ema/top1'), each evaluation's setting (:func:`_eval_setting`), and the evaluations left out because
    they are not of the run's current weights (:func:`_not_current`), each with why; an evaluation present in two
    suites takes the more recently written file."""
    files = sorted({_own(run_dir, p) for p in (*run_dir.glob("eval/*/eval_results.json"),
                                               *run_dir.glob("eval/*/*/eval_results.json"))},
                   key=lambda p: p.stat().st_mtime)
    out: dict[str, float] = {}
    settings: dict[str, dict[str, Any]] = {}
    older: list[str] = []
    for path in files:
        try:  # every field checked; an older quest's upgraded (quest.store.compat)
            report = checked_results(_read_json(path, "evaluation results"), path)
        except DamagedFile as exc:
            raise ReportInputError(str(exc)) from None
        if report["status"] == "running":  # in progress, or killed: not results yet (see docs/evaluation.md)
            log.warning("%s: an evaluation in progress or interrupted (status running); left out", path.parent)
            continue
        results = report.get("results")
        if not isinstance(results, dict):
            raise ReportInputError(f"{path}: no 'results' object (expected eval.py's eval_results.json)")
        target = report.get("target") if isinstance(report.get("target"), dict) else {}
        other = _another_run(target, config)
        why = f"it evaluated another run's weights ({other})" if other else _not_current(target, summary or {})
        if why is not None:
            older.append(f"{path.parent.relative_to(run_dir)}: {why}")
            log.warning("%s: left out of the report: %s (evaluate the run's checkpoint again)", path.parent, why)
            continue
        suffix = _eval_suffix(target)
        for evaluation, result in results.items():
            settings[f"{evaluation}{suffix}"] = _eval_setting(report, evaluation)
            for key, value in flatten({f"{evaluation}{suffix}": result}, sep="/").items():
                value = number(value)
                if value is not None:
                    out[key] = value
    return out, settings, older


def _load_run(run_dir: Path) -> RunResult:
    summary_path = _own(run_dir, run_dir / "summary.json")
    _own(run_dir, run_dir / "metrics.jsonl")  # it tells an unfinished run: the run's own, as the others
    config = _read_config(run_dir)
    if summary_path.exists() and not summary_path.is_file():
        kind = "a directory" if summary_path.is_dir() else "not a regular file"
        raise RunLeftOut(f"{summary_path}: is {kind}, expected the run summary file written by train.py")
    if not summary_path.is_file():
        return RunResult(run_dir, "incomplete", {}, config, {})
    raw = _read_json(summary_path, "the run summary written by train.py", checked_summary)
    other = _another_run(raw, config)
    if other is not None:  # a copied or damaged file: its numbers would be credited to the run the config describes
        source = "run.json" if (run_dir / "run.json").is_file() else ".hydra/config.yaml"
        raise ReportInputError(f"{summary_path}: {other} ({run_dir / source}): one of them is another run's, or "
                               "damaged; move the wrong one away")
    status = raw.get("status")
    if status in ("interrupted", "requeued"):  # saved by a signal and not finished: like a run still going
        return RunResult(run_dir, "incomplete", {}, config, {})
    if status not in ("completed", "stopped", "diverged"):
        raise ReportInputError(f"{summary_path}: status {status!r}, expected completed, stopped, diverged, "
                               "interrupted or requeued")
    metrics = {k: n for k, v in raw.items() if not isinstance(v, dict) and (n := number(v)) is not None}
    perf = raw.get("perf") if isinstance(raw.get("perf"), dict) else {}
    metrics.update({name: n for name, key in PERF_METRICS.items() if (n := number(perf.get(key))) is not None})
    evaluated, settings, older = _eval_metrics(run_dir, raw, config)
    metrics.update(evaluated)
    return RunResult(run_dir, status, flatten(raw), config, metrics, settings, older)


def _run_files(sweep: Path, name: str) -> list[Path]:
    """``name`` files of the runs under ``sweep``, not those under hidden directories (a replaced run's archive in
    <run>/.replaced/, submitit's logs). A directory removed while this walks is passed over (os.walk ignores it;
    Path.rglob raised FileNotFoundError)."""
    found = []
    seen: set[str] = set()  # folders reached, by their real path: a link back up is walked once
    for folder, subdirs, files in os.walk(sweep, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            subdirs[:] = []
            continue
        seen.add(real)
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and d != name)
        if name in files or (Path(folder) / name).is_dir():  # a folder of the name: noted, never passed over
            found.append(Path(folder) / name)
    return found


def _load_or_skip(run_dir: Path) -> RunResult | None:
    """:func:`_load_run`; read once more when a file changed under it (a continued run moves its final summary.json
    aside), or None with a warning when the run directory disappeared while it was read (removed or moved by
    another process: nothing left to report)."""
    for attempt in (1, 2):
        try:
            run = _load_run(run_dir)
            if run_dir.is_dir():
                return run
            err: Exception = FileNotFoundError(f"{run_dir} no longer exists")
        except (OSError, ReportInputError) as exc:
            err = exc
        if not run_dir.is_dir():
            log.warning("%s: skipped, the run directory disappeared while it was read (%s)", run_dir, err)
            return None
        if attempt == 2:
            if isinstance(err, ReportInputError):
                raise err
            raise ReportInputError(f"{run_dir}: cannot read ({err})") from err
    return None


def load_runs(sweep_dirs: Sequence[str | Path]) -> Runs:
    """Every run under the sweep directories (recursively, a linked run directory followed): each directory with
    summary.json, and each with metrics.jsonl but no summary.json yet (incomplete: running, or killed before the end).
    A run whose files the report cannot believe as its setting (:class:`RunLeftOut`) is noted in ``left_out`` and
    left out, with a warning."""
    if not sweep_dirs:
        raise ReportInputError("no sweep directories given")
    runs: dict[Path, RunResult] = {}
    left_out: list[str] = []
    for sweep in map(Path, sweep_dirs):
        expected = "a sweep directory holding run directories written by train.py, each with summary.json"
        if not sweep.is_dir():
            raise ReportInputError(f"{sweep}: {'not a directory' if sweep.exists() else 'does not exist'} "
                                   f"(expected {expected})")
        finished = {p.parent for p in _run_files(sweep, "summary.json")}
        unfinished = {p.parent for p in _run_files(sweep, "metrics.jsonl")} - finished
        if not finished:
            more = f"; {len(unfinished)} run directories have metrics.jsonl but no summary.json yet" \
                if unfinished else ""
            raise ReportInputError(f"{sweep}: no summary.json under it (expected {expected}){more}")
        for run_dir in sorted(finished | unfinished):
            if run_dir.resolve() not in runs:  # overlapping arguments: each run once
                try:
                    run = _load_or_skip(run_dir)
                except RunLeftOut as exc:
                    log.warning("%s; the run is left out of the report", exc)
                    left_out.append(str(exc))
                    continue
                if run is not None:
                    runs[run_dir.resolve()] = run
    return Runs(runs.values(), left_out)


