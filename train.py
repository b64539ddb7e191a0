"""Train a timm ViT with a chosen attention: ``python train.py [attention=quest] [model=vit_base] [recipe=deit] ...``

With no arguments: a small ViT with QUEST attention on the built-in digits, on CPU, in a couple of minutes.
Exit codes: 0 finished (or stopped at trainer.max_steps), 3 diverged (see summary.json); in a multirun a diverged
job is reported in its summary and the sweep goes on.
"""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from quest.engine import EXIT_DIVERGED, fit
from quest.schema import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    choices = {k: str(v) for k, v in hc.runtime.choices.items() if k in ("model", "attention", "recipe", "data")}
    summary = fit(cfg, hc.runtime.output_dir, choices)
    if summary["status"] == "diverged" and hc.mode != RunMode.MULTIRUN:
        sys.exit(EXIT_DIVERGED)


if __name__ == "__main__":
    main()
