"""Run a suite: load what is evaluated, run the configured evaluations (quest.evaluation.registry) in order, write
the reports."""
from __future__ import annotations

import datetime as _dt
import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from quest.attention.fused_check import configure as configure_fused
from quest.attention.fused_check import record as fused_record
from quest.config.checks import ConfigError
from quest.config.wandb_check import check_wandb_credentials
from quest.data.registry import training_only_data_keys
from quest.run.outputs import start_log_file, stop_log_file
from quest.runtime.distributed import DistContext, init_distributed
from quest.runtime.errors import describe, every_rank, is_user_error
from quest.runtime.extras import require_all
from quest.runtime.phase import begin_changes, command_phases
from quest.store.files import plain
from quest.store.run_files import is_run_directory
from quest.train.compute import autocast_for

from .checks import check_eval_config
from .context import EvalRun
from .directory import COMPLETE, PARTIAL, RUNNING, EvalDirectory, EvalDirectoryError, fingerprint, fingerprint_key
from .inputs import data_identity
from .registry import EVALUATIONS, evaluators
from .report import format_headline, headline_numbers, log_wandb, write_reports
from .target import EvalTarget, input_size_problem, load_target

log = logging.getLogger("quest.eval")

__all__ = ["EVALUATIONS", "run_evaluations", "run_evaluation", "eval_autocast", "check_inputs",
           "check_ignored_overrides"]


def eval_autocast(precision: str, device: torch.device) -> Callable[[], Any]:
    """eval.precision's autocast; fp16 only on CUDA (on the CPU it is slow and untested for evaluation)."""
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("eval.precision=fp16 needs CUDA; use bf16 or fp32 on CPU")
    return autocast_for(precision, device)


def _check_names(settings: Any) -> list[str]:
    names = list(settings.run)
    unknown = [n for n in names if n not in EVALUATIONS]
    if unknown:
        raise ValueError(f"eval.run names unknown evaluations {unknown}; known: {sorted(EVALUATIONS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"eval.run lists an evaluation twice: {names}")
    unstored = [n for n in names if n not in settings]
    if unstored:
        raise ValueError(f"eval has no section for {unstored}: they were registered after the config schema was "
                         "stored; import their modules before register_eval_configs() (or call it again)")
    return names


def check_extras(settings: Any, names: list[str], also: list[tuple[str, str, str]] | None = None) -> None:
    """Every optional package the evaluations ``names`` import, installed, or one MissingExtra naming each and the
    extras that install them (before any evaluation runs: a missing one must not cost the results before it)."""
    registered = evaluators()
    needs = [need for name in names for need in registered[name].needs(settings[name])] + list(also or [])
    require_all(needs, f"eval={settings.name}")


def run_evaluations(target: EvalTarget, settings: Any, ctx: DistContext,
                    out_dir: str | Path | None = None) -> dict[str, dict[str, Any]]:
    """Every evaluation of ``settings.run`` on ``target``, in order, after every data root they read was checked;
    the results by name (on every process). ``out_dir``: where evaluations that write files of their own (figures)
    put them."""
    names = _check_names(settings)
    check_extras(settings, names)
    run = EvalRun(target, ctx, settings, eval_autocast(settings.precision, ctx.device),
                  out_dir=Path(out_dir) if out_dir is not None else None)
    check_inputs(run, names)
    for name in names:
        _run_one(run, name)
    return run.results


def _run_one(run: EvalRun, name: str) -> None:
    tic = time.perf_counter()
    log.info("running %s", name)
    result = evaluators()[name].run(run, run.settings[name])
    result["seconds"] = round(time.perf_counter() - tic, 2)
    run.results[name] = result
    numbers = ", ".join(format_headline(k, v) for k, v in headline_numbers(result).items())
    log.info("%s done in %.1f s: %s", name, result["seconds"], numbers or "no numbers")


def check_inputs(run: EvalRun, names: list[str], identities: dict[str, Any] | None = None) -> dict[str, str]:
    """Every data root the evaluations ``names`` read (setting -> path), each checked (layout, images, permissions)
    before the first evaluation runs; an evaluation registered without ``inputs`` declares none. ``identities``:
    filled with each root's data by content (setting -> quest.evaluation.inputs.data_identity), for the record."""
    found: dict[str, str] = {}
    for name in names:
        declare = evaluators()[name].inputs
        for item in declare(run, run.settings[name]) if declare is not None else []:
            listing = item.check()  # every one: two evaluations may read one root differently (val, ReaL's files)
            if item.key not in found and identities is not None:
                identities[item.key] = data_identity(listing, item.path)
            found.setdefault(item.key, item.path)
    return found


def _target_report(target: EvalTarget) -> dict[str, Any]:
    data = OmegaConf.to_container(target.data, resolve=True) if target.data is not None else None
    return {**target.info, "num_classes": target.num_classes, "img_size": target.img_size,
            "mean": list(target.mean), "std": list(target.std), "crop_pct": target.crop_pct,
            "interpolation": target.interpolation, "data": target.data.name if target.data is not None else None,
            # the keys that change the numbers: not those of training only (the evaluation reads the val split with
            # eval.batch_size and eval.num_workers)
            "data_config": {k: v for k, v in (data or {}).items() if k not in training_only_data_keys()} or None}


def _decide(decide: Callable[[], Any], ctx: DistContext) -> Any:
    """The main process decides what the directory allows (it alone archives and writes); the others follow: its
    refusal is raised on every process, printed once (quest.runtime.errors, ``every_rank``)."""
    outcome: list[Any] = [None]
    if ctx.is_main:
        try:
            outcome[0] = ("ok", decide())
        except EvalDirectoryError as exc:
            outcome[0] = ("refused", str(exc))
    if ctx.distributed:
        dist.broadcast_object_list(outcome, src=0)
    if outcome[0][0] == "refused":
        raise every_rank(EvalDirectoryError(outcome[0][1]))
    return outcome[0][1]


def run_evaluation(cfg: DictConfig, output_dir: str | Path, overrides: list[str] | None = None) -> dict[str, Any]:
    """eval.py's body: check, load, evaluate (one process or a torchrun/srun group), report on the main process.
    ``overrides``: the command line's, recorded and checked for keys this suite would ignore.

    Every check that can refuse runs before the first evaluation: config values, what is evaluated, every data root
    read, command-line keys that would be ignored, and the results directory (quest.evaluation.directory), which is
    marked ``running`` until every result is in and ``partial`` when an evaluation fails. Nothing is written before
    the results directory is claimed (quest.runtime.phase)."""
    with command_phases("run_evaluation"):  # called by quest-eval: its phases; called as a library: its own
        return _run_evaluation(cfg, output_dir, overrides)


def _run_evaluation(cfg: DictConfig, output_dir: str | Path, overrides: list[str] | None) -> dict[str, Any]:
    check_eval_config(cfg, EVALUATIONS)  # every key and value, before any data or model is loaded
    if is_run_directory(output_dir):  # its .hydra/ and wandb/ are the run's
        raise EvalDirectoryError(f"the results directory {output_dir} is a training run's directory: an evaluation "
                                 "writes its own record (.hydra/, eval.log, eval_results.*) and would replace the "
                                 "run's; leave hydra.run.dir unset (results go to <run>/eval/<suite>/<which>/) or "
                                 "give another directory")
    settings = cfg.eval
    names = _check_names(settings)
    check_extras(settings, names, [("wandb", "wandb", "logger=wandb")] if cfg.logger.wandb else [])
    check_wandb_credentials(cfg.logger)  # an online wandb run: credentials found without connecting
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    ctx = init_distributed(settings.device)
    # attention.fused as in training: on checks the kernels on this device here, before the results directory
    configure_fused(cfg.attention.get("fused", "auto"), ctx.device)
    start = time.perf_counter()
    directory = EvalDirectory(output_dir, ctx.is_main)
    handler = None
    try:
        # the lock and the results file, before the model and the data load: a second evaluation into this
        # directory is refused at once, naming the holder
        _decide(lambda: directory.open(settings.overwrite), ctx)
        target = load_target(cfg, ctx.device)
        run = EvalRun(target, ctx, settings, eval_autocast(settings.precision, ctx.device), out_dir=Path(output_dir))
        identities: dict[str, Any] = {}
        inputs = check_inputs(run, names, identities)
        check_ignored_overrides(overrides or [], names, inputs, target.img_size)
        resolved = OmegaConf.to_container(settings, resolve=True)
        report: dict[str, Any] = {
            "suite": settings.name, "evaluations": names, "status": RUNNING, "target": _target_report(target),
            "inputs": inputs, "data": identities, "settings": resolved,
            "command": list(overrides) if overrides is not None else None,
            "world_size": ctx.world_size, "device": str(ctx.device), "precision": settings.precision,
            "versions": _versions(), "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        }
        report["fingerprint"] = fp = fingerprint(resolved, plain(report["target"]), inputs)
        report["key"] = fingerprint_key(fp)
        action, stored = _decide(lambda: directory.begin(fp, settings.overwrite), ctx)
        if action != "done":
            begin_changes()  # the main process claimed the directory in begin(); the other ranks' changes begin too
        if action == "done":
            log.info("%s already holds these results (complete, same checkpoint, settings and data); nothing to do "
                     "(eval.overwrite=true evaluates again, archiving them first)", output_dir)
            return {**stored, "already_complete": True}
        handler = start_log_file(Path(output_dir) / "eval.log") if ctx.is_main else None  # every check passed
        run.results.update(stored)  # finished by an interrupted or failed attempt with the same key: reused
        if stored:
            log.info("reusing %s from the earlier attempt in %s (same key %s)", ", ".join(stored), output_dir,
                     report["key"])
        _save(directory, report, run, start, ctx)
        for name in names:
            if name in run.results:
                continue
            try:
                _run_one(run, name)
            except BaseException as exc:
                report.update(status=PARTIAL, error={"evaluation": name, "message": f"{type(exc).__name__}: {exc}"})
                _save(directory, report, run, start, ctx)
                raise
            _save(directory, report, run, start, ctx)
        report["status"] = COMPLETE
        paths = _save(directory, report, run, start, ctx)
        if ctx.is_main:
            report["wandb_run"] = log_wandb(cfg.logger, report, Path(output_dir), target.wandb_group)
            figures = [Path(output_dir) / n for n in ("explain.png", "explain_maps.pt") if (Path(output_dir) / n).is_file()]
            log.info("results in %s", ", ".join(str(p) for p in [*paths.values(), *figures]))
        return report
    except Exception as exc:
        if handler is not None and is_user_error(exc):  # eval.log keeps why it ended; the console has the error line
            handler.handle(logging.LogRecord(log.name, logging.ERROR, __file__, 0, "%s", (describe(exc),), None))
        raise
    finally:
        stop_log_file(handler)
        directory.unlock()
        if ctx.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _save(directory: EvalDirectory, report: dict[str, Any], run: EvalRun, start: float,
          ctx: DistContext) -> dict[str, Path]:
    """The report so far (its status, the finished results), on the main process."""
    report.update(results={n: r for n, r in run.results.items() if n in report["evaluations"]},
                  wall_time_s=time.perf_counter() - start, attention_kernels=fused_record())
    return write_reports(directory.path, report) if ctx.is_main else {}


def check_ignored_overrides(overrides: list[str], names: list[str], inputs: dict[str, str],
                            model_size: int | None = None) -> None:
    """Command-line keys the evaluation would not read are refused, naming what it reads instead:
    ``eval.roots.<r>`` of a root no evaluation of the suite reads, ``eval.<evaluation>.*`` of an evaluation the
    suite does not run, a ``data.*`` key that changes only training (TRAINING_ONLY), and ``data.img_size`` other than
    the model's input size ``model_size`` (quest.evaluation.target.input_size_problem)."""
    problems = []
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        parts = key.split(".")
        if parts[0] == "data" and len(parts) == 2 and parts[1] in training_only_data_keys():
            problems.append(f"  {override}: changes only how training reads its data; an evaluation reads the val "
                            "split, with eval.batch_size and eval.num_workers")
        elif key == "data.img_size" and model_size is not None and value not in ("", "null"):
            problem = input_size_problem(key, value, model_size) if value.isdigit() else None
            if problem:
                problems.append(f"  {problem}")
        if parts[0] != "eval" or len(parts) < 2:
            continue
        if parts[1] == "roots" and len(parts) > 2 and key not in inputs:
            problems.append(f"  {override}: no evaluation of eval.run={names} reads {key} (they read: "
                            f"{', '.join(sorted(inputs)) or 'no data root'})")
        elif parts[1] in evaluators() and parts[1] not in names:
            problems.append(f"  {override}: eval.run={names} does not run {parts[1]}, so its settings would be "
                            f"ignored; add it to eval.run or choose its suite (eval=...)")
    if problems:
        raise ConfigError("these command-line settings would be ignored:\n" + "\n".join(problems))


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("torch", "timm", "torchmetrics", "imagecorruptions", "pyautoattack", "scikit-image", "numpy"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    return out
