"""Values that would train into a wrong result without an error: non-finite floats anywhere in the schema,
attention=path without a class, a model outside the ViT family, and a loss far above chance (the default guard)."""
from __future__ import annotations

import dataclasses
import math
import typing

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from quest.config.checks import ConfigError, float_keys
from quest.config.schema import TrainConfig
from quest.models import create_model
from quest.train import fit
from quest.train.checks import check_train_config
from quest.train.trainer import chance_loss, divergence_threshold
from tests.helpers import FAST, compose_cfg


def _schema_float_fields(schema: type, prefix: str = "") -> dict[str, bool]:
    """key -> is a list, for every field whose annotation mentions float, walking nested dataclasses (written out
    here from the annotations' text, independently of quest.config.checks.float_keys)."""
    found: dict[str, bool] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        hint = hints[f.name]
        nested = [a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a)]
        if nested:
            found.update(_schema_float_fields(nested[0], f"{prefix}{f.name}."))
        elif "float" in str(hint) and "Any" not in str(hint):
            found[prefix + f.name] = "List" in str(hint) or "list" in str(hint)
    return found


FLOAT_FIELDS = _schema_float_fields(TrainConfig)
BASE = compose_cfg()  # the default run: digits, vit_pico, light


def test_every_float_field_of_the_schema_is_checked_for_finiteness():
    assert set(float_keys(TrainConfig)) == set(FLOAT_FIELDS)
    # the ones the issue names are among them
    assert {"recipe.lr", "recipe.weight_decay", "data.mean", "data.std", "recipe.opt_eps"} <= set(FLOAT_FIELDS)


@pytest.mark.parametrize("key", sorted(FLOAT_FIELDS))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bad=st.sampled_from([math.nan, math.inf, -math.inf]) | st.floats().filter(lambda v: not math.isfinite(v)),
       position=st.integers(0, 2))
def test_a_non_finite_value_of_any_float_field_is_refused_naming_the_key(key, bad, position):
    cfg = BASE.copy()
    if FLOAT_FIELDS[key]:  # a list: one element non-finite, the others the default's or a harmless 0.5
        current = OmegaConf.select(cfg, key)
        values = list(current) if current is not None else [0.5, 0.5]
        values[position % len(values)] = bad
        OmegaConf.update(cfg, key, values, merge=False)
    else:
        OmegaConf.update(cfg, key, bad)
    with pytest.raises(ConfigError, match=rf"{key.replace('.', r'[.]')} must be finite"):
        check_train_config(cfg)


def test_finite_values_pass():
    check_train_config(BASE.copy())


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
