"""Values valid one by one, checked together (quest/train/checks.py _relations; docs/training.md, "Values checked
together"): refused before any work where no user means them, warned once and recorded where one may."""
from __future__ import annotations

import logging

import pytest

from quest.train import fit
from quest.train.checks import ConfigError, check_train_config

from ..helpers import FAST, compose_cfg


@pytest.mark.parametrize("overrides, key", [
    (["recipe.lr=1e-3", "recipe.min_lr=1e-2"], "recipe.min_lr must be at most recipe.lr=0.001"),
    (["recipe.lr=1e-3", "recipe.warmup_lr=1e-2"], "recipe.warmup_lr must be at most recipe.lr=0.001"),
    (["recipe.mixup=0.8", "data.batch_size=15"], "data.batch_size must be even with recipe.mixup"),
    (["recipe.cutmix=1.0", "data.batch_size=15"], "data.batch_size must be even with recipe.mixup or recipe.cutmix"),
])
def test_contradicting_values_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        check_train_config(compose_cfg(*FAST, *overrides))
    assert key in str(info.value)


@pytest.mark.parametrize("overrides", [["recipe.lr=1e-3", "recipe.min_lr=1e-3"], ["recipe.mixup=0.8",
                                                                                   "data.batch_size=16"]])
def test_the_edge_of_each_relation_is_allowed(overrides):
    check_train_config(compose_cfg(*FAST, *overrides))


def test_a_warm_up_longer_than_training_is_warned_once_and_its_peak_recorded(tmp_path, caplog):
    cfg = compose_cfg(*FAST, "recipe.warmup_epochs=10", "recipe.sched_on=updates", "trainer.max_steps=1")
    with caplog.at_level(logging.WARNING, logger="quest"):
        summary = fit(cfg, tmp_path)
    # the reference: timm's linear warm-up, warmup_lr + t (lr - warmup_lr) / warmup_t at the last of the
    # 2 epochs x 4 updates (64 images, batch 16), with warmup_t = 10 epochs x 4 updates
    lr, warmup_lr = summary["lr"], cfg.recipe.warmup_lr
    expected = warmup_lr + 7 * (lr - warmup_lr) / 40
    assert summary["lr_peak"] == pytest.approx(expected, rel=1e-9)
    warnings = [r.getMessage() for r in caplog.records if "does not end before trainer.epochs" in r.getMessage()]
    assert len(warnings) == 1 and f"{expected:.3g}" in warnings[0]


def test_a_warm_up_that_ends_in_time_is_not_warned(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="quest"):
        summary = fit(compose_cfg(*FAST, "recipe.warmup_epochs=1", "trainer.max_steps=1"), tmp_path)
    assert not any("does not end before" in r.getMessage() for r in caplog.records)
    assert summary["lr_peak"] <= summary["lr"]


def test_an_ema_with_fsdp_is_refused_with_the_config_before_any_work():
    """It used to be refused by the builders, after the model and the loaders were built."""
    from quest.train.checks import check_train_config

    with pytest.raises(ValueError, match=r"recipe\.ema must be false with trainer\.strategy=fsdp"):
        check_train_config(compose_cfg(*FAST, "trainer.strategy=fsdp", "recipe.ema=true"))
