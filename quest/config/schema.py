"""Structured config schema: the keys and types that configs, docs, tests and users rely on.

Each field declares what its value may be, once, with the metadata quest's records use (quest.store.records:
``bounded``, ``one_of``, ``listed``, ``matching``, ``described``; quest.config.checks.process_count), and every
``float`` (also ``Optional[float]``, ``List[float]``) must be finite. quest.config.checks.declared_problems walks a
composed config against these declarations, so a new field is checked by declaring it. A field without a
declaration says why (a free name, a path, a value checked against a registry of plugins); a ``bool``'s type is its
whole range.

Registered in Hydra's ConfigStore as ``train_schema``; configs/train.yaml lists it first in its defaults, so every
group file merges into a typed node and a misspelt key or a wrong type fails at start, naming the key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from omegaconf import II, MISSING

from quest.config.checks import DEVICE, MATMUL_PRECISIONS, PRECISIONS, ConfigError, process_count
from quest.data.config import CROP_FRACTION, DataConfig, image_size  # the keys every data set has (docs/data.md)
from quest.store.records import SEED_RANGE, bounded, described, listed, one_of

#: attention.fused: quest.attention.fused_check.MODES, written out here because that module imports torch, which
#: --help and tab completion must not wait for (tests/config/test_declared_bounds.py holds the two equal)
FUSED_MODES = ("auto", "on", "off")
#: recipe.sched: timm create_scheduler_v2's schedules
SCHEDULERS = ("cosine", "tanh", "step", "constant", "multistep", "plateau", "poly", "rsqrt")
TRAIN_INTERPOLATIONS = ("bilinear", "bicubic", "nearest", "random")
EVAL_INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
#: trainer.compile_mode: torch.compile's modes (docs/training.md, "Compile")
COMPILE_MODES = ("default", "max-autotune", "max-autotune-no-cudagraphs", "reduce-overhead")
#: trainer.compile_backend: inductor generates code; aot_eager and eager trace only (debugging, cheap tests)
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
#: a rate that must stay below 1 (a momentum, a drop rate, an EMA decay)
BELOW_ONE = bounded(0, 1, open_high=True)
#: numpy's seeds
SEED = bounded(*SEED_RANGE, **described("an integer in 0..2**32-1 (numpy's seeds)"))
#: RandomResizedCrop's ranges; min <= max is a relation between the two values (quest.train.checks)
SCALE = {**bounded(0, 1, open_low=True), **listed(2), **described("[min, max] with 0 < min <= max <= 1")}
RATIO = {**bounded(0, open_low=True), **listed(2), **described("[min, max] with 0 < min <= max")}
PROBABILITY = bounded(0, 1)
POSITIVE = bounded(0, open_low=True)
NON_NEGATIVE = bounded(0)


@dataclass
class AttentionConfig:
    """The attention=<option> group: which formulation replaces timm's attention."""

    # the attention formulation (configs/attention/*.yaml; quest.attention.list_attentions): checked against that
    # registry, which plugins fill, so no choices here
    name: str = "quest"
    # initial values of learnable scales and other formulation options (see docs/attention.md): free-form, each
    # formulation checks its own
    options: Dict[str, Any] = field(default_factory=dict)
    # the q/k transforms' fused Triton kernels on CUDA (docs/attention.md, "Fused kernels"): auto (each checked once
    # against its PyTorch reference on the device; a failure warns once and the PyTorch path runs), on (refused where
    # they cannot run), off
    fused: str = field(default="auto", metadata=one_of(*FUSED_MODES))


@dataclass
class ModelConfig:
    """The model=<option> group: the timm ViT and its size options."""

    # a timm model name (configs/model/*.yaml for the curated ones): checked against timm's registry
    name: str = MISSING
    img_size: Optional[int] = field(default=None, metadata=image_size())  # None: the model's own default
    # LayerScale's initial value (timm's init_values); None: the timm model's own (1e-6 for timm's deit3_*, whose
    # authors' models_v2.py uses 1e-4: configs/model/deit3_*.yaml set that)
    layer_scale_init: Optional[float] = field(default=None, metadata=POSITIVE)
    kwargs: Dict[str, Any] = field(default_factory=dict)  # any other timm model kwargs (timm checks them)
    # weights a new run starts from, converted to the chosen attention (docs/interop.md): a timm tag
    # (deit_tiny_patch16_224.fb_in1k), local-dir:<quest-export folder>, hf-hub:<repo> or a .safetensors/.pth file;
    # its form checked by quest.models.pretrained.pretrained_problem
    pretrained: Optional[str] = None
    pretrained_download: bool = False  # read the Hub / timm's weights from the local caches only, unless true


@dataclass
class RecipeConfig:
    """The recipe=<option> group: optimiser, schedule, regularisation and augmentation."""

    name: str = MISSING  # the recipe's name (in the run directory's name): a free name
    epochs: int = field(default=MISSING, metadata=bounded(1))  # epochs the schedule spans
    # the recipe's values that depend on the model's size, one row per size word of the timm model name
    # (deit3_base_patch16_224 -> base; a row named "default" serves every other size), read by the recipe's own
    # keys as ${quest_model_size:lr} (docs/training.md, Recipes)
    by_model_size: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    # optimiser (timm create_optimizer_v2)
    opt: str = "adamw"  # optimiser name (timm create_optimizer_v2): checked against timm.optim.list_optimizers()
    lr: Optional[float] = field(default=None, metadata=POSITIVE)  # absolute lr; if None, base_lr * global_batch / lr_base_size
    # lr per lr_base_size images of global batch, scaled linearly
    base_lr: Optional[float] = field(default=None, metadata=POSITIVE)
    lr_base_size: int = field(default=512, metadata=bounded(1))  # the global batch base_lr is given for
    weight_decay: float = field(default=0.05, metadata=NON_NEGATIVE)  # decoupled weight decay
    opt_eps: float = field(default=1e-8, metadata=POSITIVE)  # the optimiser's epsilon
    # Adam betas (null: the optimiser's default)
    opt_betas: Optional[List[float]] = field(default=None, metadata={**BELOW_ONE, **listed(2)})
    momentum: float = field(default=0.9, metadata=BELOW_ONE)  # SGD momentum
    # cosine schedule (timm create_scheduler_v2), stepped on: updates (every optimizer step) | epochs (after each
    # epoch, epoch e at the schedule's value for e, as timm's train.py) | deit (as DeiT's main.py: step(epoch) after
    # epoch `epoch`, so epoch e trains at the value for e - 1; docs/training.md)
    sched: str = field(default="cosine", metadata=one_of(*SCHEDULERS))
    # when the schedule steps: updates | epochs | deit (see sched)
    sched_on: str = field(default="updates", metadata=one_of("updates", "epochs", "deit"))
    warmup_epochs: float = field(default=5.0, metadata=NON_NEGATIVE)  # linear warm-up length
    warmup_lr: float = field(default=1e-6, metadata=NON_NEGATIVE)  # lr at the start of the warm-up
    min_lr: float = field(default=1e-5, metadata=NON_NEGATIVE)  # lr at the end of the cosine
    # regularisation
    drop_path: float = field(default=0.0, metadata=BELOW_ONE)  # stochastic depth rate
    # linear (timm: 0 at the first block, drop_path at the last) | uniform (DeiT-III)
    drop_path_schedule: str = field(default="linear", metadata=one_of("linear", "uniform"))
    # the class token's initialisation: None keeps the timm model's own (timm 1.0: normal, std 1e-6); a value draws it
    # from trunc_normal_(std=value) (DeiT's models.py via timm 0.3.2 and DeiT-III's models_v2.py: std 0.02)
    cls_token_std: Optional[float] = field(default=None, metadata=POSITIVE)
    drop_rate: float = field(default=0.0, metadata=BELOW_ONE)  # dropout before the classifier head
    smoothing: float = field(default=0.0, metadata=BELOW_ONE)  # label smoothing
    mixup: float = field(default=0.0, metadata=NON_NEGATIVE)  # mixup alpha (0 = off)
    cutmix: float = field(default=0.0, metadata=NON_NEGATIVE)  # cutmix alpha (0 = off)
    mixup_prob: float = field(default=1.0, metadata=PROBABILITY)  # probability of mixup or cutmix per batch
    mixup_switch_prob: float = field(default=0.5, metadata=PROBABILITY)  # probability of cutmix instead of mixup when both are on
    mixup_mode: str = field(default="batch", metadata=one_of("batch", "pair", "elem"))  # batch | pair | elem (timm Mixup)
    bce_loss: bool = False  # binary cross-entropy instead of softmax cross-entropy (DeiT-III)
    # with bce_loss: binarise the targets at this value
    bce_target_thresh: Optional[float] = field(default=None, metadata=PROBABILITY)
    clip_grad: Optional[float] = field(default=None, metadata=POSITIVE)  # clip the gradient norm to this (null: no clipping)
    # augmentation (timm create_transform)
    # recipe-specific input size (DeiT-III first phase), else the model's
    img_size: Optional[int] = field(default=None, metadata=image_size())
    scale: List[float] = field(default_factory=lambda: [0.08, 1.0], metadata=SCALE)  # RandomResizedCrop area range
    # RandomResizedCrop aspect ratio range
    ratio: List[float] = field(default_factory=lambda: [0.75, 1.3333333333], metadata=RATIO)
    hflip: float = field(default=0.5, metadata=PROBABILITY)  # horizontal flip probability
    color_jitter: Optional[float] = field(default=0.4, metadata=NON_NEGATIVE)  # colour jitter strength (null: off)
    auto_augment: Optional[str] = None  # e.g. rand-m9-mstd0.5-inc1, or 3a (3-Augment): timm parses it (a check)
    # resampling of the training crops
    train_interpolation: str = field(default="bicubic", metadata=one_of(*TRAIN_INTERPOLATIONS))
    reprob: float = field(default=0.0, metadata=PROBABILITY)  # random erasing probability
    remode: str = field(default="pixel", metadata=one_of("const", "rand", "pixel"))  # random erasing fill: const | rand | pixel
    # random erasing: regions per image, each drawn in a loop of up to 10 tries per image (a typo's 10**12 hangs)
    recount: int = field(default=1, metadata=bounded(1, 16, **described("an integer in 1..16")))
    crop_pct: float = field(default=0.875, metadata=CROP_FRACTION)  # eval resize/crop ratio
    # resampling of the validation resize
    eval_interpolation: str = field(default="bicubic", metadata=one_of(*EVAL_INTERPOLATIONS))
    # RepeatAugSampler repeats (0 = off; DeiT's 3): each repeat adds the data set's length to every epoch's index
    # list (a typo's 10**12 asked for terabytes)
    repeated_aug: int = field(default=0, metadata=bounded(0, 16, **described("an integer in 0..16 (0 = off)")))
    # EMA (timm ModelEmaV3)
    ema: bool = True
    ema_decay: float = field(default=0.99996, metadata=BELOW_ONE)  # EMA decay per update
    # the batch the recipe was published with (documentation)
    reference_global_batch: Optional[int] = field(default=None, metadata=bounded(1))
    # the autocast precision the recipe's authors trained with; trainer.precision=auto uses it on CUDA (else bf16)
    # null | fp32 | bf16 | fp16 (fp16: with a dynamic loss scaler)
    precision: Optional[str] = field(default=None, metadata=one_of(*PRECISIONS))
    # which weights of trainer.init_from's checkpoint a run starts from: ema (when present) | model (DeiT-III's
    # --finetune loads checkpoint['model'])
    init_weights: str = field(default="ema", metadata=one_of("ema", "model"))


@dataclass
class TrainerConfig:
    """The trainer=<option> group: length, device, precision, checkpoints and resume."""

    epochs: int = field(default=II("recipe.epochs"), metadata=bounded(1))  # epochs to train (default: the recipe's)
    # optional cap on optimizer steps (the schedule still spans `epochs`)
    max_steps: Optional[int] = field(default=None, metadata=bounded(1))
    seed: int = field(default=0, metadata=SEED)  # seed of the weights, data order and augmentation
    device: str = field(default="auto", metadata=DEVICE)  # auto | cpu | cuda | cuda:N
    # auto (on CUDA the recipe's precision, else bf16; fp32 on CPU) | fp32 | bf16 | fp16
    precision: str = field(default="auto", metadata=one_of("auto", *PRECISIONS))
    # float32 matmuls and convolutions: highest (IEEE fp32) | high (TF32 on Ampere and later) | medium; docs/training.md
    matmul_precision: str = field(default="highest", metadata=one_of(*MATMUL_PRECISIONS))
    compile: bool = False  # torch.compile the model and the loss (docs/training.md, "Compile")
    # default | max-autotune | max-autotune-no-cudagraphs | reduce-overhead
    compile_mode: str = field(default="default", metadata=one_of(*COMPILE_MODES))
    # inductor | aot_eager | eager (trace only: debugging)
    compile_backend: str = field(default="inductor", metadata=one_of(*COMPILE_BACKENDS))
    # ddp (also for one process) | fsdp (FSDP2 fully_shard, sharded checkpoints)
    strategy: str = field(default="ddp", metadata=one_of("ddp", "fsdp"))
    accum_steps: int = field(default=1, metadata=bounded(1))  # gradient accumulation: micro-batches per optimizer step
    log_every_n_steps: int = field(default=20, metadata=bounded(1))  # a progress line and a metrics.jsonl row every N steps
    # also save last.pt every N steps (null: at epoch ends only)
    checkpoint_every_n_steps: Optional[int] = field(default=None, metadata=bounded(1))
    eval_every_n_epochs: int = field(default=1, metadata=bounded(1))  # validate every N epochs (and after the last)
    resume: str = "auto"  # auto | never | <path to a checkpoint>: a path, checked for a file (quest.train.checks)
    overwrite: bool = False  # with resume=never: archive the run already in the directory, then start afresh
    # a path, checked for a file (quest.train.checks); weights to start from (e.g. the DeiT-III first phase); pos_embed resized
    init_from: Optional[str] = None
    # a loss above this counts as divergence (besides non-finite); None: the default
    max_loss: Optional[float] = field(default=None, metadata=POSITIVE)
    # guard, max_loss_factor x the chance loss (ln num_classes; ln 2 with recipe.bce_loss); docs/training.md
    # null: no default guard (non-finite values still count)
    max_loss_factor: Optional[float] = field(default=10.0, metadata=POSITIVE)
    # CPU intra-op threads (null: 1 for the CPU presets, else torch's default; docs/training.md)
    torch_threads: Optional[int] = field(default=None, metadata=process_count())
    # say so (once per epoch) when training waits for data more than this fraction of an epoch (docs/training.md)
    data_wait_warning: float = field(default=0.1, metadata=PROBABILITY)
    # on a GPU with a known peak: say so when MFU stays below this with little data wait
    low_mfu_warning: float = field(default=0.3, metadata=PROBABILITY)


@dataclass
class LoggerConfig:
    """The logger=<option> group: metrics.jsonl always; wandb and TensorBoard when asked (both may be on)."""

    wandb: bool = False  # also log to Weights & Biases (the [wandb] extra)
    tensorboard: bool = False  # also write TensorBoard event files to <run>/tensorboard (the [tensorboard] extra)
    # wandb project: wandb's limits on a name, checked only with logger.wandb=true (quest.config.wandb_check)
    project: str = "quest"
    # wandb entity (null: your default): checked only with logger.wandb=true (quest.config.wandb_check)
    entity: Optional[str] = None
    # offline unless the user configures wandb (online | offline | disabled): checked in quest.config.wandb_check,
    # whose refusal names WANDB_MODE when the value came from it
    mode: str = "offline"
    group: Optional[str] = None  # a free name; None: derived from the Hydra choices
    name: Optional[str] = None  # wandb run name, a free name (null: the run directory's name)
    tags: List[str] = field(default_factory=list)  # wandb tags (free names)


@dataclass
class DiagnosticsConfig:
    """The diagnostics=<option> group: attention statistics during training (docs/diagnostics.md)."""

    # attention statistics on num_samples validation images every N training steps
    every_n_steps: int = field(default=0, metadata=bounded(0, **described("an integer >= 0 (0 = off)")))
    num_samples: int = field(default=8, metadata=bounded(1))  # validation images the attention statistics are measured on
    per_head: bool = False  # also record every head's statistics (else the mean over heads)
    # attention entropy (nats) below which a head counts as collapsed
    entropy_threshold: float = field(default=0.5, metadata=NON_NEGATIVE)
    # warn when the largest attention logit exceeds this (null: never)
    max_logit_warning: Optional[float] = field(default=None, metadata=POSITIVE)


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
