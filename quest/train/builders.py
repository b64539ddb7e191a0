"""Everything a run needs, built from the config with timm's parts: model, data loaders, optimizer, per-step
schedule, mixup, loss and EMA. The config's values were checked before (quest.train.checks); what only the built
parts can tell (too few images for one batch, more accumulation steps than batches) is refused here."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
from omegaconf import OmegaConf
from timm.data import Mixup
from timm.layers import trunc_normal_
from timm.loss import BinaryCrossEntropy, LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from timm.optim import create_optimizer_v2, get_optimizer_class
from timm.scheduler import create_scheduler_v2
from timm.utils import ModelEmaV3
from torch.utils.data import DataLoader

from quest.data import (
    ShardSampler,
    WdsDataset,
    build_dataset,
    build_train_input,
    build_train_sampler,
    build_transforms,
    class_balanced_subset,
    collate_skipping_bad,
    shard_loaders,
)
from quest.data.worker_errors import NamedLoader
from quest.models import create_model, uniform_drop_path
from quest.runtime.distributed import DistContext, agree_on_sample_counts
from quest.runtime.workers import loader_worker_init

from .checks import check_patch_size

log = logging.getLogger("quest.train")

__all__ = ["Components", "build_components", "build_model", "model_spec", "resolve_img_size", "img_size_source",
           "unused_size_keys", "model_meta",
           "resolve_lr", "scheduler_epoch", "train_module", "ModelLoss", "FUSED_OPTIMIZERS"]


@dataclass
class Components:
    model: nn.Module
    ema: ModelEmaV3 | None
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: DataLoader
    val_loader: DataLoader
    # data.pipeline: the step that turns a training batch into the model's input on the device (None: the loader's
    # batches are that input already), and what the run records as its training input
    train_finish: Any
    train_input: str
    mixup: Mixup | None
    train_loss: nn.Module
    lr: float
    global_batch: int
    steps_per_epoch: int
    # the highest lr the schedule reaches in trainer.epochs (timm's schedules without a warm-up prefix start their
    # decay during the warm-up, so even a finished warm-up ends a little below lr); far below when it outlasts them
    lr_peak: float


def img_size_source(cfg: Any) -> str:
    """The key that sets the input size: the recipe's (DeiT-III first phase), else the model's, else the data's."""
    for key in ("recipe.img_size", "model.img_size", "data.img_size"):
        if OmegaConf.select(cfg, key):
            return key
    raise ValueError("no input size: set model.img_size, recipe.img_size or data.img_size")


def resolve_img_size(cfg: Any) -> int:
    return int(OmegaConf.select(cfg, img_size_source(cfg)))


def unused_size_keys(cfg: Any, given: Sequence[str]) -> list[str]:
    """The input-size keys of the command line ``given`` (``key=value`` overrides) that a key before them in
    :func:`img_size_source`'s order overrules: set but not what the run trains at, each in a line naming the key that
    decides and what to set instead."""
    source, size = img_size_source(cfg), resolve_img_size(cfg)
    order = ("recipe.img_size", "model.img_size", "data.img_size")
    out = []
    for override in given:
        key, _, value = override.lstrip("+~").partition("=")
        if key in order and order.index(key) > order.index(source) and value != str(size):
            out.append(f"{key}={value} is not the size this run trains at: {source}={size} decides it (the order is "
                       f"{', '.join(order)}); set {source}={value} instead")
    return out


def model_meta(cfg: Any) -> dict[str, Any]:
    """What a checkpoint must match to be loaded into this run."""
    return {
        "model": cfg.model.name,
        "attention": cfg.attention.name,
        "num_classes": int(cfg.data.num_classes),
        "img_size": resolve_img_size(cfg),
    }


def model_spec(cfg: Any) -> dict[str, Any]:
    """Everything of a train config that decides its model, as plain values: :func:`build_model` builds from this
    alone, so two configs with the same spec build the same model (the run's FLOP count is kept by it)."""
    kwargs = dict(OmegaConf.to_container(cfg.model.kwargs, resolve=True))
    if cfg.model.get("layer_scale_init") is not None:
        kwargs["init_values"] = float(cfg.model.layer_scale_init)
    std = cfg.recipe.get("cls_token_std")
    return {"name": cfg.model.name, "kwargs": kwargs, "attention": cfg.attention.name,
            "attention_options": OmegaConf.to_container(cfg.attention.options, resolve=True),
            "num_classes": int(cfg.data.num_classes), "img_size": resolve_img_size(cfg),
            "drop_path": float(cfg.recipe.drop_path), "drop_rate": float(cfg.recipe.drop_rate),
            "drop_path_schedule": cfg.recipe.get("drop_path_schedule", "linear"),
            "cls_token_std": None if std is None else float(std)}


def build_model(cfg: Any) -> nn.Module:
    """The model of a train config (:func:`model_spec`): timm architecture, attention, classes, input size, and the
    recipe's drop path (linear over depth as timm builds it, or uniform as DeiT-III), class-token init and
    LayerScale init where the config sets them."""
    spec = model_spec(cfg)
    model = create_model(spec["name"], attention=spec["attention"], attention_options=spec["attention_options"],
                         num_classes=spec["num_classes"], img_size=spec["img_size"], drop_path_rate=spec["drop_path"],
                         drop_rate=spec["drop_rate"], **spec["kwargs"])
    if spec["drop_path_schedule"] == "uniform":
        uniform_drop_path(model, spec["drop_path"])
    std = spec["cls_token_std"]
    if std is not None and getattr(model, "cls_token", None) is not None:
        # DeiT's models (timm 0.3.2's VisionTransformer, models_v2.py's vit_models): trunc_normal_(cls_token,
        # std=.02), bounds at +-2 absolute as timm's; timm 1.0 starts it at N(0, 1e-6)
        with torch.no_grad():
            trunc_normal_(model.cls_token, std=std)
    return model


def scheduler_epoch(sched_on: str, epochs_done: int) -> int | None:
    """The epoch a per-epoch schedule is stepped with once ``epochs_done`` epochs are complete: timm's train.py
    convention (``epochs``: the next epoch trains at the value for ``epochs_done``), or DeiT's main.py
    (``deit``: ``lr_scheduler.step(epoch)`` after epoch ``epoch`` = epochs_done - 1, one epoch behind); None for a
    per-update schedule or before DeiT's first step."""
    if sched_on == "epochs":
        return epochs_done
    if sched_on == "deit" and epochs_done >= 1:
        return epochs_done - 1
    return None


def resolve_lr(recipe: Any, global_batch: int) -> float:
    """The recipe's absolute lr, or base_lr scaled linearly by the global batch (DeiT: 5e-4 x batch / 512)."""
    if recipe.lr is not None:
        return float(recipe.lr)
    if recipe.base_lr is None:
        raise ValueError(f"recipe {recipe.name!r} sets neither lr nor base_lr")
    return float(recipe.base_lr) * global_batch / recipe.lr_base_size


def _optimizer(model: nn.Module, recipe: Any, lr: float) -> torch.optim.Optimizer:
    kwargs: dict[str, Any] = {}
    if recipe.opt.lower() in ("adamw", "adam", "lamb", "nadamw", "lambw"):
        kwargs["eps"] = recipe.opt_eps
    if recipe.opt_betas is not None:
        kwargs["betas"] = tuple(recipe.opt_betas)
    # torch's fused kernels (Adam, AdamW, SGD; CUDA and, since torch 2.4, the CPU): one multi-tensor kernel per
    # group, and a found_inf tensor that skips the update on the device (quest.train.update.Update)
    if get_optimizer_class(recipe.opt, bind_defaults=False) in FUSED_OPTIMIZERS:
        kwargs["fused"] = True
    # timm: no weight decay on 1-d params (biases, norms, LayerScale, QKNorm scales) nor model.no_weight_decay()
    # (pos_embed, cls_token, register tokens).
    return create_optimizer_v2(
        model, opt=recipe.opt, lr=lr, weight_decay=recipe.weight_decay, momentum=recipe.momentum, **kwargs
    )


#: The optimizer classes built fused: those whose step takes found_inf (GradScaler's _step_supports_amp_scaling).
FUSED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


class ModelLoss(nn.Module):
    """The training forward, (images, targets) -> loss: the model and the loss in one module, so that torch.compile
    takes both into one graph (the loss's softmax and reduction fused with the head)."""

    def __init__(self, model: nn.Module, loss: nn.Module):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model(images), targets)


def train_module(model: nn.Module, loss: nn.Module, trainer: Any, ctx: DistContext) -> nn.Module:
    """The module a training step calls: :class:`ModelLoss`, compiled with trainer.compile_mode and
    trainer.compile_backend when trainer.compile is on (docs/training.md, "Compile"), then under several processes
    wrapped in DDP (FSDP shards the model itself, quest.runtime.fsdp)."""
    module: nn.Module = ModelLoss(model, loss)
    if trainer.compile:
        backend, mode = trainer.get("compile_backend", "inductor"), trainer.get("compile_mode", "default")
        module = torch.compile(module, backend=backend, mode=None if mode == "default" else mode)
    if ctx.distributed and trainer.strategy != "fsdp":
        module = nn.parallel.DistributedDataParallel(
            module, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    return module


def _train_loss(recipe: Any, mixup_active: bool) -> nn.Module:
    if recipe.bce_loss:
        return BinaryCrossEntropy(smoothing=recipe.smoothing, target_threshold=recipe.bce_target_thresh)
    if mixup_active:
        return SoftTargetCrossEntropy()  # label smoothing is applied inside Mixup
    if recipe.smoothing > 0:
        return LabelSmoothingCrossEntropy(smoothing=recipe.smoothing)
    return nn.CrossEntropyLoss()


def _loaders(cfg: Any, ctx: DistContext, img_size: int, train_input: Any) -> tuple[DataLoader, DataLoader]:
    data = cfg.data
    val_tf = build_transforms(cfg.recipe, data, img_size)[1]
    train_ds = build_dataset(data, "train", train_input.transform, train_input.read_file)
    train_ds = class_balanced_subset(train_ds, data.subset_fraction, data.subset_seed)
    val_ds = build_dataset(data, "val", val_tf)
    # before the first collective of training: ranks that see other data would step out of lockstep
    agree_on_sample_counts({"train samples": len(train_ds), "val samples": len(val_ds)}, ctx)
    if len(train_ds) < data.batch_size * ctx.world_size:
        raise ValueError(
            f"the training set has {len(train_ds)} images, fewer than one global batch "
            f"({data.batch_size} x {ctx.world_size} processes); lower data.batch_size"
        )
    common = dict(num_workers=data.num_workers, collate_fn=collate_skipping_bad,
                  pin_memory=data.pin_memory and ctx.device.type == "cuda",
                  persistent_workers=data.num_workers > 0,
                  worker_init_fn=loader_worker_init if data.num_workers > 0 else None)
    if isinstance(train_ds, WdsDataset):  # tar shards: no sampler, the data set splits itself by rank and worker
        return shard_loaders(train_ds, val_ds, rank=ctx.rank, world_size=ctx.world_size, batch_size=data.batch_size,
                             eval_batch_size=data.eval_batch_size or 2 * data.batch_size, seed=cfg.trainer.seed,
                             **common)  # a shard set reads no files itself: every pipeline it takes collates alike
    sampler = build_train_sampler(train_ds, cfg.trainer.seed, ctx.world_size, ctx.rank, cfg.recipe.repeated_aug)
    # Own generators: creating an iterator must not draw from the global RNG, or resuming mid-epoch would shift it.
    # a worker's failure: one line naming the loader
    train = NamedLoader(train_ds, batch_size=data.batch_size, sampler=sampler, drop_last=True,
                        generator=torch.Generator(), name=f"data.pipeline={data.pipeline}",
                        **{**common, "collate_fn": train_input.collate})
    val = NamedLoader(val_ds, batch_size=data.eval_batch_size or 2 * data.batch_size, name="validation",
                      sampler=ShardSampler(len(val_ds), ctx.rank, ctx.world_size), generator=torch.Generator(), **common)
    return train, val


def build_components(cfg: Any, ctx: DistContext) -> Components:
    recipe = cfg.recipe
    img_size = resolve_img_size(cfg)
    model = build_model(cfg)
    check_patch_size(model, img_size, img_size_source(cfg))  # before any data is read
    model = model.to(ctx.device)
    train_input = build_train_input(recipe, cfg.data, img_size)
    log.info("training input: data.pipeline=%s (%s)", cfg.data.pipeline, train_input.label)
    train_loader, val_loader = _loaders(cfg, ctx, img_size, train_input)
    if cfg.trainer.strategy == "fsdp":  # its value, and recipe.ema's exclusion, checked before any work
        from quest.runtime.fsdp import shard_model

        model = shard_model(model, ctx)  # before the optimizer: sharding replaces the parameters
    global_batch = cfg.data.batch_size * ctx.world_size * cfg.trainer.accum_steps
    lr = resolve_lr(recipe, global_batch)
    optimizer = _optimizer(model, recipe, lr)
    steps_per_epoch = len(train_loader) // cfg.trainer.accum_steps
    if steps_per_epoch < 1:
        raise ValueError(f"trainer.accum_steps={cfg.trainer.accum_steps} exceeds the {len(train_loader)} batches per epoch")
    # per update, or per epoch as the DeiT authors (timm's step() and step_update() each act only in their mode)
    scheduler, _ = create_scheduler_v2(
        optimizer, sched=recipe.sched, num_epochs=cfg.trainer.epochs, warmup_epochs=recipe.warmup_epochs,
        warmup_lr=recipe.warmup_lr, min_lr=recipe.min_lr, step_on_epochs=recipe.sched_on != "updates",
        updates_per_epoch=steps_per_epoch,
    )
    mixup_active = recipe.mixup > 0 or recipe.cutmix > 0
    mixup = None
    if mixup_active:  # an even batch: checked with the config (quest.train.checks)
        mixup = Mixup(mixup_alpha=recipe.mixup, cutmix_alpha=recipe.cutmix, prob=recipe.mixup_prob,
                      switch_prob=recipe.mixup_switch_prob, mode=recipe.mixup_mode,
                      label_smoothing=recipe.smoothing, num_classes=cfg.data.num_classes)
    ema = ModelEmaV3(model, decay=recipe.ema_decay) if recipe.ema else None
    log.info("global batch %d (%d per process x %d processes x %d accumulation), lr %.3g",
             global_batch, cfg.data.batch_size, ctx.world_size, cfg.trainer.accum_steps, lr)
    peak = _schedule_peak(scheduler, recipe.sched_on != "updates", cfg.trainer.epochs, steps_per_epoch, lr)
    if recipe.warmup_epochs >= cfg.trainer.epochs:  # a user may mean it (a short smoke run): said once, recorded
        log.warning("recipe.warmup_epochs=%g does not end before trainer.epochs=%d: the learning rate peaks at %.3g, "
                    "not the recipe's %.3g (summary.json: lr_peak)", recipe.warmup_epochs, cfg.trainer.epochs, peak,
                    lr)
    return Components(model, ema, optimizer, scheduler, train_loader, val_loader, train_input.finish,
                      train_input.label, mixup,
                      _train_loss(recipe, mixup_active), lr, global_batch, steps_per_epoch, peak)


def _schedule_peak(scheduler: Any, on_epochs: bool, epochs: int, steps_per_epoch: int, lr: float) -> float:
    """The highest learning rate timm's scheduler gives over the run (its value at each epoch or update)."""
    if not hasattr(scheduler, "_get_lr"):  # a scheduler without timm's per-step values: the recipe's lr
        return lr
    last = epochs - 1 if on_epochs else epochs * steps_per_epoch - 1
    # the schedules are monotone after the warm-up: its end (when inside the run), the first and the last point
    warmup_end = getattr(scheduler, "warmup_t", 0)
    points = [0, last, *([warmup_end] if warmup_end <= last else [])]
    return max(max(scheduler._get_lr(t)) for t in points)
