"""Evaluation suites (docs/evaluation.md): ImageNet val / v2 / ReaL / A / R / C, on-the-fly corruptions and
adversarial attacks on any configured data set, run by ``eval.py`` from configs/eval/.

Each evaluation is registered where it is defined (:func:`register_evaluation`; the built-in ones in
``quest/evaluation/suites/``) with the dataclass of its config section; :data:`EVALUATIONS` is the registry by name.
What an evaluation works with: :class:`EvalRun` and the passes of :mod:`quest.evaluation.context`.
"""
from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it, imported when the name is first asked for: the modules of the passes import
# torch, which quest-eval's --help and tab completion must not pay for
_WHERE = {
    "rewrite_model_override": "cli",
    "eval_config_schema": "config", "eval_settings_schema": "config", "register_eval_configs": "config",
    "EvalConfig": "config", "EvalSettings": "config",
    **dict.fromkeys(["Counts", "EvalRun", "batches", "classify", "error_fraction", "error_grid", "evenly_spaced",
                     "fixed_subset", "make_loader", "ordered_topk", "percent", "shard_batches", "sum_over_processes"],
                    "context"),
    "ImageList": "imagenet_data", "Input": "inputs", "listed": "inputs",
    **dict.fromkeys(["Evaluator", "register_evaluation", "unregister_evaluation"], "kinds"),
    **dict.fromkeys(["EVALUATIONS", "evaluators", "load_evaluations"], "registry"),
    "run_evaluation": "runner", "run_evaluations": "runner",
    "EvalTarget": "target", "load_target": "target", "eval_transform": "transforms",
}

__all__ = ["EVALUATIONS", "EvalConfig", "EvalSettings", "EvalTarget", "Evaluator", "EvalRun", "Counts", "ImageList",
           "Input", "listed",
           "batches", "classify", "error_fraction", "error_grid", "eval_config_schema", "eval_settings_schema",
           "eval_transform", "evaluators", "evenly_spaced", "fixed_subset", "load_evaluations", "load_target",
           "make_loader", "ordered_topk", "percent", "register_eval_configs", "register_evaluation",
           "rewrite_model_override", "run_evaluation", "run_evaluations", "shard_batches", "sum_over_processes",
           "unregister_evaluation"]


def __getattr__(name: str) -> Any:
    # EvalConfig / EvalSettings are built from the registry when asked for: importing this package imports no
    # evaluation module
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_WHERE))
