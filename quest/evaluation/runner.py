"""Run a suite: load what is evaluated, run the configured evaluations (quest.evaluation.registry) in order, write
the reports."""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from quest.engine.distributed import DistContext, init_distributed
from quest.extras import require_all

from .checks import check_eval_config
from .context import EvalRun
from .registry import EVALUATIONS, evaluators
from .report import format_headline, headline_numbers, log_wandb, write_reports
from .target import EvalTarget, load_target

log = logging.getLogger("quest.eval")

__all__ = ["EVALUATIONS", "run_evaluations", "run_evaluation", "autocast_for"]


def autocast_for(precision: str, device: torch.device) -> Callable[[], Any]:
    dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    if precision not in dtypes:
        raise ValueError(f"eval.precision must be fp32, bf16 or fp16, got {precision!r}")
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("eval.precision=fp16 needs CUDA; use bf16 or fp32 on CPU")
    dtype = dtypes[precision]
    return partial(torch.autocast, device_type=device.type, dtype=dtype) if dtype else nullcontext


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
    """Every evaluation of ``settings.run`` on ``target``, in order; the results by name (on every process).
    ``out_dir``: where evaluations that write files of their own (figures) put them."""
    names = _check_names(settings)
    check_extras(settings, names)
    run = EvalRun(target, ctx, settings, autocast_for(settings.precision, ctx.device),
                  out_dir=Path(out_dir) if out_dir is not None else None)
    registered = evaluators()
    for name in names:
        tic = time.perf_counter()
        log.info("running %s", name)
        result = registered[name].run(run, settings[name])
        result["seconds"] = round(time.perf_counter() - tic, 2)
        run.results[name] = result
        numbers = ", ".join(format_headline(k, v) for k, v in headline_numbers(result).items())
        log.info("%s done in %.1f s: %s", name, result["seconds"], numbers or "no numbers")
    return run.results


def _target_report(target: EvalTarget) -> dict[str, Any]:
    return {**target.info, "num_classes": target.num_classes, "img_size": target.img_size,
            "mean": list(target.mean), "std": list(target.std), "crop_pct": target.crop_pct,
            "interpolation": target.interpolation, "data": target.data.name if target.data is not None else None}


def run_evaluation(cfg: DictConfig, output_dir: str | Path) -> dict[str, Any]:
    """eval.py's body: load, evaluate (one process or a torchrun/srun group), report on the main process."""
    check_eval_config(cfg, EVALUATIONS)  # every key and value, before any data or model is loaded
    settings = cfg.eval
    check_extras(settings, _check_names(settings), [("wandb", "wandb", "logger=wandb")] if cfg.logger.wandb else [])
    if settings.torch_threads:
        torch.set_num_threads(settings.torch_threads)
    ctx = init_distributed(settings.device)
    start = time.perf_counter()
    try:
        target = load_target(cfg, ctx.device)
        results = run_evaluations(target, settings, ctx, output_dir)
        report = {
            "suite": settings.name, "evaluations": list(settings.run), "target": _target_report(target),
            "settings": OmegaConf.to_container(settings, resolve=True), "world_size": ctx.world_size,
            "device": str(ctx.device), "precision": settings.precision,
            "versions": _versions(), "wall_time_s": time.perf_counter() - start, "results": results,
        }
        if ctx.is_main:
            out_dir = Path(output_dir)
            paths = write_reports(out_dir, report)
            report["wandb_run"] = log_wandb(cfg.logger, report, out_dir, target.wandb_group)
            log.info("results in %s", ", ".join(str(p) for p in paths.values()))
        return report
    finally:
        if ctx.distributed and dist.is_initialized():
            dist.destroy_process_group()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for package in ("torch", "timm", "torchmetrics", "imagecorruptions", "pyautoattack", "scikit-image", "numpy"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "not installed"
    return out
