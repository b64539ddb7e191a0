"""Evaluate a trained model: ``python eval.py checkpoint=<run>/checkpoints/last.pt eval=<suite>``, or a timm model
with ``model=<timm name> attention=<name> [weights=<state_dict.pt>]``. Suites are in configs/eval/; results
(eval_results.json / .csv / .md) go to the run directory, by default <training run>/eval/<suite>/<checkpoint
stem>-<model|ema> (e.g. eval/clean/last-ema), one directory per checkpoint file and weights.
See docs/evaluation.md.
"""
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from quest.evaluation import register_eval_configs, rewrite_model_override, run_evaluation

register_eval_configs()


@hydra.main(version_base="1.3", config_path="configs", config_name="eval")
def main(cfg: DictConfig) -> None:
    run_evaluation(cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    sys.argv = rewrite_model_override(sys.argv)  # model=<any timm name> as well as model=<configs/model option>
    main()
