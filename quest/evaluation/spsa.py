"""SPSA (Uesato et al. 2018) with the semantics of cleverhans 4.0.0's torch ``spsa``, the attack the
Elliptical-attention code ran (``ImageAttack/spsa.py`` in KurtPask/Elliptical-Attention @ 5ae39ee is a copy of it).

Per sample: a start drawn uniformly in the eps-ball, then ``nb_iter`` Adam steps (lr ``lr``) on the perturbation,
each with the gradient of the margin loss (label logit minus the largest other logit, minimised) estimated from
``nb_sample`` Rademacher directions drawn per element (every pixel of every channel its own sign), each step
projected back onto the eps-ball and, when given, the bounds ``clip``.

Two departures of earlier quest code from every reference are gone: its directions were shared by the colour
channels (advertorch's ``vb = torch.empty_like(xb[:, 0:1, ...])`` slices the axis of the expanded batch copies, so
advertorch's are per element too), and it had no random start.

Where the gradient is estimated (``estimate_at``):

- ``iterate``: at the current adversarial input x + perturbation, as the algorithm is defined (default);
- ``cleverhans_torch``: where cleverhans' torch code and the authors' copy estimate it. They call
  ``_compute_spsa_gradient(loss_fn, x, ...)`` with the clean x, and that evaluates ``loss_fn(x + delta_x)``, whose
  ``loss_fn(pert)`` is ``model(x + pert)``: the model sees 2x +- delta v at every iteration, whatever the
  perturbation (cleverhans issue #1249, open). The Tables 3/4 SPSA numbers were measured with this.

The random numbers of sample i come from one generator seeded from (seed, i), drawn in cleverhans' order (the
start, then each iteration's directions), so a sample's result does not depend on batching or process count.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn as nn

__all__ = ["ESTIMATE_AT", "sample_generator", "spsa", "spsa_directions", "spsa_gradient", "margin"]

ESTIMATE_AT = ("iterate", "cleverhans_torch")
Bounds = tuple[float, float] | None
# told (iterations done, iterations in all) after each iteration, for progress lines; counted on the host
OnIteration = Callable[[int, int], None] | None


def sample_generator(seed: int, index: int) -> torch.Generator:
    """A CPU generator for one sample, seeded from (seed, data-set index) through numpy's SeedSequence."""
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, index]).generate_state(1)[0]))


def margin(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Logit of the label minus the largest other logit (negative: misclassified). SPSA minimises it."""
    top2, classes = logits.topk(2, dim=1)
    own = logits.gather(1, y[:, None]).squeeze(1)
    other = torch.where(classes[:, 0] == y, top2[:, 1], top2[:, 0])
    return own - other


def spsa_directions(generator: torch.Generator, nb_sample: int, shape: Sequence[int]) -> torch.Tensor:
    """``nb_sample`` Rademacher directions of one sample, (nb_sample, *shape), one independent sign per element,
    drawn as cleverhans does: sign(U[0, 1) - 0.5)."""
    return torch.sign(torch.rand((nb_sample, *shape), generator=generator) - 0.5)


@torch.no_grad()
def spsa_gradient(model: nn.Module, x: torch.Tensor, y: torch.Tensor, delta: float, directions: torch.Tensor,
                  max_batch_size: int) -> torch.Tensor:
    """The SPSA estimate at one point ``x`` (1, *shape) of the gradient of ``margin(model(.), y)``:
    mean over directions v of (f(x + delta v) - f(x - delta v)) / (2 delta) * v, from ``2 * len(directions)`` model
    evaluations, at most ``max_batch_size`` per forward."""
    chunk = max(1, max_batch_size // 2)  # directions per forward: x + and x - for each
    grad = torch.zeros_like(x[0])
    for start in range(0, len(directions), chunk):
        v = directions[start:start + chunk]
        inputs = torch.cat([x + delta * v, x - delta * v])
        logits = model(inputs)
        # half-precision logits are scored in float32; float64 stays float64 (the reference tests compare in it)
        losses = margin(logits.to(torch.promote_types(logits.dtype, torch.float32)), y.expand(len(inputs)))
        df = (losses[: len(v)] - losses[len(v):]).view(-1, *([1] * (v.dim() - 1)))
        grad += (df * v).sum(dim=0)
    return (grad / (2 * delta * len(directions)))[None]


def _project_(perturbation: torch.Tensor, x: torch.Tensor, eps: float, clip: Bounds) -> None:
    """In place (Adam keeps tracking the tensor): the perturbation clamped to the eps-ball, then x + it to ``clip``."""
    new = x + perturbation.clamp(-eps, eps)
    if clip is not None:
        new = new.clamp(*clip)
    perturbation.copy_(new - x)


def _spsa_one(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, lr: float, delta: float,
              nb_sample: int, nb_iter: int, max_batch_size: int, generator: torch.Generator, clip: Bounds,
              random_start: bool, estimate_at: str, on_iteration: Callable[[int], None]) -> torch.Tensor:
    shape = x.shape[1:]
    if random_start:
        start = (torch.rand(tuple(shape), generator=generator) * 2 - 1) * eps
        perturbation = start[None].to(x.device, x.dtype)
    else:
        perturbation = torch.zeros_like(x)
    _project_(perturbation, x, eps, clip)
    optimizer = torch.optim.Adam([perturbation], lr=lr)
    for iteration in range(nb_iter):
        point = x + perturbation if estimate_at == "iterate" else x + x
        directions = spsa_directions(generator, nb_sample, shape).to(x.device, x.dtype)
        perturbation.grad = spsa_gradient(model, point.detach(), y, delta, directions, max_batch_size)
        optimizer.step()
        with torch.no_grad():
            _project_(perturbation, x, eps, clip)
        on_iteration(iteration + 1)
    adv = x + perturbation.detach()
    return adv if clip is None else adv.clamp(*clip)


def spsa(model: nn.Module, x: torch.Tensor, y: torch.Tensor, eps: float, lr: float, delta: float, nb_sample: int,
         nb_iter: int, max_batch_size: int, seed: int, indices: Sequence[int], clip: Bounds = (0.0, 1.0),
         random_start: bool = True, estimate_at: str = "iterate", on_iteration: OnIteration = None) -> torch.Tensor:
    """SPSA on each sample of the batch ``x`` (labels ``y``) with its own generator from (seed, indices[i]); returns
    inputs within eps of x (l_inf) and within ``clip`` when given. eps 0 returns x unchanged (as cleverhans).
    ``on_iteration(done, total)`` follows the batch's ``len(indices) * nb_iter`` iterations."""
    if estimate_at not in ESTIMATE_AT:
        raise ValueError(f"spsa estimate_at must be one of {ESTIMATE_AT}, got {estimate_at!r}")
    if eps == 0:
        return x.clone()
    total = len(indices) * nb_iter

    def tell(i: int) -> Callable[[int], None]:
        return (lambda done: on_iteration(i * nb_iter + done, total)) if on_iteration else (lambda done: None)

    out = [_spsa_one(model, x[i:i + 1], y[i:i + 1], eps, lr, delta, nb_sample, nb_iter, max_batch_size,
                     sample_generator(seed, index), clip, random_start, estimate_at, tell(i))
           for i, index in enumerate(indices)]
    return torch.cat(out).detach()
