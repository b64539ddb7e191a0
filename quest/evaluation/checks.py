"""eval.py's config checks, run before any data or model is loaded: every key known to the schema (``+key=`` and
``++key=`` included), every value in its allowed range, each problem named with its key, value and what is allowed.
The keys every suite shares are checked here; each evaluation's section by the check it was registered with
(quest.evaluation.kinds), for which :func:`sublist`, :func:`severities` (quest.evaluation.section_checks, importable
from here too) and :class:`quest.config.checks.Checks`'s own checks are the vocabulary.

Hydra's structured config already refuses ``eval.adversarial.pgd.stepz=3`` and wrong types; ``+``/``++`` add keys
past it, and a negative batch size or an unknown precision would only fail (or silently mislead) mid-run.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
from omegaconf import DictConfig

from quest.config.checks import DEVICE_PATTERN, PRECISIONS, Checks, check_known_keys, is_int
from quest.config.wandb_check import check_logger_values

from .config import eval_config_schema
from .registry import evaluators
from .section_checks import severities, sublist

__all__ = ["check_eval_config", "sublist", "severities", "INTERPOLATIONS"]

# the modes timm's eval transform accepts (timm.data.transforms.str_to_interp_mode), 'random' excluded: an eval
# transform must be deterministic
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")


def _value_checks(cfg: DictConfig, evaluations: Iterable[str]) -> Checks:
    checks = Checks(cfg)
    sublist(checks, "eval.run", evaluations, "evaluations")
    checks.positive_int("eval.batch_size")
    checks.check("eval.num_workers", lambda v: is_int(v) and v >= 0, "an integer >= 0")
    checks.positive_int("eval.torch_threads", optional=True)
    checks.check("eval.device", lambda v: bool(DEVICE_PATTERN.match(str(v))), "auto, cpu, cuda or cuda:N")
    checks.one_of("eval.precision", PRECISIONS)
    if cfg.eval.precision == "fp16" and (cfg.eval.device == "cpu"
                                         or (cfg.eval.device == "auto" and not torch.cuda.is_available())):
        checks.fail("eval.precision", f"must be bf16 or fp32 without CUDA (eval.device={cfg.eval.device}): fp16 "
                                      "autocast needs CUDA")
    checks.check("eval.log_every_n", lambda v: is_int(v) and v >= 0, "an integer >= 0 (0: off)")
    checks.check("eval.log_every_s", lambda v: v >= 0, ">= 0 seconds (0: off)")
    checks.fraction("eval.crop_pct", low_open=True, optional=True)
    checks.one_of("eval.interpolation", INTERPOLATIONS, optional=True)
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
