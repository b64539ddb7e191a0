"""Train many toy models as one computation: the engine of the toy study.

The runs of one chunk share a data realisation, hence their mini-batches (the batch order is a function of the data
seed and the epoch), and differ in initialisation, learning rate and weight decay. Their weights are kept as one
stack, a leading run axis on every parameter (:class:`ParamLayout`); the program's ``logits`` computes every run's
logits for the shared batch with the run axis explicit; ``torch.func.grad`` of the sum of the per-run mean losses
gives every run its own gradient (the runs share no weights); AdamW is applied with ``torch.optim.AdamW``'s
arithmetic and a per-run lr and weight decay. tests/toy/test_toy.py checks that this equals the same runs trained one by
one with ``torch.optim.AdamW``.

Why it is written this way (profile and measurements: docs/benchmarks.md, "Toy study"):

- Only the [CLS] output reaches the loss, and in a one-layer model it depends on the [CLS] row of the attention alone.
  The one tensor of size runs x batch x tokens x width is then the keys; the values are never formed: the attention-
  weighted sum of LN(x + p) is taken first and projected once per sample.
- LN(x_t + p_t) = (xc_t + pc_t) * rstd_t with xc the centred input (the same for every run) and pc the centred
  positional embedding (per run), rstd from var(x) + var(p) + 2 cov(x, p). So the keys of all runs come from one
  matmul of the shared xc with every run's W_k diag(gamma) instead of a per-run LayerNorm and matmul of x + p. The
  [CLS] token is the token with x = 0 and p = cls_token + pos_embed[0], so all tokens go through the same code.
- The attention formulation enters only through its own ``transform_qk`` (q, k -> q', k', scale), run per run
  under ``torch.func.vmap`` with that run's parameters (``functional_call``), so any registered attention works and
  the engine has no branch on the formulation.
- On a CPU the runs are trained in tiles of ``runs_per_call`` (50 by default): one compiled call does the forward,
  the backward and the AdamW update of one tile for one batch. A tile's tensors (50 x 32 x 21 x 20 floats, 2.7 MB)
  stay in a core's L2 cache through the many element-wise passes of forward and backward; the whole chunk's would
  not (measured: 150 runs at once are about 1.5x slower per run-step than tiles of 15). On a GPU a tile is the whole
  chunk.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, vmap

from .compiled import call_tiles, compile_options, compiled_adamw_step, default_runs_per_call
from .data import ToySplit
from .model import ToyTransformer

__all__ = ["RunSpec", "ParamLayout", "batch_order", "train_chunk", "ChunkResult", "init_model"]


@dataclass(frozen=True)
class RunSpec:
    lr: float
    weight_decay: float
    init_seed: int


def batch_order(data_seed: int, epoch: int, n: int, batch_size: int) -> list[torch.Tensor]:
    """The mini-batches (index tensors) of one epoch: a permutation seeded by (data seed, epoch), last one partial."""
    g = torch.Generator().manual_seed(int(data_seed) * 100_003 + int(epoch))
    return list(torch.randperm(n, generator=g).split(batch_size))


def init_model(attention: str, init_seed: int, param_init: Mapping[str, float] | None = None,
               **model_kwargs) -> ToyTransformer:
    """One run's model: ``torch.manual_seed(init_seed)``, then :class:`ToyTransformer`; ``param_init`` sets named
    parameters to a constant afterwards (e.g. ``{"attn.qk_scale": 0.2236}``, QKNorm's scale at 1 / sqrt(d))."""
    torch.manual_seed(int(init_seed))
    model = ToyTransformer(attention, **model_kwargs)
    names = dict(model.named_parameters())
    for name, value in (param_init or {}).items():
        if name not in names:
            raise ValueError(f"toy model ({attention}): no parameter {name!r} to initialise; its parameters are "
                             f"{sorted(names)}")
        with torch.no_grad():
            names[name].fill_(float(value))
    return model


class ParamLayout:
    """The parameters of a :class:`ToyTransformer` (names, shapes), stacked along a leading run axis."""

    def __init__(self, template: nn.Module) -> None:
        if list(template.buffers()):
            raise ValueError("the toy engine stacks parameters only; this model has buffers")
        self.names = [n for n, _ in template.named_parameters()]
        self.shapes = {n: tuple(p.shape) for n, p in template.named_parameters()}

    def stack(self, models: Sequence[nn.Module]) -> dict[str, torch.Tensor]:
        """name -> (runs, *shape): the models' parameters, detached copies."""
        per_model = [dict(m.named_parameters()) for m in models]
        return {n: torch.stack([p[n].detach() for p in per_model]) for n in self.names}


class _Row(nn.Module):
    """The [CLS] row of the attention for one run: the formulation's transform_qk, then the softmax."""

    def __init__(self, attn: nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        # q (D,): the run's [CLS] query; k (B, T, D): its keys -> (B, T) attention weights
        B = k.shape[0]
        q, k, scale = self.attn.transform_qk(q.expand(B, 1, 1, q.shape[-1]), k.unsqueeze(1))
        return (scale * q @ k.transpose(-2, -1)).softmax(-1)[:, 0, 0]


def _check_architecture(model: ToyTransformer) -> None:
    """The engine computes ToyTransformer's function by hand: refuse a model it would not compute exactly."""
    mlp = model.mlp
    ok = (isinstance(mlp.norm, nn.Identity) and mlp.drop1.p == 0 and mlp.drop2.p == 0 and model.attn.num_heads == 1
          and isinstance(model.attn.norm, nn.Identity))
    if not ok:
        raise ValueError("the toy engine computes a one-head ToyTransformer with timm's plain Mlp; this model differs")


class _Program:
    """The batched functions of one formulation (and model shape): logits, raw key norms, the training step."""

    def __init__(self, attention: str, model_kwargs: Mapping, compile: bool, betas: tuple[float, float],
                 eps: float, frozen: Sequence[str] = (), device_type: str = "cpu",
                 options: Mapping[str, bool] | None = None, in_place: bool | None = None) -> None:
        base = ToyTransformer(attention, **model_kwargs).to("meta")  # the code to run; weights come from the caller
        _check_architecture(base)
        self.layout = ParamLayout(base)
        unknown = sorted(set(frozen) - set(self.layout.names))
        if unknown:
            raise ValueError(f"toy model ({attention}): cannot freeze {unknown}; its parameters are {self.layout.names}")
        self.frozen = frozenset(frozen)
        self.attn_names = [n for n in self.layout.names if n.startswith("attn.")]
        self.ln_eps = (base.norm1.eps, base.norm2.eps, base.norm.eps)
        self.act = base.mlp.act
        row = _Row(base.attn)
        self.rows = vmap(lambda p, q, k: functional_call(row, p, (q, k)))  # over runs: (R, D), (R, B, T, D)

        def loss(w: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = self.logits(w, x)  # (R, B, C)
            # sum over runs of each run's mean loss: its gradient w.r.t. run r's weights is run r's own gradient
            return F.cross_entropy(logits.flatten(0, 1), y.repeat(logits.shape[0]), reduction="sum") / len(y)

        grad = torch.func.grad(loss)

        def eager_step(p, exp_avg, exp_avg_sq, lr, wd, x, y, bc1, bc2_sqrt) -> None:
            # Without compilation every op is a dispatch: plain autograd (functorch's grad wraps every op) and
            # foreach updates keep the op count, and so a small chunk's step time, low (the quick grid's case).
            names = [n for n in p if n not in self.frozen]
            with torch.enable_grad():
                leaves = {n: t.detach().requires_grad_(n not in self.frozen) for n, t in p.items()}
                grads = torch.autograd.grad(loss(leaves, x, y), [leaves[n] for n in names])
            foreach_adamw_([p[n] for n in names], [exp_avg[n] for n in names], [exp_avg_sq[n] for n in names],
                           list(grads), lr, wd, bc1, bc2_sqrt, betas, eps)

        options = compile_options(device_type) if options is None else dict(options)  # inductor's, for the step
        self.step = (compiled_adamw_step(grad, self.frozen, betas, eps, options, in_place) if compile
                     else torch.no_grad()(eager_step))

    # --- the model, batched over runs -----------------------------------------------------------------------------
    def _tokens(self, w: dict, x: torch.Tensor):
        """LN(x_t + p_t) of every token as (xc + pc) * rstd (before LayerNorm's affine), and the [CLS] input."""
        B, N, D = x.shape
        pos = w["pos_embed"]  # (R, T, D), T = N + 1
        cls = w["cls_token"][:, 0] + pos[:, 0]  # (R, D): the [CLS] token's input, the same for every sample
        xt = torch.cat([x.new_zeros(B, 1, D), x], 1)  # (B, T, D): shared by every run; x = 0 at [CLS] ...
        pt = torch.cat([cls[:, None], pos[:, 1:]], 1)  # (R, T, D): ... and p = cls_token + pos_embed[0] there
        xc = xt - xt.mean(-1, keepdim=True)
        pc = pt - pt.mean(-1, keepdim=True)
        var = xc.square().mean(-1) + pc.square().mean(-1)[:, None] + (2.0 / D) * torch.einsum("btd,rtd->rbt", xc, pc)
        return xc, pc, (var + self.ln_eps[0]).rsqrt(), cls  # rstd (R, B, T)

    def _keys(self, w: dict, xc, pc, rstd) -> torch.Tensor:
        """Raw keys LN(x + p) W_k^T + b_k of every token, (R, B, T, D)."""
        B, T, D = xc.shape
        R = pc.shape[0]
        wk = w["attn.qkv.weight"][:, D:2 * D]  # (R, D, D)
        g1, b1 = w["norm1.weight"], w["norm1.bias"]
        a = wk * g1[:, None, :]  # W_k diag(gamma)
        ck = torch.einsum("rde,re->rd", wk, b1) + w["attn.qkv.bias"][:, D:2 * D]  # W_k beta + b_k
        kx = torch.matmul(xc.reshape(B * T, D), a.transpose(1, 2)).view(R, B, T, D)
        kp = torch.einsum("rte,rde->rtd", pc, a)
        return (kx + kp[:, None]) * rstd[..., None] + ck[:, None, None]

    @staticmethod
    def _linear(x: torch.Tensor, w: dict, name: str) -> torch.Tensor:
        """(R, B, in) -> (R, B, out) with every run's own nn.Linear ``name``."""
        return torch.baddbmm(w[f"{name}.bias"][:, None], x, w[f"{name}.weight"].transpose(1, 2))

    @staticmethod
    def _ln(x: torch.Tensor, w: dict, name: str, eps: float) -> torch.Tensor:
        weight, bias = w[f"{name}.weight"], w[f"{name}.bias"]
        if x.dim() == 3:
            weight, bias = weight[:, None], bias[:, None]
        return F.layer_norm(x, x.shape[-1:], eps=eps) * weight + bias

    def logits(self, w: dict, x: torch.Tensor) -> torch.Tensor:
        """ToyTransformer's forward for every run: w name -> (R, *shape), x (B, N, D) shared -> logits (R, B, C)."""
        D = x.shape[-1]
        xc, pc, rstd, cls = self._tokens(w, x)
        q = torch.einsum("re,rde->rd", self._ln(cls, w, "norm1", self.ln_eps[0]), w["attn.qkv.weight"][:, :D]) \
            + w["attn.qkv.bias"][:, :D]
        attn = self.rows({n: w[n] for n in self.attn_names}, q, self._keys(w, xc, pc, rstd))  # (R, B, T)
        # sum_t a_t v_t = W_v (gamma * sum_t a_t (xc_t + pc_t) rstd_t + beta) + b_v, as the a_t sum to 1
        a = attn * rstd
        h = torch.einsum("rbt,btd->rbd", a, xc) + torch.bmm(a, pc)
        h = h * w["norm1.weight"][:, None] + w["norm1.bias"][:, None]
        wv, bv = w["attn.qkv.weight"][:, 2 * D:], w["attn.qkv.bias"][:, 2 * D:]
        v = torch.baddbmm(bv[:, None], h, wv.transpose(1, 2))
        out = cls[:, None] + self._linear(v, w, "attn.proj")  # the [CLS] output of the attention block, (R, B, D)
        out = out + self._linear(self.act(self._linear(self._ln(out, w, "norm2", self.ln_eps[1]), w, "mlp.fc1")),
                                 w, "mlp.fc2")
        return self._linear(self._ln(out, w, "norm", self.ln_eps[2]), w, "head")

    def key_norms(self, w: dict, x: torch.Tensor) -> torch.Tensor:
        """||k|| of every data token (raw keys, before any normalisation): (R, B, N)."""
        xc, pc, rstd, _ = self._tokens(w, x)
        return torch.linalg.vector_norm(self._keys(w, xc, pc, rstd)[:, :, 1:], dim=-1)


def foreach_adamw_(ws: list[torch.Tensor], ms: list[torch.Tensor], vs: list[torch.Tensor], grads: list[torch.Tensor],
                   lr: torch.Tensor, wd: torch.Tensor, bc1: torch.Tensor, bc2_sqrt: torch.Tensor,
                   betas: tuple[float, float], eps: float) -> None:
    """torch.optim.AdamW's arithmetic as foreach ops, in place, with a per-run lr and weight decay ((R,) tensors):
    weights, first and second moments and gradients are lists of (R, *shape) tensors."""
    b1, b2 = betas
    shapes = [(-1,) + (1,) * (w.dim() - 1) for w in ws]
    decay, step_size = 1 - lr * wd, lr / bc1
    torch._foreach_mul_(ws, [decay.view(sh) for sh in shapes])
    torch._foreach_lerp_(ms, grads, 1 - b1)
    torch._foreach_mul_(vs, b2)
    torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, float(bc2_sqrt))
    torch._foreach_add_(denom, eps)
    update = torch._foreach_div(ms, denom)
    torch._foreach_mul_(update, [step_size.view(sh) for sh in shapes])
    torch._foreach_sub_(ws, update)


# The programs of the last formulation, reused by its next chunks: a fresh closure would make torch.compile trace
# again for every chunk, and after 8 traces of one function dynamo gives up and runs it eagerly.
_PROGRAMS: dict[tuple, _Program] = {}


def _program(attention: str, model_kwargs: Mapping, compile: bool, betas: tuple[float, float], eps: float,
             frozen: Sequence[str] = (), device_type: str = "cpu") -> _Program:
    key = (attention, tuple(sorted(model_kwargs.items())), compile, tuple(betas), eps, tuple(sorted(frozen)),
           device_type)
    if key not in _PROGRAMS:
        _PROGRAMS.clear()
        if compile:
            torch._dynamo.reset()  # another formulation: its graphs replace the last one's instead of piling up
        _PROGRAMS[key] = _Program(attention, model_kwargs, compile, tuple(betas), eps, frozen, device_type)
    return _PROGRAMS[key]


@dataclass
class ChunkResult:
    train_acc: torch.Tensor  # (R,) fraction
    test_acc: torch.Tensor  # (R,) on the first test set
    key_norms: torch.Tensor  # (R, epochs + 1, 3): mean raw key norm of biased answer, unbiased answer, other tokens
    #                          ((R, 0, 3) with probe_size=0)
    final_loss: torch.Tensor  # (R,) mean cross-entropy on the whole training set after training
    weights: dict[str, torch.Tensor]  # the trained weights, stacked along the run axis
    test_accs: dict[str, torch.Tensor] = field(default_factory=dict)  # (R,) per named test set
    seconds: dict[str, float] = field(default_factory=dict)  # wall time in training steps, key-norm probes, evaluation


@torch.no_grad()
def _evaluate(prog: _Program, w: dict, split: ToySplit, batch: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-run accuracy (fraction) and mean cross-entropy over ``split``."""
    correct, loss = 0, 0
    for i in range(0, len(split.y), batch):
        logits, y = prog.logits(w, split.x[i:i + batch]), split.y[i:i + batch]  # (R, b, C), (b,)
        correct = correct + (logits.argmax(-1) == y).sum(-1)
        loss = loss + F.cross_entropy(logits.transpose(1, 2), y.expand(len(logits), -1), reduction="none").sum(-1)
    return correct.float() / len(split.y), loss / len(split.y)


@torch.no_grad()
def _key_norm_groups(prog: _Program, w: dict, probe: ToySplit) -> torch.Tensor:
    """(R, 3): mean ||k|| over biased answer tokens, unbiased answer tokens and non-answer tokens of ``probe``."""
    norms = prog.key_norms(w, probe.x)  # (R, P, N)
    answer = torch.zeros(norms.shape[1:], dtype=torch.bool, device=norms.device)
    answer[torch.arange(len(probe.y), device=norms.device), probe.answer_pos] = True
    groups = [answer & probe.biased[:, None], answer & ~probe.biased[:, None], ~answer]
    return torch.stack([norms[:, g].mean(-1) if g.any() else norms.new_full(norms.shape[:1], float("nan"))
                        for g in groups], dim=-1)


def _to(split: ToySplit, device: torch.device, dtype: torch.dtype) -> ToySplit:
    return ToySplit(split.x.to(device, dtype), *(t.to(device) for t in (split.y, split.answer_pos, split.biased)))


def train_chunk(
    attention: str,
    runs: Sequence[RunSpec],
    train: ToySplit,
    test: ToySplit | Mapping[str, ToySplit],
    data_seed: int,
    epochs: int,
    batch_size: int,
    model_kwargs: dict,
    probe_size: int = 256,
    compile: bool = False,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    device: str | torch.device = "cpu",
    runs_per_call: int | None = None,
    param_init: Mapping[str, float] | None = None,
    frozen: Sequence[str] = (),
    on_epoch: Callable[[int], None] | None = None,
    dtype: torch.dtype = torch.float32,
) -> ChunkResult:
    """Train ``runs`` (one data realisation) together; accuracies and key-norm trajectories per run.

    ``test``: one test split, or several by name (all evaluated; ``test_acc`` is the first). ``param_init`` /
    ``frozen``: parameters set to a constant at initialisation / never updated (no gradient step, no weight decay).
    ``dtype``: of weights and data (float64 for the equivalence tests).
    """
    device = torch.device(device)
    tests = dict(test) if isinstance(test, Mapping) else {"test": test}
    prog = _program(attention, model_kwargs, compile, betas, eps, frozen, device.type)
    models = [init_model(attention, r.init_seed, param_init, **model_kwargs) for r in runs]
    params = {k: v.to(device, dtype) for k, v in prog.layout.stack(models).items()}
    lrs = torch.tensor([r.lr for r in runs], device=device, dtype=dtype)
    wds = torch.tensor([r.weight_decay for r in runs], device=device, dtype=dtype)
    tiles = []
    for s in call_tiles(len(runs), runs_per_call or default_runs_per_call(device)):
        p = {k: v[s].clone() for k, v in params.items()}
        tiles.append((p, {k: torch.zeros_like(v) for k, v in p.items()}, {k: torch.zeros_like(v) for k, v in p.items()},
                      lrs[s], wds[s]))
    train_d = _to(train, device, dtype)
    tests_d = {k: _to(v, device, dtype) for k, v in tests.items()}
    probe = ToySplit(*(t[:probe_size] for t in (train_d.x, train_d.y, train_d.answer_pos, train_d.biased)))

    def key_norm_groups() -> list[torch.Tensor]:
        if not probe_size:
            return []
        return [torch.cat([_key_norm_groups(prog, t[0], probe) for t in tiles])]

    clock = {"steps": 0.0, "probe": 0.0, "eval": 0.0}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    trajectory = key_norm_groups()
    b1, b2 = betas
    step = 0
    # AdamW's bias corrections as tensors, so the step count does not trigger a recompilation; written in place by a
    # kernel whose argument is the value (fill_), where a new tensor from a Python number would be a copy to the
    # device that waits for it to finish its queue: on a GPU, no host synchronisation inside an epoch
    bc1, bc2_sqrt = (torch.empty((), device=device, dtype=dtype) for _ in range(2))
    for epoch in range(epochs):
        sync()
        t1 = time.perf_counter()
        clock["probe"] += t1 - t0
        # the epoch's batches sent to the device in one copy (the same batches batch_order gives), not one a step
        for idx in torch.cat(batch_order(data_seed, epoch, len(train.y), batch_size)).to(device).split(batch_size):
            x, y = train_d.x[idx], train_d.y[idx]
            step += 1
            bc1.fill_(1 - b1**step)
            bc2_sqrt.fill_(math.sqrt(1 - b2**step))
            for p, m, v, lr, wd in tiles:
                prog.step(p, m, v, lr, wd, x, y, bc1, bc2_sqrt)
        sync()
        t0 = time.perf_counter()
        clock["steps"] += t0 - t1
        trajectory += key_norm_groups()
        if on_epoch is not None:
            on_epoch(epoch)
    sync()
    t1 = time.perf_counter()
    clock["probe"] += t1 - t0
    results: dict[str, list] = {"train": [], **{k: [] for k in tests_d}}
    for w, *_ in tiles:
        results["train"].append(_evaluate(prog, w, train_d))
        for k, split in tests_d.items():
            results[k].append(_evaluate(prog, w, split))
    acc = {k: torch.cat([a for a, _ in v]).cpu() for k, v in results.items()}
    final_loss = torch.cat([loss for _, loss in results["train"]]).cpu()
    weights = {k: torch.cat([t[0][k] for t in tiles]).cpu() for k in prog.layout.names}
    test_accs = {k: acc[k] for k in tests_d}
    clock["eval"] = time.perf_counter() - t1
    return ChunkResult(train_acc=acc["train"], test_acc=next(iter(test_accs.values())),
                       key_norms=torch.stack(trajectory, 1).cpu() if trajectory else torch.empty(len(runs), 0, 3),
                       final_loss=final_loss, weights=weights,
                       test_accs=test_accs, seconds=clock)
