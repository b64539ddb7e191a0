"""Every config composes; recipes resolve to the published values (docs/training.md, Recipes); bad keys fail at start."""
from __future__ import annotations

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, InterpolationResolutionError, ValidationError

from quest.config.schema import TrainerConfig, model_size
from quest.train.builders import resolve_img_size, resolve_lr

from ..helpers import CONFIGS, compose_cfg


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


@pytest.mark.parametrize("attention", [a for a in _options("attention") if a != "path"])
def test_every_attention_config_composes_and_builds(attention):
    from quest.attention import get_attention

    cfg = compose_cfg(f"attention={attention}")
    assert cfg.attention.name == attention
    get_attention(cfg.attention.name, **cfg.attention.options)  # options are valid for the class


@pytest.mark.parametrize("model", _options("model"))
@pytest.mark.parametrize("data", _options("data"))
def test_every_model_and_data_config_composes(model, data):
    cfg = compose_cfg(f"model={model}", f"data={data}", "data.root=/x", "data.num_classes=10")
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


@pytest.mark.parametrize("model", _options("model"))
@pytest.mark.parametrize("recipe", _options("recipe"))
def test_every_recipe_resolves_with_every_model_of_a_size_it_has(recipe, model):
    """A recipe with no per-size table, or with a row for the model's size (or a default row), resolves; any
    other model is refused naming the model and the sizes the recipe has (docs/training.md, Recipes)."""
    cfg = compose_cfg(f"recipe={recipe}", f"model={model}")
    table = cfg.recipe.by_model_size
    if not table or "default" in table or model_size(cfg.model.name) in table:
        OmegaConf.to_container(cfg.recipe, resolve=True, throw_on_missing=True)
    else:
        sizes = ", ".join(sorted(table))
        with pytest.raises(InterpolationResolutionError, match=f"model '{cfg.model.name}'.*rows for: {sizes}"):
            OmegaConf.to_container(cfg.recipe, resolve=True, throw_on_missing=True)


def test_the_paper_models_have_rows_in_their_recipes():
    for recipe, models in (("deit", ["vit_tiny", "vit_small", "vit_base"]),
                           ("deit3", ["deit3_small", "deit3_base", "deit3_large", "deit3_huge"]),
                           ("deit3_finetune", ["deit3_base", "deit3_large", "deit3_huge"])):
        for model in models:
            OmegaConf.to_container(compose_cfg(f"recipe={recipe}", f"model={model}").recipe, resolve=True)


def test_deit_vit_base_values():
    cfg = compose_cfg("recipe=deit", "model=vit_base", "data=imagenet", "data.root=/x", "data.batch_size=256")
    r = cfg.recipe
    # 4 x 256 = the published global batch 1024 -> 5e-4 x 1024 / 512 = 1e-3
    assert resolve_lr(r, 256 * 4) == pytest.approx(1e-3)
    assert resolve_lr(r, 512) == pytest.approx(5e-4)
    assert (r.opt, r.weight_decay, r.warmup_epochs, r.warmup_lr, r.min_lr) == ("adamw", 0.05, 5, 1e-6, 1e-5)
    assert (r.mixup, r.cutmix, r.smoothing, r.reprob, r.repeated_aug) == (0.8, 1.0, 0.1, 0.25, 3)
    assert r.auto_augment == "rand-m9-mstd0.5-inc1" and r.crop_pct == 0.875 and r.ema_decay == 0.99996
    assert r.drop_path == 0.1 and r.epochs == 300 and resolve_img_size(cfg) == 224


@pytest.mark.parametrize("model, lr, size, drop_path, ft_drop_path", [
    ("deit3_small", 4e-3, 224, 0.05, 0.05),
    ("deit3_base", 3e-3, 192, 0.2, 0.2),
    ("deit3_large", 3e-3, 192, 0.45, 0.45),
    ("deit3_huge", 3e-3, 154, 0.6, 0.55),  # the authors' 160 is not a multiple of patch 14
])
def test_deit3_size_dependent_values(model, lr, size, drop_path, ft_drop_path):
    cfg = compose_cfg("recipe=deit3", f"model={model}")
    r = cfg.recipe
    assert (r.lr, r.drop_path, resolve_img_size(cfg)) == (lr, drop_path, size)
    assert resolve_lr(r, 123) == lr  # not scaled by batch
    assert (r.opt, r.bce_loss, r.bce_target_thresh, r.auto_augment, r.reprob, r.smoothing) == ("lamb", True, 0.0, "3a", 0.0, 0.0)
    assert r.crop_pct == 1.0 and r.epochs == 800
    ft = compose_cfg("recipe=deit3_finetune", f"model={model}").recipe
    assert (ft.lr, ft.weight_decay, ft.drop_path, ft.epochs, ft.opt, ft.bce_loss) == (1e-5, 0.1, ft_drop_path, 20, "adamw", False)
    assert ft.auto_augment == "rand-m9-mstd0.5-inc1" and ft.smoothing == 0.1 and ft.repeated_aug == 0


def test_default_config_is_the_cpu_quickstart():
    cfg = compose_cfg()
    assert (cfg.model.name, cfg.attention.name, cfg.data.name, cfg.recipe.name) == (
        "vit_pico_patch4_16", "quest", "digits", "light")
    assert cfg.trainer.epochs == cfg.recipe.epochs and cfg.trainer.resume == "auto"


def test_the_trainer_yaml_lists_every_trainer_key_at_the_schema_default():
    """configs/trainer/default.yaml spells out TrainerConfig for people; it must not drift from the schema."""
    schema = OmegaConf.to_container(OmegaConf.structured(TrainerConfig), resolve=False)
    path = CONFIGS / "trainer" / "default.yaml"
    written = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    assert list(written) == list(schema) and written == schema
    assert OmegaConf.to_container(compose_cfg().trainer, resolve=False) == schema  # as composed, on the schema
    keys = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
    assert len(keys) == len(schema) and all(" # " in line for line in keys), "one line and a comment per key"


def test_unknown_group_option_lists_the_available_ones():
    with pytest.raises(ConfigCompositionException, match=r"(?s)attention.*quest.*standard"):
        compose_cfg("attention=flash")


def test_misspelt_key_is_named():
    with pytest.raises(ConfigCompositionException, match="trainer.epoch"):
        compose_cfg("trainer.epoch=3")
    with pytest.raises((ConfigCompositionException, ValidationError, ConfigKeyError), match="batch_size"):
        compose_cfg("data.batch_size=many")


def test_unknown_attention_name_through_the_config_lists_registered_names():
    from quest.train.builders import build_model

    cfg = compose_cfg("attention.name=flash_quest")
    with pytest.raises(ValueError, match=r"unknown attention 'flash_quest'; registered attentions: .*quest.*standard"):
        build_model(cfg)
