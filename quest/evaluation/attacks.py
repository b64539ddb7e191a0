"""l_inf attacks: FGSM and PGD implemented here, SPSA in :mod:`.spsa`, AutoAttack from ``pyautoattack``.

Every attack takes a model that maps tensors of the attack space (:mod:`.attack_space`: [0, 1] pixels with the
normalisation inside the model, or the normalised tensor) to logits and is in eval mode, and returns inputs within
``eps`` of the input (l_inf) and, when ``clip`` is given, within those bounds. Randomness (PGD's start, SPSA's start
and directions) is drawn per sample from (seed, sample index), so results do not depend on batching or on the number
of processes.

FGSM and PGD are the textbook few lines (Goodfellow et al. 2015; Madry et al. 2018) with the semantics of
cleverhans 4.0.0's torch ``fast_gradient_method`` / ``projected_gradient_descent``, which the Elliptical-attention
code calls (``ImageAttack/engine.py``): one signed-gradient step of eps; PGD from a uniform start in the eps-ball,
``steps`` signed steps of ``step_size``, each projected back onto the ball, and clipped only when bounds are given.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from .spsa import OnIteration, sample_generator, spsa

log = logging.getLogger("quest.eval")

__all__ = ["fgsm", "pgd", "spsa", "autoattack", "autoattack_library", "sample_generator"]

Bounds = tuple[float, float] | None


def _input_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        # sum: each sample's own gradient (cleverhans takes the batch mean; the sign is the same)
        loss = F.cross_entropy(model(x).float(), y, reduction="sum")
        (grad,) = torch.autograd.grad(loss, x)
    return grad


def _clamp(x: torch.Tensor, clip: Bounds) -> torch.Tensor:
    return x if clip is None else x.clamp(*clip)


def _project(x_adv: torch.Tensor, x: torch.Tensor, eps: float, clip: Bounds) -> torch.Tensor:
    return _clamp(torch.min(torch.max(x_adv, x - eps), x + eps), clip)


def fgsm(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, clip: Bounds = (0.0, 1.0)) -> torch.Tensor:
    """One step of eps * sign(grad of the cross-entropy), clamped to ``clip`` when given."""
    if eps == 0:
        return x.clone()
    return _clamp(x + eps * _input_grad(model, x, y).sign(), clip).detach()


def pgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, steps: int, step_size: float,
        random_start: bool, seed: int, indices: Sequence[int], clip: Bounds = (0.0, 1.0),
        on_iteration: OnIteration = None) -> torch.Tensor:
    """``steps`` signed-gradient steps of ``step_size`` (absolute), projected onto the eps-ball (and ``clip``); the
    start is uniform in the ball when ``random_start`` (per-sample noise from (seed, index)).
    ``on_iteration(done, steps)`` is told after each step."""
    x_adv = x.clone()
    if random_start and eps > 0:
        noise = torch.stack([torch.rand(x.shape[1:], generator=sample_generator(seed, i)) for i in indices])
        x_adv = _project(x + (2 * noise.to(x.device, x.dtype) - 1) * eps, x, eps, clip)
    for step in range(steps):
        x_adv = _project(x_adv + step_size * _input_grad(model, x_adv, y).sign(), x, eps, clip)
        if on_iteration:
            on_iteration(step + 1, steps)
    return x_adv.detach()


def autoattack_library() -> str:
    """The AutoAttack implementation used, or an ImportError saying how to install it."""
    try:
        from importlib.metadata import version

        import pyautoattack  # noqa: F401
    except ImportError as exc:
        raise ImportError("the autoattack attack needs pyautoattack (Croce & Hein's AutoAttack code): "
                          "pip install 'quest[eval]', or drop it: eval.adversarial.attacks=[fgsm,pgd,spsa]") from exc
    return f"pyautoattack {version('pyautoattack')} (Croce & Hein's reference AutoAttack)"


def autoattack(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, version: str, norm: str,
               seed: int, batch_size: int, on_forward: Callable[[str], None] | None = None
               ) -> tuple[torch.Tensor, dict[str, Any]]:
    """AutoAttack's ``run_standard_evaluation`` on (x, y). Returns the adversarial inputs and the attack settings
    that matter for comparisons (the 'standard' version uses 9 target classes for APGD-T and FAB-T).
    ``on_forward(detail)`` is told of each forward of the model, ``detail`` naming the attack under way
    (``apgd-t, attack 2/4``): the library's iterations are its own, but every one runs the model.

    Its APGD, FAB and Square clamp every iterate to [0, 1] whatever the space: right for pixels; on normalised
    tensors it is what the authors' bundled copy (``ImageAttack/autoattack/``, the same attack code) did."""
    autoattack_library()
    from pyautoattack import AutoAttack

    adversary = AutoAttack(model, norm=norm, eps=eps, version=version, device=x.device, seed=seed)
    adversary.logger.setLevel(logging.WARNING)
    hook = _follow_attacks(adversary, model, on_forward) if on_forward else None
    try:
        x_adv, _ = adversary.run_standard_evaluation(x, y, batch_size=batch_size)
    finally:
        if hook is not None:
            hook.remove()
    settings = {"attacks": list(adversary.attacks_to_run), "apgd_t_targets": adversary.apgd_targeted.n_target_classes,
                "fab_t_targets": adversary.fab.n_target_classes, "square_queries": adversary.square.n_queries}
    return x_adv.detach(), settings


def _follow_attacks(adversary: Any, model: nn.Module, on_forward: Callable[[str], None]) -> Any:
    """Names the attack under way by wrapping the ``perturb`` of AutoAttack's attack objects (instance attributes,
    gone with the adversary) and tells ``on_forward`` of every forward of ``model`` through a forward pre-hook; the
    hook's handle is returned for removal."""
    current = ["checks"]
    planned = list(adversary.attacks_to_run)

    def naming(attack: Any, name: Callable[[], str]) -> None:
        perturb = attack.perturb

        def perturb_named(*args: Any, **kwargs: Any) -> Any:
            current[0] = name()
            return perturb(*args, **kwargs)

        attack.perturb = perturb_named

    naming(adversary.apgd, lambda: f"apgd-{adversary.apgd.loss}")
    naming(adversary.apgd_targeted, lambda: "apgd-t")
    naming(adversary.fab, lambda: "fab-t" if adversary.fab.targeted else "fab")
    naming(adversary.square, lambda: "square")

    def detail() -> str:
        name = current[0]
        return f"{name}, attack {planned.index(name) + 1}/{len(planned)}" if name in planned else name

    return model.register_forward_pre_hook(lambda module, args: on_forward(detail()))
