"""Checks of a toy-study config (configs/toy/toy.yaml) that run before anything trains: every value in range, every
problem named by its key and reported together, as train.py's are (quest.train.checks). The study's own checks of
names (formulations, variants) and of the device follow in quest.toy.study."""
from __future__ import annotations

from typing import Any, Mapping

from omegaconf import OmegaConf

from quest.config.checks import DEVICE_PATTERN, Checks, float_keys, is_int, is_number

from .config import ToyConfig

__all__ = ["check_toy_config"]


def _each(test) -> Any:
    """A non-empty list each of whose values passes ``test``."""
    return lambda values: len(values) > 0 and all(test(v) for v in values)


def _seed(value: Any) -> bool:
    return is_int(value) and 0 <= value < 2**32


def _range(values: Any) -> bool:
    return len(values) == 2 and all(is_number(v) for v in values) and 0 <= values[0] <= values[1] <= 1


def check_toy_config(cfg: Mapping[str, Any]) -> None:
    """Raise :class:`quest.config.checks.ConfigError` naming every bad value of a toy-study config (a plain dict of
    :class:`~quest.toy.config.ToyConfig`)."""
    c = Checks(OmegaConf.create(dict(cfg)))
    c.finite(*float_keys(ToyConfig))
    c.check("grid.lrs", _each(lambda v: is_number(v) and v > 0), "a non-empty list of numbers > 0")
    c.check("grid.weight_decays", _each(lambda v: is_number(v) and v >= 0), "a non-empty list of numbers >= 0")
    for key in ("grid.data_seeds", "grid.init_seeds"):
        c.check(key, _each(_seed), "a non-empty list of integers in 0..2**32-1")
    c.positive_int("data.seq_len", "data.real_dim", "data.num_classes", "data.train_size", "data.test_size",
                   "model.mlp_hidden", "train.epochs", "train.batch_size")
    c.positive("data.pos_std", "train.eps")
    c.non_negative("data.biased_var", "model.embed_init_std", "study.stop.min_points", "study.stop.z")
    c.fraction("data.biased_fraction", "data.test_biased_fraction", "outcome.correct_min",
               "outcome.degenerate_train_max", "outcome.degenerate_test_max", "outcome.biased_train_min",
               "outcome.biased_test_max", "paper_outcome.correct_above", "paper_outcome.chance_max")
    for key in ("paper_outcome.biased_train", "paper_outcome.biased_test"):
        c.check(key, _range, "[low, high] with 0 <= low <= high <= 1")
    c.check("train.betas", lambda v: len(v) == 2 and all(is_number(b) and 0 <= b < 1 for b in v), "two values in [0, 1)")
    c.one_of("study.name", ("grid", "sensitivity"))
    c.check("study.train_sizes", lambda v: all(is_int(n) and n > 0 for n in v), "a list of positive integers")
    c.check("study.test_biased_fractions", lambda v: all(is_number(f) and 0 <= f <= 1 for f in v),
            "a list of fractions in [0, 1]")
    c.check("device", lambda v: isinstance(v, str) and bool(DEVICE_PATTERN.match(v)), "auto, cpu, cuda or cuda:N")
    c.process_count("workers", "threads", optional=True)  # each worker a process; threads multiply on top
    c.positive_int("runs_per_call", optional=True)
    c.check("probe_size", lambda v: is_int(v) and v >= 0, "an integer >= 0 (0: no key norms recorded)")
    for name in cfg.get("variants") or {}:  # a parameter's name holds dots (attn.qk_scale): no config key of its own
        for param, value in (cfg["variants"][name].get("param_init") or {}).items():
            if not is_number(value):
                c.problems.append(f"  variants.{name}.param_init[{param}] must be a finite number, got {value!r}")
    c.raise_if_any("toy study")
