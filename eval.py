"""Evaluate a trained model: ``python eval.py checkpoint=<run>/checkpoints/last.pt eval=<suite>``, or a timm model
with ``model=<timm name> attention=<name> [weights=<state_dict.pt>]``. Suites are in configs/eval/; results
(eval_results.json / .csv / .md) go to <training run>/eval/<suite>/<checkpoint>-<model|ema>/ by default.
The same app as the ``quest-eval`` console script (quest/cli.py); docs/evaluation.md.
"""
from quest_cli import evaluate

if __name__ == "__main__":
    evaluate()
