"""Values that would train into a wrong result without an error: attention=path without a class, a model outside the
ViT family, and a loss far above chance (the default guard). Every value against its schema field's declaration
(non-finite floats included) is tests/config/test_declared_bounds.py's."""
from __future__ import annotations

import math

import pytest

from quest.config.checks import ConfigError
from quest.models import create_model
from quest.train import fit
from quest.train.checks import check_train_config
from quest.train.update import chance_loss, divergence_threshold
from tests.helpers import FAST, compose_cfg


def test_attention_path_without_a_class_is_refused():
    with pytest.raises(ConfigError, match=r"attention\.name must be set with attention=path"):
        check_train_config(compose_cfg("attention=path"))


def test_a_model_outside_the_vit_family_gets_a_clear_message(tmp_path):
    with pytest.raises(ValueError, match=r"model\.name='resnet50' is not a Vision Transformer"):
        create_model("resnet50", "quest")
    with pytest.raises(ValueError, match=r"not a Vision Transformer"):
        fit(compose_cfg(*FAST, "model.name=resnet50"), tmp_path)


@pytest.mark.numerics
def test_default_divergence_threshold_is_a_factor_of_the_chance_loss():
    cfg = compose_cfg()
    assert chance_loss(10, bce=False) == pytest.approx(2.302585092994046, rel=1e-12)
    assert chance_loss(1000, bce=True) == pytest.approx(0.6931471805599453, rel=1e-12)
    assert divergence_threshold(cfg.trainer, cfg.recipe, 10) == pytest.approx(10 * 2.302585092994046, rel=1e-12)
    deit3 = compose_cfg("recipe=deit3", "model=deit3_small")
    assert divergence_threshold(deit3.trainer, deit3.recipe, 1000) == pytest.approx(10 * 0.6931471805599453, rel=1e-12)
    explicit = compose_cfg("trainer.max_loss=50")
    assert divergence_threshold(explicit.trainer, explicit.recipe, 10) == 50
    off = compose_cfg("trainer.max_loss_factor=null")
    assert divergence_threshold(off.trainer, off.recipe, 10) == math.inf


def test_a_loss_far_above_chance_is_reported_as_diverged(tmp_path):
    # the example: recipe.lr=10 on the digits trained to loss ~900 (chance 2.3) and ended "completed"
    summary = fit(compose_cfg("recipe.lr=10", "trainer.epochs=2", "trainer.device=cpu"), tmp_path)
    assert summary["status"] == "diverged", summary
    assert "above" in summary["divergence_reason"]
