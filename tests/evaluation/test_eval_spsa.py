"""SPSA against cleverhans' algorithm written out plainly here (same seed, same perturbation), and the gradient
estimate against the true gradient of a linear model whose gradient differs per channel."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn

from quest.evaluation import spsa as S


def _generator(seed: int, index: int) -> torch.Generator:
    # the per-sample seeding the suite documents: numpy SeedSequence([seed, index]) -> a 32-bit torch seed
    return torch.Generator().manual_seed(int(np.random.SeedSequence([seed, index]).generate_state(1)[0]))


def _margin_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """cleverhans' _margin_logit_loss times -1 (untargeted): label logit minus the largest other one."""
    others = logits.clone()
    others[torch.arange(len(labels)), labels] = float("-inf")
    return logits.gather(1, labels[:, None]).squeeze(1) - others.max(dim=1).values


def cleverhans_spsa(model, x, y, eps, nb_iter, lr, delta, samples, clip, seed, indices, at_doubled_input,
                    random_start=True):
    """cleverhans 4.0.0 torch ``spsa`` (the authors' ImageAttack/spsa.py), one sample at a time, with its
    torch.rand_like calls drawn from the sample's generator. ``at_doubled_input``: the gradient call passes the clean
    x as cleverhans does (so the model sees x + x + delta v); otherwise the perturbation (the algorithm)."""
    lo, hi = clip if clip is not None else (-np.inf, np.inf)
    out = []
    for xs, ys, index in zip(x, y, indices):
        xs, ys, g = xs[None], ys[None], _generator(seed, index)
        # cleverhans draws in the default dtype (float32); the values are then used in the input's dtype
        perturbation = ((torch.rand(xs.shape, generator=g) * 2 - 1) * eps).to(xs.dtype)
        if not random_start:
            perturbation = torch.zeros_like(xs)
        perturbation.add_((torch.clamp(xs + perturbation.clamp(-eps, eps), lo, hi) - xs) - perturbation)
        optimizer = torch.optim.Adam([perturbation], lr=lr)

        def loss_fn(pert, xs=xs, ys=ys):  # cleverhans' loss_fn: the model at x + pert
            return _margin_loss(model(xs + pert), ys.expand(len(pert)))

        for _ in range(nb_iter):
            at = xs if at_doubled_input else perturbation
            delta_x = delta * torch.sign(torch.rand((samples, *xs.shape[1:]), generator=g) - 0.5).to(xs.dtype)
            delta_x = torch.cat([delta_x, -delta_x])
            with torch.no_grad():
                loss_vals = loss_fn(at + delta_x).view(-1, 1, 1, 1)
            perturbation.grad = torch.mean(loss_vals * torch.sign(delta_x), dim=0, keepdim=True) / delta
            optimizer.step()
            with torch.no_grad():
                perturbation.add_((torch.clamp(xs + perturbation.clamp(-eps, eps), lo, hi) - xs) - perturbation)
        out.append(torch.clamp(xs + perturbation.detach(), lo, hi))
    return torch.cat(out)


@pytest.fixture(scope="module")
def small():
    """A small conv net and 5 inputs with 3 channels (C x 6 x 6)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, 5)).eval()
    x = torch.rand(5, 3, 6, 6)
    with torch.no_grad():
        y = model(x).argmax(1)
    return model, x, y


SPSA_ARGS = dict(eps=0.05, lr=0.01, delta=0.01, nb_sample=16, nb_iter=6, max_batch_size=10, seed=2,
                 indices=[3, 10, 11, 40, 7])


def _spsa_against_reference(small, estimate_at, clip, reference_changes=None):
    """quest's SPSA and the reference, both in float64: quest evaluates the model on batches of ``max_batch_size``
    and the reference on all 2 x nb_sample directions at once, so in float32 the CPU's kernel choice for each batch
    shape moves the last bits, and six Adam steps (which divide by sqrt of the squared gradient) carry them to
    1e-6. In float64 the same algorithm with the same draws agrees to ~1e-15 per step; 1e-10 leaves room for
    that and is still 10^6 below what a changed draw or step moves (0.01)."""
    model, x, y = small
    model, x = copy.deepcopy(model).double(), x.double()
    a = SPSA_ARGS
    ours = S.spsa(model, x, y, a["eps"], a["lr"], a["delta"], a["nb_sample"], a["nb_iter"], a["max_batch_size"],
                  a["seed"], a["indices"], clip=clip, random_start=True, estimate_at=estimate_at)
    ref_args = {**a, **(reference_changes or {})}
    ref = cleverhans_spsa(model, x, y, ref_args["eps"], ref_args["nb_iter"], ref_args["lr"], ref_args["delta"],
                          ref_args["nb_sample"], clip, ref_args["seed"], ref_args["indices"],
                          at_doubled_input=estimate_at == "cleverhans_torch",
                          random_start=ref_args.get("random_start", True))
    return ours, ref, x


@pytest.mark.numerics
@pytest.mark.parametrize("estimate_at", ["iterate", "cleverhans_torch"])
@pytest.mark.parametrize("clip", [None, (0.0, 1.0)])
def test_same_seed_gives_cleverhans_perturbation(small, estimate_at, clip):
    ours, ref, x = _spsa_against_reference(small, estimate_at, clip)
    assert ours.dtype == torch.float64
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=0)
    assert (ours - x).abs().max() <= 0.05 + 1e-6
    assert (ours - x).abs().max() > 0.04  # moved: Adam steps of 0.01 from a start spread over the ball
    if clip is not None:
        assert ours.min() >= 0 and ours.max() <= 1


@pytest.mark.numerics
@pytest.mark.parametrize("change", [{"seed": 3}, {"indices": [3, 10, 11, 40, 8]}, {"random_start": False},
                                    {"nb_iter": 5}, {"lr": 0.011}, {"delta": 0.02}, {"nb_sample": 15}])
@pytest.mark.parametrize("estimate_at", ["iterate", "cleverhans_torch"])
def test_reference_comparison_fails_on_a_real_change(small, estimate_at, change):
    """The comparison above can fail: a reference that differs in one draw or one step is far outside 1e-10."""
    ours, ref, _ = _spsa_against_reference(small, estimate_at, (0.0, 1.0), reference_changes=change)
    assert (ours - ref).abs().max().item() > 1e-5


def test_unbounded_without_clip_and_independent_of_batching(small):
    model, x, y = small
    shifted = x + 0.99  # inputs near / above 1 (as normalised tensors are): nothing clamps them
    kwargs = dict(eps=0.05, lr=0.01, delta=0.01, nb_sample=8, nb_iter=3, max_batch_size=64, seed=0)
    full = S.spsa(model, shifted, y, indices=range(5), clip=None, **kwargs)
    assert full.max() > 1.0
    part = S.spsa(model, shifted[2:4], y[2:4], indices=range(2, 4), clip=None, **kwargs)
    torch.testing.assert_close(full[2:4], part, atol=0, rtol=0)


def test_no_random_start_starts_at_the_input(small):
    model, x, y = small
    # zero iterations: the start itself
    start = S.spsa(model, x, y, 0.05, 0.01, 0.01, 4, 0, 64, 0, range(5), clip=None, random_start=True)
    assert (start - x).abs().max() > 0.04
    none = S.spsa(model, x, y, 0.05, 0.01, 0.01, 4, 0, 64, 0, range(5), clip=None, random_start=False)
    torch.testing.assert_close(none, x, atol=0, rtol=0)


class _TwoClassLinear(nn.Module):
    """logits = (w . x, 0): the margin of label 0 is w . x, its gradient w everywhere."""

    def __init__(self, w: torch.Tensor):
        super().__init__()
        self.w = w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        score = (x * self.w).flatten(1).sum(1)
        return torch.stack([score, torch.zeros_like(score)], dim=1)


def test_gradient_estimate_is_unbiased_per_channel():
    shape = (3, 4, 4)
    gen = torch.Generator().manual_seed(0)
    # the channels' gradients differ, in sign too: channel 0 positive, 1 negative, 2 mixed
    w = torch.randn(shape, generator=gen).abs() * torch.tensor([1.0, -1.0, 0.5]).view(3, 1, 1)
    w[2, :2] *= -1
    model, x, y = _TwoClassLinear(w), torch.full((1, *shape), 0.5), torch.tensor([0])
    x_req = x.clone().requires_grad_(True)
    (true_grad,) = torch.autograd.grad(_margin_loss(model(x_req), y).sum(), x_req)
    torch.testing.assert_close(true_grad[0], w)

    draws = 20000
    directions = S.spsa_directions(torch.Generator().manual_seed(1), draws, shape)
    estimate = S.spsa_gradient(model, x, y, delta=0.01, directions=directions, max_batch_size=4096)[0]
    # each element's estimate has std ||w|| / sqrt(draws) (the other elements' terms are the noise)
    tolerance = 5 * w.norm().item() / draws ** 0.5
    assert (estimate - w).abs().max().item() < tolerance
    for c in range(3):  # and the per-channel means are right, not the mean over channels
        assert abs((estimate[c] - w[c]).mean().item()) < tolerance

    # the old directions, one sign per pixel shared by the channels, estimate sum_c w_c for every channel instead
    shared = directions[:, :1].expand(-1, *shape)
    biased = S.spsa_gradient(model, x, y, delta=0.01, directions=shared, max_batch_size=4096)[0]
    assert (biased - w.sum(0, keepdim=True)).abs().max().item() < 3 * tolerance
    assert (biased - w).abs().max().item() > 10 * tolerance


def test_directions_are_signs_drawn_per_element():
    d = S.spsa_directions(torch.Generator().manual_seed(0), 4000, (3, 5, 5))
    assert set(d.unique().tolist()) == {-1.0, 1.0}
    # all three channels agree with probability 1/4 for independent signs (1 when shared)
    agree = ((d[:, 0] == d[:, 1]) & (d[:, 1] == d[:, 2])).float().mean().item()
    assert abs(agree - 0.25) < 0.02
    assert abs(d.mean().item()) < 0.02
