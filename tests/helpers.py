"""Shared test helpers: composing the real Hydra configs."""
from __future__ import annotations

import os
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from quest.config_store import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

register_configs()

# a tiny, fast training setup on torchvision FakeData
FAST = [
    "data=fake", "data.img_size=16", "data.fake_train_size=64", "data.fake_val_size=32", "data.batch_size=16",
    "model=vit_pico", "recipe=light", "trainer.epochs=2", "trainer.log_every_n_steps=1",
]


def compose_cfg(*overrides: str, config_name: str = "train", hydra: bool = False) -> DictConfig:
    """The config an app composes from these command-line overrides (``hydra``: with the ``hydra`` node)."""
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=hydra)


def eval_cfg(*overrides: str, hydra: bool = False) -> DictConfig:
    """eval.py's config for these overrides."""
    return compose_cfg(*overrides, config_name="eval", hydra=hydra)


def bf16_sdpa_unavailable() -> str | None:
    """Why bf16 scaled-dot-product attention cannot run in this process, or None. torch 2.14's CPU flash-attention
    kernel in bf16 raises "pack_vnni2 is only supported when avx512 is supported" for 65+ tokens when
    ATEN_CPU_CAPABILITY dispatches below the AVX-512 the processor has (it asks the processor, not the dispatch):
    a limit of that forced setting, which CI uses to rerun the numerical tests, not of any real machine."""
    import torch
    import torch.nn.functional as F

    q = torch.zeros(1, 1, 65, 16, dtype=torch.bfloat16)
    try:
        F.scaled_dot_product_attention(q, q, q)
    except RuntimeError as exc:
        return f"bf16 attention fails in this torch under ATEN_CPU_CAPABILITY={os.environ.get('ATEN_CPU_CAPABILITY')}: {exc}"
    return None
