"""Shared test helpers: composing the real Hydra configs."""
from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from quest.config.hydra_store import register_configs

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"

register_configs()

# a tiny, fast training setup on data=fake (random images)
FAST = [
    "data=fake", "data.img_size=16", "data.fake_train_size=64", "data.fake_val_size=32", "data.batch_size=16",
    "model=vit_pico", "recipe=light", "trainer.epochs=2", "trainer.log_every_n_steps=1",
]


def compose_cfg(*overrides: str, config_name: str = "train", hydra: bool = False) -> DictConfig:
    """The config an app composes from these command-line overrides (``hydra``: with the ``hydra`` node): a copy
    of its own, so that a test may change it.

    Composed once per overrides and per state of what composing reads besides the YAML files of configs/ (which
    no test changes): Hydra's ConfigStore, where registering a plugin, a data set or eval.py's schema stores new
    nodes, and, for the ``hydra`` node, the working directory it records. Hydra's compose costs about 0.15 s; of
    the suite's 1,400 or so, about 230 repeat one composed before."""
    nodes = _stored_nodes()
    key = (overrides, config_name, hydra and os.getcwd(), tuple(map(id, nodes)))
    if key not in _COMPOSED:
        with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=list(overrides), return_hydra_config=hydra)
        _COMPOSED[key] = (nodes, cfg)  # the nodes held, so that no id in a key is reused for another node
    return copy.deepcopy(_COMPOSED[key][1])


_COMPOSED: dict[tuple, tuple[list[Any], DictConfig]] = {}


def _stored_nodes() -> list[Any]:
    """Every node in Hydra's ConfigStore, in its order (storing a name again replaces its node with a new one)."""
    from hydra.core.config_store import ConfigStore

    found, groups = [], [ConfigStore.instance().repo]
    while groups:
        for name, entry in sorted(groups.pop().items()):
            if isinstance(entry, dict):
                groups.append(entry)
            else:
                found.append(entry)
    return found


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


def flat_data_config(**changes: Any) -> dict[str, Any]:
    """A data config exactly as quest stored it in checkpoints before data sets were registered (commit 0b96722):
    one flat node with every data set's keys (quest/config/schema.py's DataConfig of that time), here with its defaults,
    then ``changes``."""
    stored = {
        "name": "???", "root": None, "batch_size": 64, "eval_batch_size": None, "num_workers": 0, "num_classes": 10,
        "img_size": 32, "mean": [0.5, 0.5, 0.5], "std": [0.5, 0.5, 0.5], "train_split": "train", "val_split": "val",
        "subset_fraction": 1.0, "subset_seed": 0, "val_fraction": 0.2, "split_seed": 0, "download": False,
        "bad_images": "error", "max_skipped_fraction": 0.01, "preflight": True, "fake_train_size": 256,
        "fake_val_size": 64, "pin_memory": True,
        "canvas": {"size": 32, "scale_min": 12, "scale_max": 22, "clutter": 3, "noise": 0.05, "copies": 2, "seed": 0},
        "num_samples": None, "shuffle_window": 8192,
    }
    stored.update(changes)
    return stored


class TickingClock:
    """A clock for progress lines that moves one second at each reading: time never decides a test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now
