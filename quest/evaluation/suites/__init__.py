"""The built-in evaluations, one module each; importing this package imports every module in it, and each
registers its evaluations (quest.evaluation.kinds). A new built-in evaluation is one module here and one suite
file in configs/eval/ (docs/evaluation.md, "Adding an evaluation").

- ``classification``: ImageNet val, v2, A, R and the configured data set's val split (``clean``), one evaluator
  whose instances differ only in data;
- ``imagenet_real``: ImageNet-ReaL; ``imagenet_c``: ImageNet-C; ``corruptions``: ImageNet-C's corruptions on the
  fly; ``adversarial``: FGSM, PGD, SPSA and AutoAttack (``adversarial``, ``adversarial_paper``).
"""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
