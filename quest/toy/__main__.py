"""``python -m quest.toy [grid=full|quick] [attentions=[standard,quest]] [data.train_size=...] [out_dir=...]``."""
import logging
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from quest.toy.config import register_toy_config
from quest.toy.study import run_study, summary_table

register_toy_config()
# an absolute path: relative ones are resolved against the package under `python -m`, not this file
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs" / "toy")
log = logging.getLogger("quest.toy")


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="toy")
def main(cfg: DictConfig) -> None:
    out_dir = cfg.out_dir or HydraConfig.get().runtime.output_dir
    start = time.perf_counter()
    result = run_study(OmegaConf.to_container(cfg, resolve=True), out_dir)
    print(summary_table(result["success_rates"]))
    log.info("toy study (%s grid) written to %s in %.0f s", cfg.grid.name, out_dir, time.perf_counter() - start)


if __name__ == "__main__":
    main()
