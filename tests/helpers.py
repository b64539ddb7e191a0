"""Shared test helpers: composing the real Hydra configs."""
from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from quest.schema import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

register_configs()

# a tiny, fast training setup on torchvision FakeData
FAST = [
    "data=fake", "data.img_size=16", "data.fake_train_size=64", "data.fake_val_size=32", "data.batch_size=16",
    "model=vit_pico", "recipe=light", "trainer.epochs=2", "trainer.log_every_n_steps=1",
]


def compose_cfg(*overrides: str, config_name: str = "train") -> DictConfig:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides))
