"""Recipes own their per-model-size tables (recipe.by_model_size): every recipe x model and experiment x model
composes to the values it composed to when model configs carried the recipe numbers (tests/fixtures/recipe_matrix.json,
written by tests/recipe_matrix.py with that code), and a size a recipe has no row for is a clear error."""
from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError

from quest.config.schema import model_size
from tests.helpers import compose_cfg
from tests.recipe_matrix import FIXTURE, UNRESOLVED, options, resolved_values

#: Configs that did not resolve before and do now, each with its reason. The table is keyed by the size word of the
#: model name, so DeiT-III's per-size values also reach timm's plain ViT of that size (before, only the deit3_* model
#: configs carried them), and table2_deit3 now overrides only Huge's row, so its S (which it does not sweep) gets
#: the recipe's own small row.
_DEIT3_KEYS = ("recipe.lr", "recipe.img_size", "recipe.drop_path")
NEWLY_RESOLVED = {
    **{(f"{config} model=vit_{size}", key): f"deit3 {size} row"
       for config, keys in (("recipe=deit3", _DEIT3_KEYS), ("recipe=deit3_finetune", ("recipe.drop_path",)),
                            ("experiment=table2_deit3", _DEIT3_KEYS),
                            ("experiment=table2_deit3_finetune", ("recipe.drop_path",)))
       for size in ("small", "base", "large", "huge") for key in keys},
    ("experiment=table2_deit3 model=deit3_small", "recipe.img_size"): "deit3 small row",
}


BEFORE = json.loads(FIXTURE.read_text())
#: keys added to the composed groups after the fixture was written (the telemetry's thresholds, the compile's mode
#: and backend, the float32 matmul precision): in every config, outside the comparison
ADDED_SINCE = ("trainer.data_wait_warning", "trainer.low_mfu_warning", "trainer.compile_mode",
               "trainer.compile_backend", "trainer.matmul_precision")
MODELS = options("model")


def _rows(model: str) -> list[str]:
    """The fixture's configs of one model: every recipe and every experiment with it (as tests/recipe_matrix.py
    lists them)."""
    return [f"{group}={option} model={model}" for group in ("recipe", "experiment") for option in options(group)]


def test_the_matrix_holds_every_recipe_and_experiment_with_every_model():
    """The fixture's configs are today's recipes, experiments and models (nothing composed here); each listed change
    is one of them, so the test below checks it for its model."""
    assert sorted(BEFORE) == sorted(row for model in MODELS for row in _rows(model))
    assert {config for config, _ in NEWLY_RESOLVED} <= set(BEFORE)


# One test per model (15 configs each) rather than one for the whole matrix: each of the 180 compositions is a full
# Hydra compose (~0.3 s: the defaults tree, the schema merge), the cost of what is checked, so the matrix is split
# where pytest-xdist can spread it and a failure names its model.
@pytest.mark.parametrize("model", MODELS)
def test_every_composed_value_is_unchanged(model):
    changed, newly = [], set()
    for config in _rows(model):
        values, before = resolved_values(*config.split()), BEFORE[config]
        assert sorted(values) == sorted([*before, *ADDED_SINCE]), config
        values = {k: v for k, v in values.items() if k not in ADDED_SINCE}
        for key, value in values.items():
            if value == before[key]:
                continue
            if before[key] == UNRESOLVED and (config, key) in NEWLY_RESOLVED:
                newly.add((config, key))
                continue
            changed.append(f"{config}: {key} {before[key]!r} -> {value!r}")
    assert not changed, "\n".join(changed)
    assert newly == {(config, key) for config, key in NEWLY_RESOLVED if config.endswith(f" model={model}")}


def test_table2_deit3_first_phase_sizes():
    """The experiment's compute-limited Huge (126 px) replaces only that row's input size."""
    sizes = {m: compose_cfg("experiment=table2_deit3", f"model={m}").recipe for m in ("deit3_base", "deit3_huge")}
    assert (sizes["deit3_base"].img_size, sizes["deit3_huge"].img_size) == (192, 126)
    assert (sizes["deit3_huge"].lr, sizes["deit3_huge"].drop_path) == (3e-3, 0.6)


@pytest.mark.parametrize("name, size", [("vit_base_patch16_224", "base"), ("deit3_huge_patch14_224", "huge"),
                                        ("vit_pico_patch4_16", "pico"), ("deit_tiny_patch16_224.fb_in1k", "tiny")])
def test_model_size_is_the_word_after_the_family(name, size):
    assert model_size(name) == size


def test_unknown_size_names_the_model_and_the_sizes_the_recipe_has():
    cfg = compose_cfg("recipe=deit3", "model=vit_tiny")
    with pytest.raises(InterpolationResolutionError) as err:
        OmegaConf.to_container(cfg.recipe, resolve=True)
    text = str(err.value)
    assert "vit_tiny_patch16_224" in text and "'tiny'" in text
    assert "base, huge, large, small" in text and "recipe 'deit3'" in text


def test_a_default_row_serves_other_sizes_and_a_row_overrides_it():
    assert compose_cfg("recipe=deit", "model=vit_large").recipe.drop_path == 0.1
    assert compose_cfg("recipe=deit", "model=vit_pico").recipe.drop_path == 0.0
    assert compose_cfg("recipe=deit", "model=vit_large", "+recipe.by_model_size.large.drop_path=0.3").recipe.drop_path == 0.3


def test_every_recipe_option_is_in_the_matrix():
    assert {c.split()[0] for c in BEFORE} >= {f"recipe={r}" for r in options("recipe")}


def test_a_run_stored_with_model_recipe_values_resumes(tmp_path):
    """A run written when model configs carried the recipe numbers (model.recipe_values, no recipe table) resumes
    with today's config of the same values; a value that differs is still refused."""
    from quest.config.checks import ConfigError
    from quest.run.directory import check_resume

    new = OmegaConf.to_container(compose_cfg("recipe=deit3", "model=deit3_huge"), resolve=True)
    stored = json.loads(json.dumps(new))
    del stored["recipe"]["by_model_size"]
    stored["model"]["recipe_values"] = {"deit3": {"lr": 3e-3, "img_size": 154, "drop_path": 0.6},
                                        "deit3_finetune": {"drop_path": 0.55}}
    check_resume(stored, new, tmp_path)
    stored["recipe"]["lr"] = 4e-3
    with pytest.raises(ConfigError, match="recipe.lr"):
        check_resume(stored, new, tmp_path)


def test_the_documented_overrides_change_one_value_or_one_row():
    """docs/training.md (Recipes): recipe.lr=... replaces the value; recipe.by_model_size.large.drop_path=... a row."""
    row = compose_cfg("recipe=deit3", "model=deit3_large", "recipe.by_model_size.large.drop_path=0.5").recipe
    assert (row.drop_path, row.lr, row.img_size) == (0.5, 3e-3, 192)
    assert compose_cfg("recipe=deit3", "model=vit_tiny", "recipe.lr=1e-3", "recipe.img_size=224",
                       "recipe.drop_path=0.1").recipe.lr == 1e-3  # a size with no row, every value given
