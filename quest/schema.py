"""Structured config schema: the keys and types that configs, docs, tests and users rely on.

Every ``float`` field (also ``Optional[float]`` and ``List[float]``) must hold finite values: the config checks
derive that list from these dataclasses (:func:`quest.validation.float_keys`), so a new float field is checked
without being listed anywhere. A field where infinity means something would say so with ``metadata=NON_FINITE_OK``.

Registered in Hydra's ConfigStore as ``train_schema``; configs/train.yaml lists it first in its defaults, so every
group file merges into a typed node and a misspelt key or a wrong type fails at start, naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import II, MISSING

#: field metadata of a float field whose value may be infinite or NaN (none today; see the module docstring)
NON_FINITE_OK = {"finite": False}


@dataclass
class AttentionConfig:
    name: str = "quest"
    # initial values of learnable scales and other formulation options (see docs/attention.md)
    options: Dict[str, Any] = field(default_factory=dict)


@dataclass
class ModelConfig:
    name: str = MISSING  # a timm model name (configs/model/*.yaml for the curated ones)
    img_size: Optional[int] = None  # None: the model's own default
    # per-recipe, size-dependent values (drop path, DeiT-III lr and input size), read by the recipe configs
    recipe_values: Dict[str, Any] = field(default_factory=dict)
    # LayerScale's initial value (timm's init_values); None: the timm model's own (1e-6 for timm's deit3_*, whose
    # authors' models_v2.py uses 1e-4: configs/model/deit3_*.yaml set that)
    layer_scale_init: Optional[float] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)  # any other timm model kwargs
    # weights a new run starts from, converted to the chosen attention (docs/interop.md): a timm tag
    # (deit_tiny_patch16_224.fb_in1k), local-dir:<quest-export folder>, hf-hub:<repo> or a .safetensors/.pth file
    pretrained: Optional[str] = None
    pretrained_download: bool = False  # read the Hub / timm's weights from the local caches only, unless true


@dataclass
class CanvasConfig:
    """data=digits_canvas: each digit pasted on a canvas with clutter, with its true box (quest/data/digits_canvas.py)."""

    size: int = 32  # canvas side in pixels
    scale_min: int = 12  # the digit's side is uniform in [scale_min, scale_max] pixels
    scale_max: int = 22
    clutter: int = 3  # fragments of other digits, away from the digit's box
    noise: float = 0.05  # Gaussian noise std as a fraction of 255
    copies: int = 2  # draws of every training digit (the validation split draws each once)
    seed: int = 0  # every sample's draws come from (seed, split, index)


@dataclass
class DataConfig:
    name: str = MISSING  # digits | digits_canvas | imagenet | imagefolder | cifar10 | cifar100 | fake | imagenet_wds | wds
    root: Optional[str] = None
    batch_size: int = 64  # per process
    eval_batch_size: Optional[int] = None  # None: 2 x batch_size
    num_workers: int = 0
    num_classes: int = MISSING
    img_size: Optional[int] = None  # native resolution when the model does not set one
    mean: List[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    std: List[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    train_split: str = "train"
    val_split: str = "val"
    subset_fraction: float = 1.0  # class-balanced subset of the training set (paper Table A2)
    subset_seed: int = 0
    val_fraction: float = 0.2  # digits: held-out stratified share
    split_seed: int = 0  # digits: the fixed train/val split
    download: bool = False  # torchvision data sets: download only when asked
    bad_images: str = "error"  # error | skip: what to do with an unreadable image in an image folder
    # bad_images=skip: the run fails (status bad_data) when more than this share of a split's images is unreadable
    max_skipped_fraction: float = 0.01  # docs/data.md
    preflight: bool = True  # image folders: decode every file; shards: read every header (docs/data.md)
    fake_train_size: int = 256
    fake_val_size: int = 64
    pin_memory: bool = True
    canvas: CanvasConfig = field(default_factory=CanvasConfig)
    # tar shards (imagenet_wds | wds; quest/data/shards.py): train_split / val_split name a split of
    # ${root}/_info.json or a shard pattern such as imagenet1k-train-{0000..1023}.tar
    num_samples: Optional[int] = None  # no _info.json: the training samples, checked; the shards are counted at start
    shuffle_window: int = 8192  # shards: training samples are permuted within windows of this many (held in memory)


@dataclass
class RecipeConfig:
    name: str = MISSING
    epochs: int = MISSING
    # optimiser (timm create_optimizer_v2)
    opt: str = "adamw"
    lr: Optional[float] = None  # absolute lr; if None, base_lr * global_batch / lr_base_size
    base_lr: Optional[float] = None
    lr_base_size: int = 512
    weight_decay: float = 0.05
    opt_eps: float = 1e-8
    opt_betas: Optional[List[float]] = None
    momentum: float = 0.9
    # cosine schedule (timm create_scheduler_v2), stepped on: updates (every optimizer step) | epochs (after each
    # epoch, epoch e at the schedule's value for e, as timm's train.py) | deit (as DeiT's main.py: step(epoch) after
    # epoch `epoch`, so epoch e trains at the value for e - 1; docs/training.md)
    sched: str = "cosine"
    sched_on: str = "updates"
    warmup_epochs: float = 5.0
    warmup_lr: float = 1e-6
    min_lr: float = 1e-5
    # regularisation
    drop_path: float = 0.0
    drop_path_schedule: str = "linear"  # linear (timm: 0 at the first block, drop_path at the last) | uniform (DeiT-III)
    # the class token's initialisation: None keeps the timm model's own (timm 1.0: normal, std 1e-6); a value draws it
    # from trunc_normal_(std=value) (DeiT's models.py via timm 0.3.2 and DeiT-III's models_v2.py: std 0.02)
    cls_token_std: Optional[float] = None
    drop_rate: float = 0.0
    smoothing: float = 0.0
    mixup: float = 0.0
    cutmix: float = 0.0
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: str = "batch"
    bce_loss: bool = False
    bce_target_thresh: Optional[float] = None
    clip_grad: Optional[float] = None
    # augmentation (timm create_transform)
    img_size: Optional[int] = None  # recipe-specific input size (DeiT-III first phase), else the model's
    scale: List[float] = field(default_factory=lambda: [0.08, 1.0])
    ratio: List[float] = field(default_factory=lambda: [0.75, 1.3333333333])
    hflip: float = 0.5
    color_jitter: Optional[float] = 0.4
    auto_augment: Optional[str] = None  # e.g. rand-m9-mstd0.5-inc1, or 3a (3-Augment)
    train_interpolation: str = "bicubic"
    reprob: float = 0.0
    remode: str = "pixel"
    recount: int = 1
    crop_pct: float = 0.875  # eval resize/crop ratio
    eval_interpolation: str = "bicubic"
    repeated_aug: int = 0  # RepeatAugSampler repeats (0 = off)
    # EMA (timm ModelEmaV3)
    ema: bool = True
    ema_decay: float = 0.99996
    reference_global_batch: Optional[int] = None  # the batch the recipe was published with (documentation)
    # the autocast precision the recipe's authors trained with; trainer.precision=auto uses it on CUDA (else bf16)
    precision: Optional[str] = None  # null | fp32 | bf16 | fp16 (fp16: with a dynamic loss scaler)
    # which weights of trainer.init_from's checkpoint a run starts from: ema (when present) | model (DeiT-III's
    # --finetune loads checkpoint['model'])
    init_weights: str = "ema"


@dataclass
class TrainerConfig:
    epochs: int = II("recipe.epochs")
    max_steps: Optional[int] = None  # optional cap on optimizer steps (the schedule still spans `epochs`)
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "auto"  # auto (on CUDA the recipe's precision, else bf16; fp32 on CPU) | fp32 | bf16 | fp16
    compile: bool = False
    strategy: str = "ddp"  # ddp (also for one process) | fsdp (FSDP2 fully_shard, sharded checkpoints)
    accum_steps: int = 1
    log_every_n_steps: int = 20
    checkpoint_every_n_steps: Optional[int] = None
    eval_every_n_epochs: int = 1
    resume: str = "auto"  # auto | never | <path to a checkpoint>
    overwrite: bool = False  # with resume=never: archive the run already in the directory, then start afresh
    init_from: Optional[str] = None  # weights to start from (e.g. the DeiT-III first phase); pos_embed resized
    max_loss: Optional[float] = None  # a loss above this counts as divergence (besides non-finite); None: the default
    # guard, max_loss_factor x the chance loss (ln num_classes; ln 2 with recipe.bce_loss); docs/training.md
    max_loss_factor: Optional[float] = 10.0  # null: no default guard (non-finite values still count)
    torch_threads: Optional[int] = None


@dataclass
class LoggerConfig:
    wandb: bool = False
    project: str = "quest"
    entity: Optional[str] = None
    mode: str = "offline"  # offline unless the user configures wandb (online | offline | disabled)
    group: Optional[str] = None  # None: derived from the Hydra choices
    name: Optional[str] = None
    tags: List[str] = field(default_factory=list)


@dataclass
class DiagnosticsConfig:
    every_n_steps: int = 0  # 0 = off
    num_samples: int = 8
    per_head: bool = False
    entropy_threshold: float = 0.5
    max_logit_warning: Optional[float] = None


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    # Values an experiment overlay (configs/experiment/) looks up by model, e.g. Table 2's epochs per ViT size:
    # trainer.epochs: ${experiment_values.epochs.${model.name}}. Unused otherwise.
    experiment_values: Dict[str, Any] = field(default_factory=dict)


#: Keys that say where and how a run executes, not what it trains: they are not part of the run directory's name,
#: and may differ when a run resumes (docs/training.md, "Runs, resume and provenance"). Patterns end in ".*".
OPERATIONAL_KEYS = (
    "data.num_workers", "data.pin_memory", "data.eval_batch_size", "data.download",
    "trainer.device", "trainer.compile", "trainer.torch_threads", "trainer.log_every_n_steps",
    "trainer.checkpoint_every_n_steps", "trainer.resume", "trainer.overwrite", "trainer.max_steps",
    "trainer.max_loss_factor", "data.max_skipped_fraction", "data.preflight", "logger.*", "model.pretrained_download",
)
#: Keys that name a run (a different value is a different run) but may still change when it resumes in the same
#: directory: the data set moved (its size and classes are checked), a longer run (the schedule is rebuilt for the
#: new length; a shorter one is refused), validation cadence and diagnostics (outputs only).
RESUME_SAFE_KEYS = (*OPERATIONAL_KEYS, "data.root", "trainer.epochs", "trainer.eval_every_n_epochs", "diagnostics.*")


def matches_key(key: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """``key`` equals a pattern, or lies under a ``prefix.*`` pattern."""
    return any(key == p or (p.endswith(".*") and (key == p[:-2] or key.startswith(p[:-1]))) for p in patterns)


def register_configs() -> None:
    """The schema in Hydra's ConfigStore, and the ``${quest_run_suffix:}`` resolver of the run directory's name."""
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    if not OmegaConf.has_resolver("quest_run_suffix"):
        from quest.engine.run_dir import run_name_suffix

        OmegaConf.register_new_resolver("quest_run_suffix", run_name_suffix)
    if not OmegaConf.has_resolver("quest_safe_name"):
        from quest.engine.run_dir import safe_name

        OmegaConf.register_new_resolver("quest_safe_name", safe_name)
