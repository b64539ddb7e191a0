"""l_inf attacks on [0, 1] images: FGSM, PGD and SPSA implemented here, AutoAttack from ``pyautoattack``.

Every attack takes a model that maps [0, 1] pixels to logits (normalisation inside, see ``transforms.Normalized``)
and is in eval mode, and returns images within ``eps`` of the input (l_inf) and within [0, 1]. Randomness (PGD's
start, SPSA's perturbation directions) is drawn per sample from (seed, sample index), so results do not depend on
batching or on the number of processes.

FGSM and PGD are the textbook few lines (Goodfellow et al. 2015; Madry et al. 2018). SPSA (Uesato et al. 2018) is
ported from advertorch's implementation (the one torchattacks 3.5.1 ships): Adam on the perturbation with the
gradient estimated from ``nb_sample`` Rademacher directions and the margin loss. torchattacks itself is not used
because it pins requests~=2.25.1, which would downgrade the environment.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

log = logging.getLogger("quest.eval")

__all__ = ["fgsm", "pgd", "spsa", "autoattack", "autoattack_library"]


def _sample_generator(seed: int, index: int) -> torch.Generator:
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, index]).generate_state(1)[0]))


def _input_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        loss = F.cross_entropy(model(x).float(), y, reduction="sum")  # sum: each sample's own gradient
        (grad,) = torch.autograd.grad(loss, x)
    return grad


def _project(x_adv: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.min(torch.max(x_adv, x - eps), x + eps).clamp(0.0, 1.0)


def fgsm(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float) -> torch.Tensor:
    """One step of eps * sign(grad of the cross-entropy)."""
    return (x + eps * _input_grad(model, x, y).sign()).clamp(0.0, 1.0).detach()


def pgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, steps: int, step_size: float,
        random_start: bool, seed: int, indices: Sequence[int]) -> torch.Tensor:
    """``steps`` signed-gradient steps of ``step_size`` (absolute), projected onto the eps-ball and [0, 1]; the start
    is uniform in the ball when ``random_start`` (per-sample noise from (seed, index))."""
    x_adv = x.clone()
    if random_start and eps > 0:
        noise = torch.stack([torch.rand(x.shape[1:], generator=_sample_generator(seed, i)) for i in indices])
        x_adv = _project(x + (2 * noise.to(x.device) - 1) * eps, x, eps)
    for _ in range(steps):
        x_adv = _project(x_adv + step_size * _input_grad(model, x_adv, y).sign(), x, eps)
    return x_adv.detach()


def _margin(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """logit of the label minus the largest other logit (negative: misclassified). SPSA minimises it."""
    top2, classes = logits.topk(2, dim=1)
    own = logits.gather(1, y[:, None]).squeeze(1)
    other = torch.where(classes[:, 0] == y, top2[:, 1], top2[:, 0])
    return own - other


@torch.no_grad()
def _spsa_grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor, delta: float, directions: torch.Tensor,
               max_batch_size: int) -> torch.Tensor:
    """Mean over directions v of (f(x + delta v) - f(x - delta v)) / (2 delta v); directions: (N, S, C, H, W)."""
    n, s = directions.shape[:2]
    grad = torch.zeros_like(x)
    chunk = max(1, max_batch_size // (2 * n))  # directions per forward (x + and x -, for all N samples)
    for start in range(0, s, chunk):
        v = directions[:, start:start + chunk]  # (N, k, C, H, W)
        k = v.shape[1]
        xs = x[:, None].expand_as(v)
        inputs = torch.cat([(xs + delta * v).flatten(0, 1), (xs - delta * v).flatten(0, 1)])
        labels = y[:, None].expand(n, k).flatten().repeat(2)
        losses = _margin(model(inputs).float(), labels)
        df = (losses[: n * k] - losses[n * k:]).view(n, k, *([1] * (x.dim() - 1)))
        grad += (df / (2 * delta * v)).sum(dim=1)
    return grad / s


def spsa(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, lr: float, delta: float, nb_sample: int,
         nb_iter: int, max_batch_size: int, seed: int, indices: Sequence[int]) -> torch.Tensor:
    """SPSA (advertorch/torchattacks semantics): ``nb_iter`` Adam steps of ``lr`` on the perturbation, each from a
    gradient estimated with ``nb_sample`` Rademacher directions, clamped to the eps-ball and [0, 1] after each step."""
    generators = [_sample_generator(seed, i) for i in indices]
    dx = torch.zeros_like(x)
    optimizer = torch.optim.Adam([dx], lr=lr)
    for _ in range(nb_iter):
        # one direction per (sample, draw), shared by the channels as in advertorch (v has a single channel)
        signs = torch.stack([torch.randint(0, 2, (nb_sample, 1, *x.shape[2:]), generator=g, dtype=torch.float32)
                             for g in generators])
        directions = (2.0 * signs - 1.0).to(x.device, x.dtype).expand(-1, -1, x.shape[1], -1, -1)
        optimizer.zero_grad()
        dx.grad = _spsa_grad(model, x + dx, y, delta, directions, max_batch_size)
        optimizer.step()
        with torch.no_grad():
            dx += (x + dx.clamp(-eps, eps)).clamp(0.0, 1.0) - x - dx  # in place: Adam keeps tracking dx
    return _project(x + dx, x, eps).detach()  # exact bounds despite the float round trip through dx


def autoattack_library() -> str:
    """The AutoAttack implementation used, or an ImportError saying how to install it."""
    try:
        from importlib.metadata import version

        import pyautoattack  # noqa: F401
    except ImportError as exc:
        raise ImportError("the autoattack attack needs pyautoattack (Croce & Hein's AutoAttack code): "
                          "pip install pyautoattack==0.2.0, or drop it: "
                          "eval.adversarial.attacks=[fgsm,pgd,spsa]") from exc
    return f"pyautoattack {version('pyautoattack')} (Croce & Hein's reference AutoAttack)"


def autoattack(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, version: str, norm: str,
               seed: int, batch_size: int) -> tuple[torch.Tensor, dict[str, Any]]:
    """AutoAttack's ``run_standard_evaluation`` on (x, y). Returns the adversarial images and the attack settings
    that matter for comparisons (the 'standard' version uses 9 target classes for APGD-T and FAB-T)."""
    autoattack_library()
    from pyautoattack import AutoAttack

    adversary = AutoAttack(model, norm=norm, eps=eps, version=version, device=x.device, seed=seed)
    adversary.logger.setLevel(logging.WARNING)
    x_adv, _ = adversary.run_standard_evaluation(x, y, batch_size=batch_size)
    settings = {"attacks": list(adversary.attacks_to_run), "apgd_t_targets": adversary.apgd_targeted.n_target_classes,
                "fab_t_targets": adversary.fab.n_target_classes, "square_queries": adversary.square.n_queries}
    return x_adv.detach(), settings
