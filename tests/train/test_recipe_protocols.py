"""The DeiT / DeiT-III training protocols as the authors' code runs them (facebookresearch/deit main.py, engine.py,
models_v2.py): LayerScale init and uniform drop path, fp16 with a dynamic loss scaler, the per-epoch schedule with
its one-epoch lag, fine-tuning from the model weights. Each is checked against a reference written out here."""
from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import pytest
import torch
from timm.layers import DropPath

from quest.run.checkpoint import load_checkpoint
from quest.train import fit
from quest.train.builders import build_model, scheduler_epoch
from quest.train.compute import resolve_precision

from ..helpers import FAST, compose_cfg


def _branch_rates(model: torch.nn.Module) -> list[tuple[float, float]]:
    rate = lambda m: m.drop_prob if isinstance(m, DropPath) else 0.0  # noqa: E731
    return [(rate(b.drop_path1), rate(b.drop_path2)) for b in model.blocks]


# ViT-L is built on the meta device (structure and init settings, no values: 0.5 s instead of 14 s of weight init);
# ViT-B for real, so the values the init leaves in the layer scales are read too
@pytest.mark.parametrize("model_name, depth, rate, ft_rate, device", [("deit3_base", 12, 0.2, 0.2, "cpu"),
                                                                      ("deit3_large", 24, 0.45, 0.45, "meta")])
def test_deit3_models_have_the_authors_layerscale_and_uniform_drop_path(model_name, depth, rate, ft_rate, device):
    for recipe, expected in (("deit3", rate), ("deit3_finetune", ft_rate)):
        with torch.device(device):
            model = build_model(compose_cfg(f"recipe={recipe}", f"model={model_name}", "data=imagenet",
                                            "data.root=/x"))
        assert len(model.blocks) == depth
        assert _branch_rates(model) == [(expected, expected)] * depth  # models_v2.py: dpr = [rate] * depth
        for block in model.blocks:
            for ls in (block.ls1, block.ls2):  # models_v2.py: init_values * torch.ones(dim), init_scale=1e-4
                assert ls.init_values == 1e-4
                if device != "meta":
                    torch.testing.assert_close(ls.gamma, torch.full_like(ls.gamma, 1e-4), atol=0, rtol=0)
        del model


def test_deit_keeps_timms_linear_drop_path_and_no_layerscale():
    model = build_model(compose_cfg("recipe=deit", "model=vit_base", "data=imagenet", "data.root=/x"))
    expected = torch.linspace(0, 0.1, 12).tolist()  # DeiT's models.py builds timm's VisionTransformer
    assert [a for a, _ in _branch_rates(model)] == pytest.approx(expected, abs=1e-7)
    assert not hasattr(model.blocks[0].ls1, "gamma")


def _truncated_normal_ks(values: torch.Tensor, std: float, bound: float = 2.0) -> float:
    """Kolmogorov-Smirnov distance of ``values`` to trunc_normal_(std=std, a=-bound, b=bound), the CDF written out
    (the normal CDF by erf, renormalised to the absolute bounds as timm's / DeiT's trunc_normal_)."""
    phi = lambda x: 0.5 * (1 + math.erf(x / (std * math.sqrt(2))))  # noqa: E731
    lo, hi = phi(-bound), phi(bound)
    x = sorted(values.flatten().double().tolist())
    n = len(x)
    return max(max(abs((i + 1) / n - (phi(v) - lo) / (hi - lo)), abs(i / n - (phi(v) - lo) / (hi - lo)))
               for i, v in enumerate(x))


@pytest.mark.numerics
@pytest.mark.parametrize("recipe, model_name", [("deit", "vit_base"), ("deit3", "deit3_base"),
                                                ("deit3_finetune", "deit3_base")])
def test_deit_recipes_initialise_the_class_token_as_the_authors(recipe, model_name):
    torch.manual_seed(0)  # a fixed draw: the distances below are one number each, not a flaky statistic
    model = build_model(compose_cfg(f"recipe={recipe}", f"model={model_name}", "data=imagenet", "data.root=/x"))
    token = model.cls_token.detach()
    assert token.shape == (1, 1, 768)
    # models_v2.py / timm 0.3.2: trunc_normal_(cls_token, std=.02). 768 draws: the KS distance to the true law is
    # ~0.03 (0.059 is the 1% critical value); to timm 1.0's N(0, 1e-6) it is ~0.5
    assert _truncated_normal_ks(token, 0.02) < 0.059
    assert 0.017 < float(token.std()) < 0.023 and float(token.abs().max()) <= 2.0
    del model


@pytest.mark.numerics
def test_other_recipes_keep_timms_class_token_init():
    torch.manual_seed(0)
    model = build_model(compose_cfg("model=vit_pico", "data=imagenet", "data.root=/x"))  # the light recipe
    token = model.cls_token.detach()
    assert compose_cfg().recipe.cls_token_std is None
    assert float(token.abs().max()) < 1e-5 and _truncated_normal_ks(token, 0.02) > 0.4  # timm 1.0: N(0, 1e-6)


def test_paper_recipes_name_the_authors_choices():
    for recipe in ("deit", "deit3", "deit3_finetune"):
        r = compose_cfg(f"recipe={recipe}", "model=deit3_base").recipe
        assert (r.sched_on, r.precision, r.init_weights) == ("deit", "fp16", "model"), recipe
    assert compose_cfg("recipe=deit3", "model=deit3_base").recipe.drop_path_schedule == "uniform"
    assert compose_cfg("recipe=deit").recipe.drop_path_schedule == "linear"
    light = compose_cfg().recipe
    assert (light.sched_on, light.precision) == ("updates", None)


def test_precision_auto_follows_the_recipe_on_cuda_only():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert resolve_precision("auto", "fp16", cuda) == "fp16"  # DeiT / DeiT-III on GPUs
    assert resolve_precision("auto", None, cuda) == "bf16"  # recipes without a published precision
    assert resolve_precision("auto", "fp16", cpu) == "fp32"
    assert resolve_precision("bf16", "fp16", cuda) == "bf16"  # one override away


# --- fp16 with a dynamic loss scaler, on CPU ----------------------------------------------------------------------
def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fp16_with_loss_scaling_trains_on_cpu(tmp_path):
    summary = fit(compose_cfg(*FAST, "trainer.precision=fp16"), tmp_path)
    assert summary["status"] == "completed"
    scales = [r["train/loss_scale"] for r in _rows(tmp_path) if "train/loss_scale" in r]
    assert scales and scales[0] == 2.0 ** 16  # GradScaler's (and DeiT's NativeScaler's) initial scale
    assert load_checkpoint(tmp_path / "checkpoints" / "last.pt")["scaler"]["scale"] > 0


def test_a_loss_scale_overflow_skips_the_step_and_is_not_divergence(tmp_path, monkeypatch):
    import quest.train.trainer as trainer

    # a scale so large that the fp16 backward overflows: GradScaler must skip those steps and halve the scale
    monkeypatch.setattr(trainer.torch.amp, "GradScaler", partial(torch.amp.GradScaler, init_scale=2.0 ** 60))
    cfg = compose_cfg(*FAST, "trainer.precision=fp16", "trainer.max_steps=3", "recipe.ema=false")
    summary = fit(cfg, tmp_path)
    assert summary["status"] == "stopped" and summary["step"] == 3  # not "diverged"
    rows = [r for r in _rows(tmp_path) if "train/loss_scale" in r]
    assert [r["train/loss_scale"] for r in rows] == [2.0 ** 60, 2.0 ** 59, 2.0 ** 58]
    assert all(not math.isfinite(float(r["train/grad_norm"])) for r in rows)  # logged as "inf" / "nan"
    ckpt = load_checkpoint(tmp_path / "checkpoints" / "last.pt")
    # AdamW never stepped: the fused AdamW skipped on the scaler's found_inf, its step counts and moments still zero
    states = ckpt["optimizer"]["state"].values()
    assert states and all(not value.any() for state in states for value in state.values())
    torch.manual_seed(cfg.trainer.seed)  # the weights fit started from (timm's random_seed seeds torch the same)
    import random

    import numpy as np
    np.random.seed(cfg.trainer.seed)
    random.seed(cfg.trainer.seed)
    initial = build_model(cfg).state_dict()
    for key, value in initial.items():
        torch.testing.assert_close(ckpt["model"][key], value, atol=0, rtol=0, msg=key)


def test_a_non_finite_loss_under_fp16_is_still_divergence(tmp_path):
    summary = fit(compose_cfg(*FAST, "trainer.precision=fp16", "recipe.lr=1e6", "recipe.warmup_epochs=0",
                              "trainer.epochs=4", "attention=standard"), tmp_path)
    assert summary["status"] == "diverged" and "not finite" in summary["divergence_reason"]


# --- the schedule, per update or per epoch -----------------------------------------------------------------------
def _cosine(t: float, base: float, warmup_t: float, warmup_lr: float, min_lr: float, total: float) -> float:
    """timm's CosineLRScheduler written out: linear warmup from warmup_lr, then cosine over the whole run."""
    if t < warmup_t:
        return warmup_lr + t * (base - warmup_lr) / warmup_t
    return min_lr + 0.5 * (base - min_lr) * (1 + math.cos(math.pi * t / total))


@pytest.mark.parametrize("sched_on, lag", [("epochs", 0), ("deit", 1)])
def test_per_epoch_schedule_as_timm_train_py_and_as_deit_main_py(tmp_path, sched_on, lag):
    epochs, base = 5, 2e-3
    fit(compose_cfg(*FAST, f"trainer.epochs={epochs}", f"recipe.sched_on={sched_on}", "recipe.warmup_epochs=1"),
        tmp_path)
    by_epoch: dict[int, set[float]] = {}
    for r in _rows(tmp_path):
        if "train/lr" in r:  # 4 steps an epoch: rows at steps 1..4 belong to epoch 0, ...
            by_epoch.setdefault((r["step"] - 1) // 4, set()).add(r["train/lr"])
    for epoch, values in by_epoch.items():
        assert len(values) == 1, (epoch, values)  # constant within an epoch
        t = max(epoch - lag, 0)  # DeiT: lr_scheduler.step(epoch) after epoch `epoch`: one epoch behind
        assert values.pop() == pytest.approx(_cosine(t, base, 1, 1e-5, 1e-5, epochs), rel=1e-9), epoch
    assert scheduler_epoch("deit", 0) is None and scheduler_epoch("deit", 3) == 2
    assert scheduler_epoch("epochs", 3) == 3 and scheduler_epoch("updates", 3) is None


def test_per_epoch_schedule_resumes_mid_epoch_bit_identically(tmp_path):
    args = [*FAST, "trainer.epochs=3", "recipe.sched_on=deit", "recipe.drop_path=0.1"]
    fit(compose_cfg(*args), tmp_path / "straight")
    fit(compose_cfg(*args, "trainer.max_steps=6"), tmp_path / "resumed")
    fit(compose_cfg(*args), tmp_path / "resumed")
    a, b = (load_checkpoint(tmp_path / d / "checkpoints" / "last.pt") for d in ("straight", "resumed"))
    for key, value in a["model"].items():
        torch.testing.assert_close(b["model"][key], value, atol=0, rtol=0, msg=key)


# --- fine-tuning starts from the model weights (DeiT's --finetune loads checkpoint['model']) --------------------
@pytest.mark.parametrize("which", ["model", "ema"])
def test_init_from_takes_the_chosen_weights(tmp_path, which):
    from quest.runtime.distributed import DistContext
    from quest.train.trainer import Run

    fit(compose_cfg(*FAST, "trainer.epochs=1", "recipe.ema_decay=0.5"), tmp_path / "phase1")
    source = load_checkpoint(tmp_path / "phase1" / "checkpoints" / "last.pt")
    assert not torch.equal(source["model"]["blocks.0.attn.qkv.weight"], source["ema"]["blocks.0.attn.qkv.weight"])
    cfg = compose_cfg(*FAST, f"recipe.init_weights={which}",
                      f"trainer.init_from={tmp_path / 'phase1' / 'checkpoints' / 'last.pt'}")
    run = Run(cfg, tmp_path / "phase2", {}, DistContext())
    run.init_weights(cfg.trainer.init_from)
    for key, value in source[which].items():
        if not key.startswith("head"):
            torch.testing.assert_close(run.model.state_dict()[key], value, atol=0, rtol=0, msg=key)
