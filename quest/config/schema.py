"""Structured config schema: the keys and types that configs, docs, tests and users rely on.

Every ``float`` field (also ``Optional[float]`` and ``List[float]``) must hold finite values: the config checks
derive that list from these dataclasses (:func:`quest.config.checks.float_keys`), so a new float field is checked
without being listed anywhere. A field where infinity means something would say so with ``metadata=NON_FINITE_OK``.

Registered in Hydra's ConfigStore as ``train_schema``; configs/train.yaml lists it first in its defaults, so every
group file merges into a typed node and a misspelt key or a wrong type fails at start, naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import II, MISSING

from quest.config.checks import ConfigError
from quest.data.config import DataConfig  # the keys every data set has; each data set extends it (docs/data.md)

#: field metadata of a float field whose value may be infinite or NaN (none today; see the module docstring)
NON_FINITE_OK = {"finite": False}


@dataclass
class AttentionConfig:
    """The attention=<option> group: which formulation replaces timm's attention."""

    name: str = "quest"  # the attention formulation (configs/attention/*.yaml; quest.attention.list_attentions)
    # initial values of learnable scales and other formulation options (see docs/attention.md)
    options: Dict[str, Any] = field(default_factory=dict)
    # the q/k transforms' fused Triton kernels on CUDA (docs/attention.md, "Fused kernels"): auto (each checked once
    # against its PyTorch reference on the device; a failure warns once and the PyTorch path runs), on (refused where
    # they cannot run), off
    fused: str = "auto"


@dataclass
class ModelConfig:
    """The model=<option> group: the timm ViT and its size options."""

    name: str = MISSING  # a timm model name (configs/model/*.yaml for the curated ones)
    img_size: Optional[int] = None  # None: the model's own default
    # LayerScale's initial value (timm's init_values); None: the timm model's own (1e-6 for timm's deit3_*, whose
    # authors' models_v2.py uses 1e-4: configs/model/deit3_*.yaml set that)
    layer_scale_init: Optional[float] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)  # any other timm model kwargs
    # weights a new run starts from, converted to the chosen attention (docs/interop.md): a timm tag
    # (deit_tiny_patch16_224.fb_in1k), local-dir:<quest-export folder>, hf-hub:<repo> or a .safetensors/.pth file
    pretrained: Optional[str] = None
    pretrained_download: bool = False  # read the Hub / timm's weights from the local caches only, unless true


@dataclass
class RecipeConfig:
    """The recipe=<option> group: optimiser, schedule, regularisation and augmentation."""

    name: str = MISSING  # the recipe's name (in the run directory's name)
    epochs: int = MISSING  # epochs the schedule spans
    # the recipe's values that depend on the model's size, one row per size word of the timm model name
    # (deit3_base_patch16_224 -> base; a row named "default" serves every other size), read by the recipe's own
    # keys as ${quest_model_size:lr} (docs/training.md, Recipes)
    by_model_size: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    # optimiser (timm create_optimizer_v2)
    opt: str = "adamw"  # optimiser name (timm create_optimizer_v2)
    lr: Optional[float] = None  # absolute lr; if None, base_lr * global_batch / lr_base_size
    base_lr: Optional[float] = None  # lr per lr_base_size images of global batch, scaled linearly
    lr_base_size: int = 512  # the global batch base_lr is given for
    weight_decay: float = 0.05  # decoupled weight decay
    opt_eps: float = 1e-8  # the optimiser's epsilon
    opt_betas: Optional[List[float]] = None  # Adam betas (null: the optimiser's default)
    momentum: float = 0.9  # SGD momentum
    # cosine schedule (timm create_scheduler_v2), stepped on: updates (every optimizer step) | epochs (after each
    # epoch, epoch e at the schedule's value for e, as timm's train.py) | deit (as DeiT's main.py: step(epoch) after
    # epoch `epoch`, so epoch e trains at the value for e - 1; docs/training.md)
    sched: str = "cosine"
    sched_on: str = "updates"  # when the schedule steps: updates | epochs | deit (see sched)
    warmup_epochs: float = 5.0  # linear warm-up length
    warmup_lr: float = 1e-6  # lr at the start of the warm-up
    min_lr: float = 1e-5  # lr at the end of the cosine
    # regularisation
    drop_path: float = 0.0  # stochastic depth rate
    drop_path_schedule: str = "linear"  # linear (timm: 0 at the first block, drop_path at the last) | uniform (DeiT-III)
    # the class token's initialisation: None keeps the timm model's own (timm 1.0: normal, std 1e-6); a value draws it
    # from trunc_normal_(std=value) (DeiT's models.py via timm 0.3.2 and DeiT-III's models_v2.py: std 0.02)
    cls_token_std: Optional[float] = None
    drop_rate: float = 0.0  # dropout before the classifier head
    smoothing: float = 0.0  # label smoothing
    mixup: float = 0.0  # mixup alpha (0 = off)
    cutmix: float = 0.0  # cutmix alpha (0 = off)
    mixup_prob: float = 1.0  # probability of mixup or cutmix per batch
    mixup_switch_prob: float = 0.5  # probability of cutmix instead of mixup when both are on
    mixup_mode: str = "batch"  # batch | pair | elem (timm Mixup)
    bce_loss: bool = False  # binary cross-entropy instead of softmax cross-entropy (DeiT-III)
    bce_target_thresh: Optional[float] = None  # with bce_loss: binarise the targets at this value
    clip_grad: Optional[float] = None  # clip the gradient norm to this (null: no clipping)
    # augmentation (timm create_transform)
    img_size: Optional[int] = None  # recipe-specific input size (DeiT-III first phase), else the model's
    scale: List[float] = field(default_factory=lambda: [0.08, 1.0])  # RandomResizedCrop area range
    ratio: List[float] = field(default_factory=lambda: [0.75, 1.3333333333])  # RandomResizedCrop aspect ratio range
    hflip: float = 0.5  # horizontal flip probability
    color_jitter: Optional[float] = 0.4  # colour jitter strength (null: off)
    auto_augment: Optional[str] = None  # e.g. rand-m9-mstd0.5-inc1, or 3a (3-Augment)
    train_interpolation: str = "bicubic"  # resampling of the training crops
    reprob: float = 0.0  # random erasing probability
    remode: str = "pixel"  # random erasing fill: const | rand | pixel
    recount: int = 1  # random erasing: regions per image
    crop_pct: float = 0.875  # eval resize/crop ratio
    eval_interpolation: str = "bicubic"  # resampling of the validation resize
    repeated_aug: int = 0  # RepeatAugSampler repeats (0 = off)
    # EMA (timm ModelEmaV3)
    ema: bool = True
    ema_decay: float = 0.99996  # EMA decay per update
    reference_global_batch: Optional[int] = None  # the batch the recipe was published with (documentation)
    # the autocast precision the recipe's authors trained with; trainer.precision=auto uses it on CUDA (else bf16)
    precision: Optional[str] = None  # null | fp32 | bf16 | fp16 (fp16: with a dynamic loss scaler)
    # which weights of trainer.init_from's checkpoint a run starts from: ema (when present) | model (DeiT-III's
    # --finetune loads checkpoint['model'])
    init_weights: str = "ema"


@dataclass
class TrainerConfig:
    """The trainer=<option> group: length, device, precision, checkpoints and resume."""

    epochs: int = II("recipe.epochs")  # epochs to train (default: the recipe's)
    max_steps: Optional[int] = None  # optional cap on optimizer steps (the schedule still spans `epochs`)
    seed: int = 0  # seed of the weights, data order and augmentation
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "auto"  # auto (on CUDA the recipe's precision, else bf16; fp32 on CPU) | fp32 | bf16 | fp16
    # float32 matmuls and convolutions: highest (IEEE fp32) | high (TF32 on Ampere and later) | medium; docs/training.md
    matmul_precision: str = "highest"
    compile: bool = False  # torch.compile the model and the loss (docs/training.md, "Compile")
    compile_mode: str = "default"  # default | max-autotune | max-autotune-no-cudagraphs | reduce-overhead
    compile_backend: str = "inductor"  # inductor | aot_eager | eager (trace only: debugging)
    strategy: str = "ddp"  # ddp (also for one process) | fsdp (FSDP2 fully_shard, sharded checkpoints)
    accum_steps: int = 1  # gradient accumulation: micro-batches per optimizer step
    log_every_n_steps: int = 20  # a progress line and a metrics.jsonl row every N steps
    checkpoint_every_n_steps: Optional[int] = None  # also save last.pt every N steps (null: at epoch ends only)
    eval_every_n_epochs: int = 1  # validate every N epochs (and after the last)
    resume: str = "auto"  # auto | never | <path to a checkpoint>
    overwrite: bool = False  # with resume=never: archive the run already in the directory, then start afresh
    init_from: Optional[str] = None  # weights to start from (e.g. the DeiT-III first phase); pos_embed resized
    max_loss: Optional[float] = None  # a loss above this counts as divergence (besides non-finite); None: the default
    # guard, max_loss_factor x the chance loss (ln num_classes; ln 2 with recipe.bce_loss); docs/training.md
    max_loss_factor: Optional[float] = 10.0  # null: no default guard (non-finite values still count)
    # CPU intra-op threads (null: 1 for the CPU presets, else torch's default; docs/training.md)
    torch_threads: Optional[int] = None
    # say so (once per epoch) when training waits for data more than this fraction of an epoch (docs/training.md)
    data_wait_warning: float = 0.1
    # on a GPU with a known peak: say so when MFU stays below this with little data wait
    low_mfu_warning: float = 0.3


@dataclass
class LoggerConfig:
    """The logger=<option> group: metrics.jsonl always; wandb and TensorBoard when asked (both may be on)."""

    wandb: bool = False  # also log to Weights & Biases (the [wandb] extra)
    tensorboard: bool = False  # also write TensorBoard event files to <run>/tensorboard (the [tensorboard] extra)
    project: str = "quest"  # wandb project
    entity: Optional[str] = None  # wandb entity (null: your default)
    mode: str = "offline"  # offline unless the user configures wandb (online | offline | disabled)
    group: Optional[str] = None  # None: derived from the Hydra choices
    name: Optional[str] = None  # wandb run name (null: the run directory's name)
    tags: List[str] = field(default_factory=list)  # wandb tags


@dataclass
class DiagnosticsConfig:
    """The diagnostics=<option> group: attention statistics during training (docs/diagnostics.md)."""

    every_n_steps: int = 0  # 0 = off
    num_samples: int = 8  # validation images the attention statistics are measured on
    per_head: bool = False  # also record every head's statistics (else the mean over heads)
    entropy_threshold: float = 0.5  # attention entropy (nats) below which a head counts as collapsed
    max_logit_warning: Optional[float] = None  # warn when the largest attention logit exceeds this (null: never)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    diagnostics: DiagnosticsConfig = field(default_factory=DiagnosticsConfig)
    # The experiment's own values (configs/experiment/) looked up by model, not the recipe's (those are rows of
    # recipe.by_model_size), e.g. Table 2's epochs per ViT size (its compute budget):
    # trainer.epochs: ${experiment_values.epochs.${model.name}}. Unused otherwise.
    experiment_values: Dict[str, Any] = field(default_factory=dict)


#: Keys that say where and how a run executes, not what it trains: they are not part of the run directory's name,
#: and may differ when a run resumes (docs/training.md, "Runs, resume and provenance"). Patterns end in ".*".
OPERATIONAL_KEYS = (
    "data.num_workers", "data.pin_memory", "data.eval_batch_size", "data.download",
    "trainer.device", "trainer.compile", "trainer.compile_mode", "trainer.compile_backend",
    "trainer.torch_threads", "trainer.log_every_n_steps", "attention.fused",
    "trainer.checkpoint_every_n_steps", "trainer.resume", "trainer.overwrite", "trainer.max_steps",
    "trainer.max_loss_factor", "trainer.data_wait_warning", "trainer.low_mfu_warning", "data.max_skipped_fraction",
    "data.preflight", "logger.*", "model.pretrained_download",
)
#: Keys that name a run (a different value is a different run) but may still change when it resumes in the same
#: directory: the data set moved (its size and classes are checked), a longer run (the schedule is rebuilt for the
#: new length; a shorter one is refused), validation cadence and diagnostics (outputs only).
#: A recipe's per-size table only looks values up: the values it gives (recipe.lr, ...) are compared themselves.
#: (model.recipe_values, where older quest kept those numbers, is upgraded away by quest.store.compat before a comparison.)
RESUME_SAFE_KEYS = (*OPERATIONAL_KEYS, "data.root", "trainer.epochs", "trainer.eval_every_n_epochs", "diagnostics.*",
                    "recipe.by_model_size.*")


def matches_key(key: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """``key`` equals a pattern, or lies under a ``prefix.*`` pattern."""
    return any(key == p or (p.endswith(".*") and (key == p[:-2] or key.startswith(p[:-1]))) for p in patterns)


def model_size(model_name: str) -> str:
    """The size word of a timm model name, the key of a recipe's ``by_model_size`` table: the word after the
    family (``vit_base_patch16_224`` -> ``base``, ``deit3_huge_patch14_224`` -> ``huge``, ``vit_pico_patch4_16`` ->
    ``pico``)."""
    words = str(model_name).split("_")
    return words[1] if len(words) > 1 else words[0]


def model_size_value(key: str, *, _root_: Any) -> Any:
    """OmegaConf resolver ``${quest_model_size:KEY}``: ``recipe.by_model_size[<size of model.name>][KEY]``, else the
    ``default`` row's KEY; a size the table lacks is a clear error naming the model and the sizes the recipe has."""
    recipe, model_name = _root_.recipe, _root_.model.name
    table = recipe.get("by_model_size") or {}
    size = model_size(model_name)
    for row in (size, "default"):
        if row in table and key in table[row]:
            return table[row][key]
    sizes = ", ".join(sorted(str(s) for s in table)) or "none"
    raise ConfigError(
        f"recipe {recipe.get('name')!r} has no {key} for model {model_name!r} (size {size!r}); its table "
        f"recipe.by_model_size has rows for: {sizes}. Choose a model of one of those sizes, or give the value: "
        f"recipe.{key}=<value> (or recipe.by_model_size.{size}.{key}=<value>)")
