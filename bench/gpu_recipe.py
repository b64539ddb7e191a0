"""train.py against the bare step (bench/gpu.py's ``recipe`` part): what the DeiT recipe costs and what the loop costs.

The same model (quest's attention) at the same batch and precision, timed as:
1. the bare step of the step tables (fused AdamW, plain cross-entropy);
2. the step with the parts train.py builds for recipe=deit (quest.train.builders.build_components on the config
   composed from train.py's overrides: the model with its drop path and init, timm's AdamW with the recipe's weight
   decay groups, timm's Mixup / CutMix, the loss, timm's ModelEmaV3, the schedule), added one at a time: the
   recipe's optimizer and loss alone, + drop path, + mixup / cutmix, + EMA (= the whole recipe);
3. train.py itself on data=fake with those overrides: its steady step time from metrics.jsonl's perf/step_s (every
   log interval after the first, which holds the loader's start, and none that compiled).
The recipe's cost is 2's whole recipe over 1; the loop's cost is 3 over 2's whole recipe."""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench.gpu_apps import train_run
from bench.gpu_step import free, time_steps, train_throughput

__all__ = ["recipe_overrides", "RECIPE_STEPS", "recipe_step", "steady_intervals", "train_vs_bare"]

#: the recipe's parts, added one at a time (each entry: what it adds, and the overrides that leave the rest out)
RECIPE_STEPS: list[tuple[str, list[str]]] = [
    ("recipe's optimizer and loss", ["recipe.drop_path=0", "recipe.mixup=0", "recipe.cutmix=0", "recipe.ema=false"]),
    ("+ drop path", ["recipe.mixup=0", "recipe.cutmix=0", "recipe.ema=false"]),
    ("+ mixup / cutmix", ["recipe.ema=false"]),
    ("+ EMA (train.py's recipe=deit)", []),
]


def recipe_overrides(smoke: bool, device: torch.device) -> list[str]:
    """train.py's overrides for the comparison: ViT-B/16 at 224 px, batch 128, bf16 on the GPU (the H200 run's
    train.py row); vit_pico at 16 px, batch 4 in the CPU smoke, with DeiT's drop path 0.1 (its pico row has none)."""
    size = (["model=vit_pico", "data.img_size=16", "data.batch_size=4", "recipe.drop_path=0.1"] if smoke else
            ["model=vit_base", "data.img_size=224", "data.batch_size=128"])
    return ["attention=quest", "recipe=deit", "data=fake", *size, "data.num_classes=1000", "trainer.precision=bf16",
            f"trainer.device={device.type}"]


def _compose(overrides: list[str]) -> Any:
    from hydra import compose, initialize_config_dir

    from quest.cli import config_root
    from quest.config.hydra_store import register_configs
    from quest.train.checks import check_train_config

    register_configs()
    with initialize_config_dir(config_dir=str(config_root()), version_base="1.3"):
        cfg = compose("train", overrides=overrides)
    check_train_config(cfg)
    return cfg


def _merge(base: list[str], extra: list[str]) -> list[str]:
    """``base`` with the keys ``extra`` sets replaced by extra's values (Hydra refuses a key given twice)."""
    keys = {o.split("=", 1)[0] for o in extra}
    return [o for o in base if o.split("=", 1)[0] not in keys] + extra


def recipe_step(overrides: list[str], steps: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """One training step with the parts quest's builders make from ``overrides`` (what train.py would train),
    on random images: mixup, forward and loss under the run's autocast, backward, the optimizer (through a
    GradScaler in fp16), EMA and the per-update schedule; timed as the bare step is."""
    row = _recipe_step(overrides, steps, warmup, device)
    free(device)  # the row's model, EMA copy and optimizer are gone with its frame
    return row


def _recipe_step(overrides: list[str], steps: int, warmup: int, device: torch.device) -> dict[str, Any]:
    from timm.utils import random_seed

    from quest.runtime.distributed import DistContext
    from quest.train.builders import build_components
    from quest.train.compute import autocast_for, resolve_precision

    cfg = _compose(overrides)
    random_seed(cfg.trainer.seed)
    parts = build_components(cfg, DistContext(device=device))
    model = parts.model.train()
    precision = resolve_precision(cfg.trainer.precision, cfg.recipe.get("precision"), device)
    cast = autocast_for(precision, device)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    size, batch = int(cfg.data.img_size), int(cfg.data.batch_size)
    images = torch.randn(batch, 3, size, size, device=device)
    targets = torch.randint(0, int(cfg.data.num_classes), (batch,), device=device)
    updates = [0]

    def step() -> None:
        x, y = images.clone(), targets  # timm's Mixup blends the batch in place
        if parts.mixup is not None:
            x, y = parts.mixup(x, y)
        with cast():
            loss = parts.train_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(parts.optimizer)
        scaler.update()
        parts.optimizer.zero_grad(set_to_none=True)
        updates[0] += 1
        if parts.ema is not None:
            parts.ema.update(model, step=updates[0])
        parts.scheduler.step_update(num_updates=updates[0])

    timed = time_steps(step, steps, warmup, device)
    row = {"optimizer": type(parts.optimizer).__name__, "loss": type(parts.train_loss).__name__,
           "drop_path": float(cfg.recipe.drop_path), "mixup": parts.mixup is not None, "ema": parts.ema is not None,
           "precision": precision, "img_per_s": batch / timed["step_s"], **timed}
    return row


def steady_intervals(metrics: Path) -> dict[str, Any]:
    """train.py's steady step from its metrics.jsonl: every log interval's perf/step_s after the first (the loader's
    start is in it) and none that compiled (perf/compile_s, where the telemetry reports it)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    intervals = [r for r in rows if "perf/step_s" in r]
    steady = [r for r in intervals[1:] if not r.get("perf/compile_s")]
    if not steady:
        return {"intervals": len(intervals), "steady": 0}
    step_s = [r["perf/step_s"] for r in steady]
    mfu = [r["perf/mfu"] for r in steady if "perf/mfu" in r]
    return {"intervals": len(intervals), "steady": len(steady), "first_step_s": intervals[0]["perf/step_s"],
            "step_s": statistics.median(step_s), "step_s_min": min(step_s), "step_s_max": max(step_s),
            "img_per_s": statistics.median(r["perf/img_per_s"] for r in steady),
            "data_wait_max": max(r["perf/data_wait"] for r in steady),
            "mfu": statistics.median(mfu) if mfu else None}


def train_vs_bare(run: Any, device: torch.device, smoke: bool, steps: int, warmup: int, in_process: bool,
                  compile_backend: str) -> None:
    """The part: the bare step, the recipe's steps, then train.py, each row written as it ends (``run``: its
    bench.gpu_report.PartRun)."""
    base = recipe_overrides(smoke, device)
    name, size, batch = ("vit_pico_patch4_16", 16, 4) if smoke else ("vit_base_patch16_224", 224, 128)
    if run.afford("bare step"):
        bare = train_throughput(name, "quest", size, batch, torch.bfloat16, False, steps, device, compile_backend,
                                warmup=warmup)
        run.row({"step": "bare (fused AdamW, cross-entropy)", **bare})
    for label, extra in RECIPE_STEPS:
        if run.afford(label):
            overrides = _merge(base, extra)
            run.row({"step": label, "overrides": overrides, **recipe_step(overrides, steps, warmup, device)})
    loop_steps, every = (4, 2) if smoke else (40, 10)
    workers = 0 if smoke else max(1, min(12, (os.cpu_count() or 4) - 2))
    overrides = [*base, "trainer.epochs=1", f"trainer.max_steps={loop_steps}", f"trainer.log_every_n_steps={every}",
                 f"data.num_workers={workers}", f"data.fake_train_size={batch * (loop_steps + 5)}",
                 f"data.fake_val_size={8 if smoke else 256}"]
    if not run.afford("train.py", 10.0 if smoke else 75.0):
        return
    env = {**os.environ, "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        out = train_run(overrides, Path(tmp), env, torchrun=False, in_process=in_process, timeout=run.left())
        metrics = next(Path(tmp).rglob("metrics.jsonl"), None)
        steady = steady_intervals(metrics) if metrics else {"steady": 0}
    row = {"step": "train.py", "overrides": overrides, "returncode": out["returncode"], "seconds": out["seconds"],
           "status": (out["summary"] or {}).get("status"), "stderr_tail": out["stderr_tail"], "steady": steady,
           "ok": out["returncode"] == 0 and steady["steady"] > 0}
    earlier = {r.get("step"): r for r in run.report.rows(run.part.name)}
    plain, whole = earlier.get("bare (fused AdamW, cross-entropy)"), earlier.get(RECIPE_STEPS[-1][0])
    if plain and whole:
        row["recipe_cost"] = whole["step_s"] / plain["step_s"]  # the recipe's parts, in the bare loop
    if whole and steady.get("step_s"):
        row["loop_cost"] = steady["step_s"] / whole["step_s"]  # train.py against the same parts, bare
    if plain and steady.get("step_s"):
        row["vs_bare"] = steady["step_s"] / plain["step_s"]
    run.row(row)
