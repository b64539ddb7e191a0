"""eval.py's config checks, run before any data or model is loaded: every key known to the schema (``+key=`` and
``++key=`` included), every value in its allowed range, each problem named with its key, value and what is allowed.
Every value against what its schema field declares (quest.evaluation.settings and each evaluation's section dataclass;
quest.config.checks.declared_problems); then what a declaration cannot state: eval.run against the registry, fp16
without CUDA, the logger's wandb values, and each evaluation's relations between its keys, by the check it was
registered with (quest.evaluation.kinds), for which :func:`sublist` (quest.evaluation.section_checks, importable from
here too) and :class:`quest.config.checks.Checks` are the vocabulary.

Hydra's structured config already refuses ``eval.adversarial.pgd.stepz=3`` and wrong types; ``+``/``++`` add keys
past it, and a negative batch size or an unknown precision would only fail (or silently mislead) mid-run.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from omegaconf import DictConfig

from quest.config.checks import Checks, check_known_keys
from quest.config.wandb_check import check_logger_values

from .config import eval_config_schema
from .registry import evaluators
from .section_checks import sublist
from .settings import INTERPOLATIONS

__all__ = ["check_eval_config", "sublist", "INTERPOLATIONS"]


def _value_checks(cfg: DictConfig, evaluations: Iterable[str]) -> Checks:
    checks = Checks(cfg)
    sublist(checks, "eval.run", evaluations, "evaluations")
    checks.declared(eval_config_schema())  # every value against its field's declaration, each section's included
    if cfg.eval.precision == "fp16" and (cfg.eval.device == "cpu"
                                         or (cfg.eval.device == "auto" and not torch.cuda.is_available())):
        checks.fail("eval.precision", f"must be bf16 or fp32 without CUDA (eval.device={cfg.eval.device}): fp16 "
                                      "autocast needs CUDA")
    check_logger_values(checks)

    # each evaluation's own section, whether this suite runs it or not (a suite file may set any of them)
    for name, evaluator in evaluators().items():
        if evaluator.check is not None and name in cfg.eval:
            evaluator.check(checks, f"eval.{name}")
    return checks


def check_eval_config(cfg: DictConfig, evaluations: Iterable[str]) -> None:
    """Refuse unknown keys, then every bad value at once (:class:`quest.config.checks.ConfigError`, a ValueError)."""
    check_known_keys(cfg, eval_config_schema())
    _value_checks(cfg, evaluations).raise_if_any("eval")
