"""Train many toy models as one computation: stacked weights, ``torch.func.vmap``, a batched AdamW.

The runs of one chunk share a data realisation, hence their mini-batches (the batch order is a function of the data
seed and the epoch), and differ in initialisation, learning rate and weight decay. Their weights are stacked along a
leading run axis (``stack_module_state``); one vmapped forward gives every run's logits; the sum of the per-run mean
losses has the per-run gradients as its gradient (the runs share no weights); :class:`BatchedAdamW` then applies
``torch.optim.AdamW``'s update with a per-run lr and weight decay. tests/test_toy.py checks that this equals the same
runs trained one by one with ``torch.optim.AdamW``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state, vmap

from .data import ToySplit
from .model import ToyTransformer

__all__ = ["RunSpec", "BatchedAdamW", "batch_order", "train_chunk", "ChunkResult"]


@dataclass(frozen=True)
class RunSpec:
    lr: float
    weight_decay: float
    init_seed: int


def _adamw_update(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
                  exp_avg_sqs: list[torch.Tensor], lrs: list[torch.Tensor], decays: list[torch.Tensor],
                  bc1: torch.Tensor, bc2_sqrt: torch.Tensor, b1: float, b2: float, eps: float) -> None:
    # torch.optim.AdamW's single-tensor arithmetic, in its order, with lr / weight decay broadcast per run
    for p, g, m, v, lr, wd in zip(params, grads, exp_avgs, exp_avg_sqs, lrs, decays):
        p.mul_(1 - lr * wd)
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        p.sub_(m / ((v.sqrt() / bc2_sqrt) + eps) * (lr / bc1))


class BatchedAdamW:
    """``torch.optim.AdamW`` (amsgrad off, not maximize) on stacked weights, with a per-run lr and weight decay.

    The arithmetic follows torch's single-tensor implementation step for step, so a run's weights match what
    ``torch.optim.AdamW`` gives that run alone up to float rounding. ``compile=True`` fuses the update (it is a
    fifth of a CPU step in eager mode); the bias corrections are passed as tensors so the step count does not
    trigger a recompilation.
    """

    def __init__(self, params: Sequence[torch.Tensor], lr: torch.Tensor, weight_decay: torch.Tensor,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, compile: bool = False) -> None:
        self.params = list(params)
        shapes = [(-1,) + (1,) * (p.dim() - 1) for p in self.params]
        self.lrs = [lr.view(s) for s in shapes]  # (R, 1, ...) per parameter
        self.decays = [weight_decay.view(s) for s in shapes]
        self.betas, self.eps, self.step_count = betas, eps, 0
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self._update = torch.compile(_adamw_update) if compile else _adamw_update

    @torch.no_grad()
    def step(self) -> None:
        self.step_count += 1
        b1, b2 = self.betas
        bc1 = torch.tensor(1 - b1**self.step_count)
        bc2_sqrt = torch.tensor(math.sqrt(1 - b2**self.step_count))
        self._update(self.params, [p.grad for p in self.params], self.exp_avg, self.exp_avg_sq, self.lrs,
                     self.decays, bc1, bc2_sqrt, b1, b2, self.eps)
        for p in self.params:
            p.grad = None


def batch_order(data_seed: int, epoch: int, n: int, batch_size: int) -> list[torch.Tensor]:
    """The mini-batches (index tensors) of one epoch: a permutation seeded by (data seed, epoch), last one partial."""
    g = torch.Generator().manual_seed(int(data_seed) * 100_003 + int(epoch))
    return list(torch.randperm(n, generator=g).split(batch_size))


def init_model(attention: str, init_seed: int, **model_kwargs) -> ToyTransformer:
    torch.manual_seed(int(init_seed))
    return ToyTransformer(attention, **model_kwargs)


@dataclass
class ChunkResult:
    train_acc: torch.Tensor  # (R,) fraction
    test_acc: torch.Tensor  # (R,)
    key_norms: torch.Tensor  # (R, epochs + 1, 3): mean raw key norm of biased answer, unbiased answer, other tokens
    final_loss: torch.Tensor  # (R,) mean cross-entropy on the whole training set after training
    weights: dict[str, torch.Tensor]  # the trained weights, stacked along the run axis


def _evaluate(fn: Callable, params: dict, split: ToySplit, batch: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-run accuracy (fraction) and mean cross-entropy over ``split``."""
    correct, loss = 0, 0
    for i in range(0, len(split.y), batch):
        logits, y = fn(params, split.x[i:i + batch]), split.y[i:i + batch]  # (R, b, C), (b,)
        correct = correct + (logits.argmax(-1) == y).sum(-1)
        loss = loss + F.cross_entropy(logits.transpose(1, 2), y.expand(len(logits), -1), reduction="none").sum(-1)
    return correct.float() / len(split.y), loss / len(split.y)


def _key_norm_groups(key_norms: Callable, params: dict, probe: ToySplit) -> torch.Tensor:
    """(R, 3): mean ||k|| over biased answer tokens, unbiased answer tokens and non-answer tokens of ``probe``."""
    norms = key_norms(params, probe.x)  # (R, P, N)
    answer = torch.zeros(norms.shape[1:], dtype=torch.bool)
    answer[torch.arange(len(probe.y)), probe.answer_pos] = True
    groups = [answer & probe.biased[:, None], answer & ~probe.biased[:, None], ~answer]
    return torch.stack([norms[:, g].mean(-1) if g.any() else norms.new_full(norms.shape[:1], float("nan"))
                        for g in groups], dim=-1)


# The vmapped (and compiled) functions of the last formulation, reused by its next chunks: a fresh closure over a
# fresh module would make torch.compile trace again for every chunk, and after 8 traces of one function dynamo
# gives up and runs it eagerly (measured: 80 s instead of 35 s a chunk for qknorm_hs / qknorm_ds).
_PROGRAMS: dict[tuple, tuple[Callable, Callable, Callable]] = {}


def _programs(attention: str, model_kwargs: dict, n_runs: int, compile: bool) -> tuple[Callable, Callable, Callable]:
    """(training loss of all runs, key norms of all runs, logits of all runs) for stacked weights and one batch."""
    key = (attention, tuple(sorted(model_kwargs.items())), n_runs, compile)
    if key in _PROGRAMS:
        return _PROGRAMS[key]
    _PROGRAMS.clear()
    if compile:
        torch._dynamo.reset()  # another formulation: its graphs replace the last one's instead of piling up
    base = ToyTransformer(attention, **model_kwargs).to("meta")  # the code to run; weights come from the caller

    def logits_one(p: dict, x: torch.Tensor) -> torch.Tensor:
        return functional_call(base, p, (x,))

    logits_all = vmap(logits_one, in_dims=(0, None))  # every run sees the same batch

    def loss_fn(p: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = logits_all(p, x)  # (R, B, C)
        # sum over runs of each run's mean loss: its gradient w.r.t. run r's weights is run r's own gradient
        return F.cross_entropy(logits.flatten(0, 1), y.repeat(n_runs), reduction="sum") / len(y)

    keys_view = _KeysView(base)
    keys_all = vmap(lambda p, x: functional_call(keys_view, {f"m.{k}": v for k, v in p.items()}, (x,)),
                    in_dims=(0, None))

    def key_norms(p: dict, x: torch.Tensor) -> torch.Tensor:
        return keys_all(p, x).norm(dim=-1)

    programs = (loss_fn, key_norms, logits_all)
    if compile:  # evaluation too: after every epoch, the probe's key norms for all runs
        programs = tuple(torch.compile(f) for f in programs)
    _PROGRAMS[key] = programs
    return programs


def train_chunk(
    attention: str,
    runs: Sequence[RunSpec],
    train: ToySplit,
    test: ToySplit,
    data_seed: int,
    epochs: int,
    batch_size: int,
    model_kwargs: dict,
    probe_size: int = 256,
    compile: bool = False,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> ChunkResult:
    """Train ``runs`` (one data realisation) together; accuracies and key-norm trajectories per run."""
    models = [init_model(attention, r.init_seed, **model_kwargs) for r in runs]
    stacked, _ = stack_module_state(models)
    params = {k: v.detach().clone().requires_grad_() for k, v in stacked.items()}
    step_loss, key_norms, eval_logits = _programs(attention, model_kwargs, len(runs), compile)
    optim = BatchedAdamW(params.values(), torch.tensor([r.lr for r in runs]),
                         torch.tensor([r.weight_decay for r in runs]), betas=betas, eps=eps, compile=compile)
    probe = ToySplit(*(t[:probe_size] for t in (train.x, train.y, train.answer_pos, train.biased)))
    with torch.no_grad():
        trajectory = [_key_norm_groups(key_norms, params, probe)]
    for epoch in range(epochs):
        for idx in batch_order(data_seed, epoch, len(train.y), batch_size):
            x, y = train.x[idx], train.y[idx]
            loss = step_loss(params, x, y)
            loss.backward()
            optim.step()
        with torch.no_grad():
            trajectory.append(_key_norm_groups(key_norms, params, probe))
    with torch.no_grad():
        train_acc, final_loss = _evaluate(eval_logits, params, train)
        test_acc, _ = _evaluate(eval_logits, params, test)
    return ChunkResult(train_acc=train_acc, test_acc=test_acc, key_norms=torch.stack(trajectory, 1),
                       final_loss=final_loss, weights={k: v.detach() for k, v in params.items()})


class _KeysView(torch.nn.Module):
    """Exposes :meth:`ToyTransformer.keys` as ``forward`` so ``functional_call`` can run it with stacked weights."""

    def __init__(self, model: ToyTransformer) -> None:
        super().__init__()
        self.m = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.m.keys(x)[0]
