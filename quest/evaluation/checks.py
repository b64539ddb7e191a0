"""eval.py's config checks, run before any data or model is loaded: every key known to the schema (``+key=`` and
``++key=`` included), every value in its allowed range, each problem named with its key, value and what is allowed.

Hydra's structured config already refuses ``eval.adversarial.pgd.stepz=3`` and wrong types; ``+``/``++`` add keys
past it, and a negative batch size or an unknown precision would only fail (or silently mislead) mid-run.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from omegaconf import DictConfig

from quest.attention.elliptical import ESTIMATORS
from quest.validation import Checks, check_known_keys

from .attack_space import SPACES
from .config import IMAGENET_C_CORRUPTIONS, IMAGENET_C_EXTRA, EvalConfig
from .spsa import ESTIMATE_AT as SPSA_ESTIMATE_AT

__all__ = ["check_eval_config", "ATTACKS", "LABELS", "SPACES", "ADVERSARIAL_SECTIONS", "PRECISIONS", "INTERPOLATIONS",
           "V2_VARIANTS"]

ATTACKS = ("fgsm", "pgd", "spsa", "autoattack")
# paper: the model's predictions for FGSM, PGD and SPSA, the data set's labels for AutoAttack (the authors' code)
LABELS = ("ground_truth", "predicted", "paper")
# the evaluations that take an AdversarialConfig section (eval.adversarial, eval.adversarial_paper)
ADVERSARIAL_SECTIONS = ("adversarial", "adversarial_paper")
ADVERSARIAL_SOURCES = ("data", "imagenet_val")
PRECISIONS = ("fp32", "bf16", "fp16")
# the modes timm's eval transform accepts (timm.data.transforms.str_to_interp_mode), 'random' excluded: an eval
# transform must be deterministic
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")
V2_VARIANTS = ("matched-frequency", "threshold0.7", "top-images")
# pyautoattack's versions; 'custom' needs an attack list this config does not expose
AUTOATTACK_VERSIONS = ("standard", "plus", "rand")
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _sublist(checks: Checks, key: str, allowed: Iterable[Any], what: str) -> None:
    """A list of distinct entries, each one of ``allowed``."""
    allowed = list(allowed)
    checks.check(key, lambda v: all(x in allowed for x in v) and len(set(v)) == len(v),
                 f"a list of distinct {what} from {', '.join(map(str, allowed))}")


def _severities(checks: Checks, key: str) -> None:
    checks.check(key, lambda v: all(_is_int(s) and 1 <= s <= 5 for s in v) and len(set(v)) == len(v),
                 "a list of distinct severities from 1, 2, 3, 4, 5")


def _attack(checks: Checks, section: str, name: str) -> None:
    base = f"eval.{section}.{name}"
    # pixel space: an l_inf budget above 1 means nothing (every image is already within 1 of every other); in
    # normalised units 1 is about a quarter of the pixel range, far beyond any budget in use
    checks.check(f"{base}.eps", lambda v: all(0 <= e <= 1 for e in v) and len(set(v)) == len(v),
                 "a list of distinct budgets in [0, 1] (units of the section's space: pixel 1/255 = one grey level, "
                 "or normalised)")
    checks.positive_int(f"{base}.max_samples", optional=True)


def _adversarial(checks: Checks, section: str) -> None:
    base = f"eval.{section}"
    _sublist(checks, f"{base}.attacks", ATTACKS, "attacks")
    checks.one_of(f"{base}.space", SPACES)
    checks.one_of(f"{base}.source", ADVERSARIAL_SOURCES)
    checks.one_of(f"{base}.labels", LABELS)
    checks.one_of(f"{base}.elliptical_estimator", ESTIMATORS, optional=True)
    checks.positive_int(f"{base}.max_samples", f"{base}.batch_size", optional=True)
    checks.check(f"{base}.seed", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    for name in ATTACKS:
        _attack(checks, section, name)
    checks.positive_int(f"{base}.pgd.steps")
    checks.positive(f"{base}.pgd.step_size")
    checks.positive(f"{base}.spsa.lr", f"{base}.spsa.delta")
    checks.positive_int(f"{base}.spsa.nb_sample", f"{base}.spsa.nb_iter", f"{base}.spsa.max_batch_size")
    checks.one_of(f"{base}.spsa.estimate_at", SPSA_ESTIMATE_AT)
    checks.one_of(f"{base}.autoattack.version", AUTOATTACK_VERSIONS)
    # the suite reports l_inf budgets and the largest l_inf perturbation applied, for every attack
    checks.check(f"{base}.autoattack.norm", lambda v: v == "Linf",
                 "Linf (the suite's budgets and its max_linf are l_inf)")


def _value_checks(cfg: DictConfig, evaluations: Iterable[str]) -> Checks:
    checks = Checks(cfg)
    _sublist(checks, "eval.run", evaluations, "evaluations")
    checks.positive_int("eval.batch_size")
    checks.check("eval.num_workers", lambda v: _is_int(v) and v >= 0, "an integer >= 0")
    checks.positive_int("eval.torch_threads", optional=True)
    checks.check("eval.device", lambda v: bool(_DEVICE.match(str(v))), "auto, cpu, cuda or cuda:N")
    checks.one_of("eval.precision", PRECISIONS)
    if cfg.eval.precision == "fp16" and (cfg.eval.device == "cpu"
                                         or (cfg.eval.device == "auto" and not torch.cuda.is_available())):
        checks.fail("eval.precision", f"must be bf16 or fp32 without CUDA (eval.device={cfg.eval.device}): fp16 "
                                      "autocast needs CUDA")
    checks.check("eval.log_every_n", lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0: off)")
    checks.check("eval.log_every_s", lambda v: v >= 0, ">= 0 seconds (0: off)")
    checks.fraction("eval.crop_pct", low_open=True, optional=True)
    checks.one_of("eval.interpolation", INTERPOLATIONS, optional=True)

    _sublist(checks, "eval.imagenet_v2.variants", V2_VARIANTS, "variants")
    for section in ("imagenet_c", "corruptions"):
        # the standard 15 enter the means (and ImageNet-C's mCE); the 4 extra ones are reported apart
        _sublist(checks, f"eval.{section}.corruptions", IMAGENET_C_CORRUPTIONS, "standard corruptions")
        _sublist(checks, f"eval.{section}.extra_corruptions", IMAGENET_C_EXTRA, "extra corruptions")
        _severities(checks, f"eval.{section}.severities")
    checks.positive_int("eval.clean.max_samples", "eval.corruptions.max_samples", optional=True)
    # sample seeds go through numpy's SeedSequence, which takes non-negative integers only
    checks.check("eval.corruptions.seed", lambda v: _is_int(v) and v >= 0, "an integer >= 0")

    for section in ADVERSARIAL_SECTIONS:
        _adversarial(checks, section)
    return checks


def check_eval_config(cfg: DictConfig, evaluations: Iterable[str]) -> None:
    """Refuse unknown keys, then every bad value at once (:class:`quest.validation.ConfigError`, a ValueError)."""
    check_known_keys(cfg, EvalConfig)
    _value_checks(cfg, evaluations).raise_if_any("eval")
