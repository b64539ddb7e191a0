"""train.py's config is checked before any work: an unknown key (added with + or ++, or misspelt) is refused with a
suggestion, and every bad value is named with what was expected, all at once, before the run is built (docs/training.md,
"Runs, resume and provenance"). The property over every key and any value is tests/config/test_bad_values.py's; these
are the messages, word for word."""
from __future__ import annotations

import pytest

from quest.config.checks import ConfigError
from quest.config.schema import TrainConfig
from quest.train import fit

from ..helpers import FAST, compose_cfg

# --- every key known ---------------------------------------------------------------------------------------
GROUPS = ["model", "attention", "data", "recipe", "trainer", "logger", "diagnostics"]


@pytest.mark.parametrize("prefix", ["+", "++"])
@pytest.mark.parametrize("group", GROUPS + [""])
def test_an_added_unknown_key_is_refused_like_a_misspelt_one(tmp_path, group, prefix):
    key = f"{group}.bogus_key" if group else "bogus_key"
    with pytest.raises(ConfigError, match=rf"unknown config keys.*\n  {key}: not a key of"):
        fit(compose_cfg(*FAST, f"{prefix}{key}=1"), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_suggestion_for_a_near_miss_and_known_free_form_keys():
    from quest.config.checks import check_known_keys

    with pytest.raises(ConfigError, match=r"trainer\.epoch: .*did you mean trainer\.epochs\?"):
        check_known_keys(compose_cfg("+trainer.epoch=3"), TrainConfig)
    with pytest.raises(ConfigError, match=r"recipe\.lrr: .*did you mean recipe\.lr\?"):
        check_known_keys(compose_cfg("++recipe.lrr=0.1"), TrainConfig)
    check_known_keys(compose_cfg("+model.kwargs.qkv_bias=false", "+experiment_values.epochs=3"), TrainConfig)


def test_an_unknown_attention_option_is_refused_before_building(tmp_path):
    with pytest.raises(ConfigError, match=r"attention\.options is invalid .*has no option\(s\) bogus"):
        fit(compose_cfg(*FAST, "+attention.options.bogus=1"), tmp_path)


# --- every value checked before any work -------------------------------------------------------------------
BAD_VALUES = [
    ("trainer.eval_every_n_epochs=0", r"trainer\.eval_every_n_epochs must be a positive integer, got 0"),
    ("trainer.accum_steps=0", r"trainer\.accum_steps must be a positive integer, got 0"),
    ("trainer.log_every_n_steps=0", r"trainer\.log_every_n_steps must be a positive integer, got 0"),
    ("trainer.epochs=-1", r"trainer\.epochs must be a positive integer, got -1"),
    ("trainer.max_steps=0", r"trainer\.max_steps must be a positive integer \(or null\), got 0"),
    ("trainer.checkpoint_every_n_steps=-2", r"trainer\.checkpoint_every_n_steps must be a positive integer"),
    ("trainer.device=gpu", r"trainer\.device must be auto, cpu, cuda or cuda:N, got 'gpu'"),
    ("trainer.precision=fp8", r"trainer\.precision must be one of auto, fp32, bf16, fp16, got 'fp8'"),
    ("trainer.strategy=zero", r"trainer\.strategy must be one of ddp, fsdp"),
    ("trainer.resume=/no/such/last.pt", r"trainer\.resume must be auto, never or the path of an existing"),
    ("trainer.overwrite=true", r"trainer\.overwrite applies only with trainer\.resume=never"),
    ("trainer.init_from=/no/such.pt", r"trainer\.init_from must be the path of an existing checkpoint"),
    ("trainer.max_loss=0", r"trainer\.max_loss must be > 0"),
    ("recipe.ema_decay=2", r"recipe\.ema_decay must be in \[0, 1\), got 2\.0"),
    ("recipe.lr=-0.1", r"recipe\.lr must be > 0"),
    ("recipe.drop_path=1.5", r"recipe\.drop_path must be in \[0, 1\)"),
    ("recipe.smoothing=-0.1", r"recipe\.smoothing must be in \[0, 1\)"),
    ("recipe.mixup_prob=1.5", r"recipe\.mixup_prob must be in \[0, 1\]"),
    ("recipe.crop_pct=0.002", r"recipe\.crop_pct must be in \[0\.1, 1\]"),  # resized each image 500x the crop's side
    ("recipe.warmup_epochs=-1", r"recipe\.warmup_epochs must be >= 0"),
    ("recipe.scale=[0.9,0.5]", r"recipe\.scale must be \[min, max\] with 0 < min <= max <= 1"),
    ("recipe.opt=adamz", r"recipe\.opt must be one of .*adamw"),
    ("recipe.sched=cosin", r"recipe\.sched must be one of cosine"),
    ("recipe.mixup_mode=rows", r"recipe\.mixup_mode must be one of batch, pair, elem"),
    ("recipe.repeated_aug=-1", r"recipe\.repeated_aug must be an integer in 0\.\.16 \(0 = off\)"),
    # a typo's repeats: the sampler's index list of an epoch times 10**12; random erasing's loop per image
    ("recipe.repeated_aug=1000000000000", r"recipe\.repeated_aug must be an integer in 0\.\.16"),
    ("recipe.recount=1000000000000", r"recipe\.recount must be an integer in 1\.\.16"),
    ("data.bad_images=skp", r"data\.bad_images must be one of error, skip, got 'skp'"),
    ("data.batch_size=0", r"data\.batch_size must be a positive integer, got 0"),
    ("data.num_workers=-1", r"data\.num_workers must be an integer in 0\.\."),
    ("data.subset_fraction=0", r"data\.subset_fraction must be in \(0, 1\]"),
    ("data.subset_fraction=1.5", r"data\.subset_fraction must be in \(0, 1\]"),
    ("data.std=[0.5,0,0.5]", r"data\.std must be three values > 0"),
    ("data.mean=[123.7,116.3,103.5]", r"data\.mean must be three values in \[0, 1\]"),
    ("data.std=[58.4,57.1,57.4]", r"data\.std must be three values > 0 and at most 1"),
    ("data.fake_train_size=0", r"data\.fake_train_size must be a positive integer"),
    ("diagnostics.every_n_steps=-1", r"diagnostics\.every_n_steps must be an integer >= 0"),
    ("diagnostics.num_samples=0", r"diagnostics\.num_samples must be a positive integer"),
    ("logger.mode=onlin", r"logger\.mode must be one of online, offline, disabled"),
]


@pytest.mark.parametrize("bad, message", BAD_VALUES, ids=[b for b, _ in BAD_VALUES])
def test_a_bad_value_is_named_before_anything_is_built(tmp_path, monkeypatch, bad, message):
    import quest.train.lifecycle as fit_module

    def never(*args, **kwargs):
        raise AssertionError("the run was built before its config was checked")

    monkeypatch.setattr(fit_module, "Run", never)
    with pytest.raises(ConfigError, match=message):
        fit(compose_cfg(*FAST, bad), tmp_path)


def test_every_bad_value_is_reported_at_once(tmp_path):
    with pytest.raises(ConfigError) as info:
        fit(compose_cfg(*FAST, "trainer.accum_steps=0", "recipe.ema_decay=2", "data.bad_images=skp"), tmp_path)
    assert all(k in str(info.value) for k in ("trainer.accum_steps", "recipe.ema_decay", "data.bad_images"))


@pytest.mark.parametrize("overrides, message", [
    (["data.num_classes=5"], r"data\.num_classes must be 10: the digits data set has 10 classes"),
    ([*FAST, "model.img_size=15"], r"model\.img_size must be a multiple of the patch size 4 of vit_pico_patch4_16, got 15"),
    ([*FAST, "model.img_size=null", "data.img_size=18"], r"data\.img_size must be a multiple of the patch size 4"),
])
def test_data_and_model_sizes_are_checked_before_training(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        fit(compose_cfg(*overrides), tmp_path)
    assert not (tmp_path / "metrics.jsonl").exists()
