"""Train a timm ViT with a chosen attention: ``python train.py [attention=quest] [model=vit_base] [recipe=deit] ...``

With no arguments: a small ViT with QUEST attention on the built-in digits, on CPU, in under a minute.
Exit codes (docs/training.md): 0 finished (completed, stopped at trainer.max_steps, requeued, or already finished
before), 1 error (a bad config value, a refused resume), 3 diverged (in a multirun a diverged job is reported in its
summary and the sweep goes on), 130 / 143 interrupted by SIGINT / SIGTERM after saving.
"""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from quest.engine import exit_code, fit
from quest.schema import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="configs", config_name="train")
def main(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    choices = {k: str(v) for k, v in hc.runtime.choices.items() if k in ("model", "attention", "recipe", "data")}
    summary = fit(cfg, hc.runtime.output_dir, choices)
    code = exit_code(summary, multirun=hc.mode == RunMode.MULTIRUN)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
