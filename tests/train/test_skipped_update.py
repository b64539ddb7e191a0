"""A skipped update is as if never taken (docs/training.md, "A skipped update"): after k - 1 good steps and a bad
k-th (a NaN loss the divergence check catches, or an fp16 gradient overflow the loss scaler catches), the weights,
the EMA and every tensor of the optimizer's state equal bit for bit those of a run stopped after the k - 1 good
steps, and the next good step is the one that run would take. Over the optimizers a recipe can name (built by
quest.train.builders, as a run builds them), the step that goes bad (the first included) and the precisions."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from timm.utils import ModelEmaV3

from quest.runtime.distributed import DistContext
from quest.train.builders import _optimizer
from quest.train.trainer import Run
from quest.train.update import decided_on_host, host_counted, skippable_ema_update, skippable_step

from ..helpers import FAST, compose_cfg

#: recipe.opt values, each with the state it keeps: fused (Adam, AdamW, SGD and its momentum / nesterov forms) and
#: timm's own (Lamb: DeiT-III's; the others any recipe may name)
OPTIMIZERS = ("adamw", "adam", "sgd", "momentum", "nesterov", "lamb", "nadamw", "lion", "adabelief", "radam",
              "rmsproptf", "adan", "laprop", "adopt", "mars")
#: those that keep a step count on the host (a param group's, or a 0-d CPU tensor per parameter): under fp16 they read
#: the decision on the host and are exact; a NaN loss's skip (a divergence: the run ends at the next read) advances
#: the count, their tensors restored (docs/training.md)
HOST_COUNTED = {"lamb": ["param_groups[].step"], "nadamw": ["state[].step"], "adabelief": ["state[].step"],
                "radam": ["state[].step"], "adan": ["param_groups[].step"],
                "laprop": ["state[].exp_avg_lr_1", "state[].exp_avg_lr_2", "state[].step"],
                "adopt": ["state[].step"], "mars": ["state[].step"], "rmsproptf": ["state[].step"]}


def _build(opt: str, fused: bool | None = None) -> tuple[torch.nn.Module, torch.optim.Optimizer, ModelEmaV3]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    recipe = SimpleNamespace(opt=opt, opt_eps=1e-8, opt_betas=None, weight_decay=0.05, momentum=0.9)
    optimizer = _optimizer(model, recipe, lr=0.1)
    if fused is False:  # torch's SGD without its fused kernel: the select path, and its lazily created buffer
        for group in optimizer.param_groups:
            group["fused"] = False
    return model, optimizer, ModelEmaV3(model, decay=0.9)


def _step(model, optimizer, ema, scaler, index: int, bad: str | None) -> None:
    """One optimizer step as Run.train_step takes it: the scaled backward, unscale, the skip decided on the device
    (the guard's flag for a NaN loss; the scaler's for an overflow), the update, the scale update, the EMA."""
    g = torch.Generator().manual_seed(index)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
    loss = torch.nn.functional.cross_entropy(model(x), y)
    if bad == "nan":
        loss = loss * float("nan")
    elif bad == "overflow":
        loss = loss * float("inf")  # what fp16 does to a scaled loss that overflows
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    skip = torch.tensor(float(bad == "nan"))  # the guard's flag (it sees the loss; the scaler owns the gradients)
    if scaler.is_enabled():
        skip = torch.maximum(skip, (~norm.isfinite()).float())
    skippable_step(optimizer, skip, decided_on_host(optimizer, scaler.is_enabled()))
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    skippable_ema_update(ema, model, index + 1, skip)


def _states(optimizer) -> dict:
    return copy.deepcopy(optimizer.state_dict())


def _assert_same(model_a, ema_a, opt_a, model_b, ema_b, opt_b, host: list[str], where: str) -> None:
    for part, a, b in (("model", model_a, model_b), ("ema", ema_a.module, ema_b.module)):
        for key, value in a.state_dict().items():
            assert torch.equal(value, b.state_dict()[key]), f"{where}: {part}.{key}"
    sa, sb = _states(opt_a), _states(opt_b)
    for index, state in sa["state"].items():
        other = sb["state"].get(index, {})
        for key, value in state.items():
            if f"state[].{key}" in host:
                continue
            if key not in other:  # created by the skipped first step: zero, which every optimizer reads as no history
                assert not torch.as_tensor(value).any(), f"{where}: state {index}.{key} is not zero"
            elif isinstance(value, torch.Tensor):
                assert torch.equal(value, other[key]), f"{where}: state {index}.{key}"
            else:
                assert value == other[key], f"{where}: state {index}.{key}"
    for ga, gb in zip(sa["param_groups"], sb["param_groups"]):
        assert {k: v for k, v in ga.items() if f"param_groups[].{k}" not in host} == \
               {k: v for k, v in gb.items() if f"param_groups[].{k}" not in host}, where


@settings(max_examples=30, deadline=None)
@given(opt=st.sampled_from([*OPTIMIZERS, "sgd-unfused"]), bad_at=st.integers(1, 3),
       bad=st.sampled_from(["nan", "overflow"]))
def test_a_skipped_update_leaves_everything_as_a_run_stopped_before_it(opt, bad_at, bad):
    """[k - 1 good steps, a bad one] against [k - 1 good steps]: weights, EMA, every optimizer tensor bit for bit;
    then one more good step each, equal again (the overflow's scale halved: powers of two, the same gradients).
    After a NaN loss (a divergence), an optimizer that counts on the host (HOST_COUNTED) is restored but for that
    count, one ahead; after an fp16 overflow it is exact, count included (it reads the decision on the host)."""
    name, fused = (opt.split("-")[0], False) if opt.endswith("-unfused") else (opt, None)
    runs = []
    for steps in ([None] * (bad_at - 1) + [bad], [None] * (bad_at - 1)):
        model, optimizer, ema = _build(name, fused)
        scaler = torch.amp.GradScaler("cpu", enabled=bad == "overflow", init_scale=2.0 ** 8)
        for index, kind in enumerate(steps):
            _step(model, optimizer, ema, scaler, index, kind)
        runs.append((model, optimizer, ema, scaler))
    (model, optimizer, ema, scaler), (ref_model, ref_optimizer, ref_ema, ref_scaler) = runs
    host = host_counted(optimizer, torch.device("cpu"))
    if bad_at > 1 or bad == "nan":  # a skipped first step under fp16 made no state: nothing counted yet
        assert host == HOST_COUNTED.get(opt, []), opt
    if bad == "overflow":
        host = []  # decided on the host: nothing to except
    _assert_same(model, ema, optimizer, ref_model, ref_ema, ref_optimizer, host, f"{opt} after bad step {bad_at}")
    for state in (name for name in host if name.endswith(".step")):  # the count a skipped step advances: one ahead
        key = state.split(".")[1]
        ours = [g[key] if "param_groups" in state else s[key] for g, s in
                zip(optimizer.param_groups, [optimizer.state[p] for p in model.parameters()])]
        theirs = [g.get(key, 0) if "param_groups" in state else ref_optimizer.state[p].get(key, 0) for g, p in
                  zip(ref_optimizer.param_groups, ref_model.parameters())]
        assert [float(a) for a in ours] == [float(b) + 1 for b in theirs], (opt, state)
    if host:
        return
    _step(model, optimizer, ema, scaler, bad_at, None)
    _step(ref_model, ref_optimizer, ref_ema, ref_scaler, bad_at, None)  # the same batch
    _assert_same(model, ema, optimizer, ref_model, ref_ema, ref_optimizer, [], f"{opt} after the next good step")


def test_fused_sgd_momentum_after_a_skipped_first_step_is_not_uninitialised_memory():
    """The case that read back 9.8e-45 on the CPU: fused SGD's first step allocates its momentum buffers with
    empty_like, and a skipped kernel never writes them. A skipped first step leaves them zero."""
    model, optimizer, ema = _build("momentum")
    assert all(group["fused"] for group in optimizer.param_groups)
    _step(model, optimizer, ema, torch.amp.GradScaler("cpu", enabled=False), 0, "nan")
    for p in model.parameters():
        assert torch.equal(optimizer.state[p]["momentum_buffer"], torch.zeros_like(p))


@pytest.mark.parametrize("opt", ["sgd", "lamb"])
def test_an_fp16_overflow_in_a_real_step_is_skipped_as_if_never_taken(tmp_path, opt):
    """Run.train_step itself under fp16 (autocast and GradScaler on the CPU), its first step overflowing (a loss
    scale of 2**60): the weights, the EMA and the optimizer's tensors equal a fresh run's, the scale halved; the
    fused SGD then takes the first step that run takes. Lamb counts its steps on the host (HOST_COUNTED): its
    tensors are restored. The schedule steps per epoch here: it counts the run's steps, skipped ones included, and
    would otherwise give the next step another lr."""
    def run(name: str) -> Run:
        torch.manual_seed(0)  # the same initial weights
        return Run(compose_cfg(*FAST, "trainer.precision=fp16", f"recipe.opt={opt}", "recipe.ema=true",
                               "recipe.sched_on=epochs"),
                   tmp_path / name, {}, DistContext())
    g = torch.Generator().manual_seed(0)
    batch = [(torch.randn(16, 3, 16, 16, generator=g), torch.randint(0, 10, (16,), generator=g))]
    overflowing, fresh = run("a"), run("b")
    scale = overflowing.scaler.get_scale()
    huge = {**overflowing.scaler.state_dict(), "scale": 2.0 ** 60}
    overflowing.scaler.load_state_dict(huge)  # the scaled loss's gradients overflow fp16: the scaler's skip
    overflowing.train_step(batch, log=False)
    assert overflowing.scaler.get_scale() == 2.0 ** 59
    overflowing.scaler.update(scale)  # the scale is the scaler's own business, not the claim
    overflowing.check_diverged()  # the scaler's skip, not a divergence: raises nothing
    _assert_same(overflowing.model, overflowing.parts.ema, overflowing.parts.optimizer, fresh.model, fresh.parts.ema,
                 fresh.parts.optimizer, [], f"{opt}: overflowing first step")
    torch.manual_seed(1)
    overflowing.train_step(batch, log=False)
    torch.manual_seed(1)
    fresh.train_step(batch, log=False)
    _assert_same(overflowing.model, overflowing.parts.ema, overflowing.parts.optimizer, fresh.model,
                 fresh.parts.ema, fresh.parts.optimizer, [], f"{opt}: the next step")
