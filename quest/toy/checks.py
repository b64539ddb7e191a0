"""Checks of a toy-study config (configs/toy/toy.yaml) that run before anything trains: every value in range, every
problem named by its key and reported together, as train.py's are (quest.train.checks). The study's own checks of
names (formulations, variants) and of the device follow in quest.toy.study."""
from __future__ import annotations

from typing import Any, Mapping

from omegaconf import OmegaConf

from quest.config.checks import Checks

from .config import ToyConfig
from .data import DATA_VALUES_WORDS, MAX_DATA_VALUES, data_values

__all__ = ["check_toy_config"]


def check_toy_config(cfg: Mapping[str, Any]) -> None:
    """Raise :class:`quest.config.checks.ConfigError` naming every bad value of a toy-study config (a plain dict of
    :class:`~quest.toy.config.ToyConfig`): each against its field's declaration, then the ranges' low <= high and the
    size of the data each training-set size makes."""
    c = Checks(OmegaConf.create(dict(cfg)))
    c.declared(ToyConfig)
    c.raise_if_any("toy study")
    for key in ("paper_outcome.biased_train", "paper_outcome.biased_test"):  # each value passed alone: two numbers
        low, high = c.value(key)
        if low > high:
            c.fail(key, "must be [low, high] with 0 <= low <= high <= 1")
    # every field in range, their product need not be: the data of each training-set size the study trains
    data, study = c.value("data"), c.value("study")
    key = "study.train_sizes" if study.name == "sensitivity" else "data.train_size"
    sizes = study.train_sizes if study.name == "sensitivity" else [data.train_size]
    largest = max(data_values(data, size) for size in sizes) if sizes else 0
    if largest > MAX_DATA_VALUES:
        c.fail(key, f"must keep a data realisation within {MAX_DATA_VALUES:,} numbers, {DATA_VALUES_WORDS} "
                    f"(here {largest:,})")
    c.raise_if_any("toy study")
