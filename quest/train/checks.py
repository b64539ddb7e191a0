"""Checks of a training config that ``fit`` runs before it builds or reads anything.

Every key must be known to the schema (``+key=`` included), every value within what its schema field declares
(quest.config.schema; quest.config.checks.declared_problems), every name in its registry (data sets, training
inputs, optimisers, timm models, formulations), the values that must agree with each other agreeing, and the data set
must agree with the config (class count, the validation classes equal to the training classes). All problems of one
config are reported together, each naming the key, the value and what is allowed. The input size against the
model's patch size is checked once the model exists (``check_patch_size``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.nn as nn
from omegaconf import OmegaConf

from quest.attention import get_attention
from quest.config.checks import Checks, ConfigError, check_known_keys
from quest.config.schema import COMPILE_BACKENDS, COMPILE_MODES, TrainConfig
from quest.config.wandb_check import check_logger_values, check_wandb_credentials
from quest.data import check_split_classes, get_dataset, known_num_classes, list_datasets
from quest.runtime.extras import require_all

__all__ = ["check_train_config", "check_patch_size", "check_compile_mode", "ConfigError", "COMPILE_MODES",
           "COMPILE_BACKENDS"]

#: attention.name of configs/attention/path.yaml until the command line names the class
PATH_PLACEHOLDER = "<package.module:Class>"
#: the trainer.compile_mode values (quest.config.schema.COMPILE_MODES) that capture CUDA graphs
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


def _no_cuda_graphs(mode: str, device: str, world_size: int, sharded: bool, accum_steps: int = 1) -> str | None:
    """Why ``mode`` cannot capture the step's CUDA graphs here, or None. The CPU has none: reduce-overhead would be
    a silent no-op there (max-autotune still autotunes the CPU kernels; inductor skips its graphs itself). Several
    processes reduce gradients in DDP's hooks and FSDP's collectives during the backward, outside the graphs
    torch.compile captures: quest does not combine the two. Gradient accumulation replays the graphs once per
    micro-batch: each replay overwrites the memory of the previous one's outputs (the loss the step keeps, the
    gradients torch.compile hands back), which cannot be shown safe without a GPU (pytorch issue 169545):
    refused on CUDA (``device`` "auto" is decided when the run starts)."""
    if mode not in CUDA_GRAPH_MODES:
        return None
    if device == "cpu" and mode == "reduce-overhead":
        return "needs a CUDA device for its CUDA graphs (this run is on the CPU); use default or max-autotune"
    if sharded or world_size > 1:
        return ("captures CUDA graphs, which quest does not combine with several processes (DDP's gradient hooks "
                "and FSDP's collectives run outside the graphs); use max-autotune-no-cudagraphs or default")
    if isinstance(accum_steps, int) and accum_steps > 1 and device.startswith("cuda"):
        return (f"captures CUDA graphs, which quest does not combine with trainer.accum_steps={accum_steps} (each "
                "micro-batch's replay overwrites the previous one's outputs); use max-autotune-no-cudagraphs or "
                "default, or trainer.accum_steps=1")
    return None


def check_compile_mode(trainer: Any, ctx: Any) -> None:
    """Refuse a CUDA-graph compile mode where the run cannot use it, once the device and process count are known
    (``ctx``: quest.runtime.distributed.DistContext), before the model is built."""
    if not trainer.compile:
        return
    mode = trainer.get("compile_mode", "default")
    why = _no_cuda_graphs(mode, ctx.device.type, ctx.world_size, trainer.strategy == "fsdp",
                          trainer.get("accum_steps", 1))
    if why:
        raise ConfigError(f"trainer.compile_mode={mode} {why}")


def _timm_augment_policy(value: Any) -> bool:
    """timm parses recipe.auto_augment only when it builds the transform, and answers a bad one with an assert."""
    from timm.data import create_transform

    try:
        create_transform(32, is_training=True, auto_augment=value)
    except Exception:  # noqa: BLE001 (AssertionError, ValueError, KeyError, IndexError: all mean "not a policy")
        return False
    return isinstance(value, str)


def _recipe(c: Checks) -> None:
    """The recipe's names (timm's optimisers and augmentation policies) and the values that must agree."""
    from timm.optim import list_optimizers

    if c.value("recipe.lr") is None and c.value("recipe.base_lr") is None:
        c.fail("recipe.lr", "must be set, or recipe.base_lr (scaled by the global batch)")
    c.one_of("recipe.opt", list_optimizers())
    c.check("recipe.auto_augment", _timm_augment_policy, "a timm augmentation policy such as rand-m9-mstd0.5-inc1, "
            "3a or augmix-m5-w4-d2 (timm.data.auto_augment)", optional=True)


def _pipeline(c: Checks, dataset: Any) -> None:
    """data.pipeline: a registered training input, one the data set can feed, and a recipe it can follow."""
    from quest.data.pipelines.train_input import get_train_input, list_train_inputs

    c.one_of("data.pipeline", list_train_inputs())
    if c.value("data.pipeline") not in list_train_inputs():
        return
    kind = get_train_input(c.value("data.pipeline"))
    if kind.reads_files and not dataset.reads_files:
        readers = [name for name in list_datasets() if get_dataset(name).reads_files]
        c.fail("data.pipeline", f"needs a data set that reads image files ({', '.join(readers)}); data="
               f"{dataset.name} does not (data.pipeline=split or timm work with every data set)")
    if kind.check is not None:
        kind.check(c)
    if c.value("data.draft_decode"):
        _draft_decode(c, kind, dataset)


def _draft_decode(c: Checks, kind: Any, dataset: Any) -> None:
    """data.draft_decode=true: a pipeline that decodes on the CPU, fed image files it can open undecoded."""
    from quest.data.pipelines.train_input import get_train_input, list_train_inputs

    if not kind.draft_decode:
        where = [name for name in list_train_inputs() if get_train_input(name).draft_decode]
        c.fail("data.draft_decode", f"applies only where the loader workers decode (data.pipeline="
               f"{' or '.join(where)}); data.pipeline={kind.name} does not decode there, so set "
               "data.draft_decode=false or choose one of those")
    elif not dataset.reads_files:
        readers = [name for name in list_datasets() if get_dataset(name).reads_files]
        c.fail("data.draft_decode", f"needs a data set that reads image files ({', '.join(readers)}); data="
               f"{dataset.name} hands over images already decoded, so set data.draft_decode=false")


def _data(c: Checks) -> None:
    """The data set's name, then its own checks (its module in quest/data/sets/ or a plugin), then the training
    input; its settings' values are declared on its settings dataclass, checked with the schema's."""
    c.one_of("data.name", list_datasets())
    if c.value("data.name") not in list_datasets():
        return
    dataset = get_dataset(c.value("data.name"))
    if dataset.check is not None:
        dataset.check(c)
    _pipeline(c, dataset)
    if dataset.streamed:  # read in order: no random access (quest/data/shards.py)
        if c.value("data.subset_fraction") != 1:
            c.fail("data.subset_fraction", "must be 1 with tar shards (a class-balanced subset needs random access)")
        if c.value("recipe.repeated_aug"):
            c.fail("recipe.repeated_aug", "must be 0 with tar shards (repeated augmentation is not implemented for "
                   "them; docs/distributed.md, \"Sharded input\")")


def _trainer(c: Checks) -> None:
    if c.value("trainer.compile_mode") not in ("default", None) and c.value("trainer.compile_backend") != "inductor":
        c.fail("trainer.compile_mode", "must be default unless trainer.compile_backend=inductor (the modes are "
               "inductor's)")
    if c.value("trainer.compile") and c.value("trainer.compile_mode") in CUDA_GRAPH_MODES:
        why = _no_cuda_graphs(c.value("trainer.compile_mode"), str(c.value("trainer.device")), 1,
                              c.value("trainer.strategy") == "fsdp", c.value("trainer.accum_steps"))
        if why:
            c.fail("trainer.compile_mode", why)
    if c.value("trainer.strategy") == "fsdp" and c.value("recipe.ema"):
        c.fail("recipe.ema", "must be false with trainer.strategy=fsdp (the EMA copy of a sharded model is not "
               "supported)")
    resume = c.value("trainer.resume")
    if resume not in ("auto", "never") and not Path(str(resume)).expanduser().is_file():
        c.fail("trainer.resume", "must be auto, never or the path of an existing checkpoint file")
    if c.value("trainer.overwrite") and resume != "never":
        c.fail("trainer.overwrite", "applies only with trainer.resume=never (start afresh, archiving the old run)")
    init_from = c.value("trainer.init_from")
    if init_from is not None and not Path(str(init_from)).expanduser().is_file():
        c.fail("trainer.init_from", "must be the path of an existing checkpoint file")
    pretrained = c.value("model.pretrained")
    if pretrained is not None:
        from quest.models.pretrained import pretrained_problem

        problem = pretrained_problem(str(pretrained))
        if problem is not None:
            c.fail("model.pretrained", problem)
        if init_from is not None:
            c.fail("model.pretrained", "and trainer.init_from both name starting weights; set one of them")


def _rest(c: Checks) -> None:
    import timm

    c.check("model.name", lambda v: isinstance(v, str) and timm.models.is_model(v),
            "a timm model name (timm.list_models(); the configs/model group lists quest's presets)")
    check_logger_values(c)


def _attention(c: Checks) -> None:
    name = c.value("attention.name")
    if name == PATH_PLACEHOLDER:  # configs/attention/path.yaml: the schema's default (quest) must not stand in
        c.fail("attention.name", "must be set with attention=path: attention.name=<package.module:Class> (the import "
               "path of a QKAttention subclass, docs/attention.md), or use attention=<package.module:Class>")
        return
    try:  # attention.options is free-form in the schema: the formulation knows its options
        get_attention(name, **OmegaConf.to_container(c.cfg.attention.options, resolve=True))
    except ValueError as exc:
        c.fail("attention.options" if " option" in str(exc) else "attention.name", f"is invalid ({exc})")


def _relations(c: Checks) -> None:
    """Values valid one by one that together make a run silently other than its config says (docs/training.md,
    "Values checked together"). Run only once every value passed alone."""
    def number(key: str) -> float | None:
        value = c.value(key)
        return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    # a warm-up as long as training (a short smoke run of a recipe) is allowed: quest.train.builders warns with the
    # peak the schedule reaches, and summary.json records it as lr_peak
    for key, words in (("recipe.scale", "[min, max] with 0 < min <= max <= 1"),
                       ("recipe.ratio", "[min, max] with 0 < min <= max")):  # each end is declared on its field
        low, high = c.value(key)
        if low > high:
            c.fail(key, f"must be {words}")
    lr = number("recipe.lr")  # with recipe.base_lr the peak depends on the global batch: checked when it is known
    for key, what in (("recipe.warmup_lr", "the warm-up would lower the learning rate"),
                      ("recipe.min_lr", "the schedule would raise the learning rate instead of decaying it")):
        low = number(key)
        if lr is not None and low is not None and low > lr:
            c.fail(key, f"must be at most recipe.lr={lr:g}: {what}")
    if ((number("recipe.mixup") or 0) > 0 or (number("recipe.cutmix") or 0) > 0) and \
            isinstance(c.value("data.batch_size"), int) and c.value("data.batch_size") % 2:
        c.fail("data.batch_size", "must be even with recipe.mixup or recipe.cutmix (timm's Mixup pairs the batch "
               "with its reverse)")


def check_train_config(cfg: Any) -> None:
    """Raise :class:`ConfigError` naming every unknown key, then every bad value, of a composed train config;
    then check the data set against it (class count, matching split classes), which lists directories only."""
    check_known_keys(cfg, TrainConfig)  # the data node against its data set's settings (the node's own type)
    checks = Checks(cfg)
    checks.declared(TrainConfig)  # every value against its schema field's declaration
    for part in (_recipe, _data, _trainer, _rest, _attention):
        part(checks)
    checks.raise_if_any("config")
    _relations(checks)
    checks.raise_if_any("config")
    # the writers' packages, named with their extras before any work (import-free: find_spec)
    require_all([need for on, need in ((cfg.logger.wandb, ("wandb", "wandb", "logger=wandb")),
                                       (cfg.logger.get("tensorboard"), ("tensorboard", "tensorboard",
                                                                        "logger=tensorboard"))) if on],
                "the logger config")
    check_wandb_credentials(cfg.logger)  # an online wandb run: credentials found without connecting
    expected = known_num_classes(cfg.data)
    if expected is not None and expected != cfg.data.num_classes:
        where_classes = get_dataset(cfg.data.name).where_classes
        where = f" ({where_classes(cfg.data)})" if where_classes is not None else ""
        checks.fail("data.num_classes", f"must be {expected}: the {cfg.data.name} data set has {expected} classes"
                    + where)
        checks.raise_if_any("config")
    check_split_classes(cfg.data)


def check_patch_size(model: nn.Module, img_size: int, source: str) -> None:
    """The input size must be a whole number of patches: timm's patch embedding would silently drop the border."""
    embed = getattr(model, "patch_embed", None)
    patch = getattr(embed, "patch_size", None)
    if patch is None:
        return
    sizes = tuple(patch) if isinstance(patch, (tuple, list)) else (patch, patch)
    if any(img_size % p for p in sizes):
        name = getattr(model, "pretrained_cfg", {}).get("architecture") or type(model).__name__
        raise ConfigError(f"invalid config values:\n  {source} must be a multiple of the patch size {sizes[0]} of "
                          f"{name}, got {img_size}")
