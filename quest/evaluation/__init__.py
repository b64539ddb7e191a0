"""Evaluation suites (docs/evaluation.md): ImageNet val / v2 / ReaL / A / R / C, on-the-fly corruptions and
adversarial attacks on any configured data set, run by ``eval.py`` from configs/eval/."""
from .cli import rewrite_model_override
from .config import EvalConfig, register_eval_configs
from .runner import EVALUATIONS, run_evaluation, run_evaluations
from .target import EvalTarget, load_target

__all__ = ["EVALUATIONS", "EvalConfig", "EvalTarget", "load_target", "register_eval_configs",
           "rewrite_model_override", "run_evaluation", "run_evaluations"]
