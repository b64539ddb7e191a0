"""Evaluation suites (docs/evaluation.md): ImageNet val / v2 / ReaL / A / R / C, on-the-fly corruptions and
adversarial attacks on any configured data set, run by ``eval.py`` from configs/eval/.

Each evaluation is registered where it is defined (:func:`register_evaluation`; the built-in ones in
``quest/evaluation/suites/``) with the dataclass of its config section; :data:`EVALUATIONS` is the registry by name.
What an evaluation works with: :class:`EvalRun` and the passes of :mod:`quest.evaluation.context`.
"""
from typing import Any

from .cli import rewrite_model_override
from .config import eval_config_schema, eval_settings_schema, register_eval_configs
from .context import (
    Counts,
    EvalRun,
    batches,
    classify,
    error_fraction,
    error_grid,
    evenly_spaced,
    fixed_subset,
    make_loader,
    ordered_topk,
    percent,
    shard_batches,
    sum_over_processes,
)
from .imagenet_data import ImageList
from .inputs import Input, listed
from .registry import EVALUATIONS, Evaluator, evaluators, load_evaluations, register_evaluation, unregister_evaluation
from .runner import run_evaluation, run_evaluations
from .target import EvalTarget, load_target
from .transforms import eval_transform

__all__ = ["EVALUATIONS", "EvalConfig", "EvalSettings", "EvalTarget", "Evaluator", "EvalRun", "Counts", "ImageList",
           "Input", "listed",
           "batches", "classify", "error_fraction", "error_grid", "eval_config_schema", "eval_settings_schema",
           "eval_transform", "evaluators", "evenly_spaced", "fixed_subset", "load_evaluations", "load_target",
           "make_loader", "ordered_topk", "percent", "register_eval_configs", "register_evaluation",
           "rewrite_model_override", "run_evaluation", "run_evaluations", "shard_batches", "sum_over_processes",
           "unregister_evaluation"]


def __getattr__(name: str) -> Any:
    # built from the registry when asked for, so that importing this package imports no evaluation module
    if name in ("EvalConfig", "EvalSettings"):
        from . import config

        return getattr(config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
