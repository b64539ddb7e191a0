"""Structured config of ``eval.py``: every key and type, registered in Hydra's ConfigStore as ``eval_schema``.

configs/eval.yaml lists ``eval_schema`` first in its defaults, so the suite files in configs/eval/ merge into typed
nodes: a misspelt key or a wrong type fails at start, naming the key. Protocol numbers (PGD steps, SPSA samples,
severities, ...) have their published defaults here and are restated in the suite files for visibility.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from quest.schema import AttentionConfig, DataConfig, LoggerConfig, ModelConfig

__all__ = [
    "IMAGENET_C_CORRUPTIONS", "IMAGENET_C_EXTRA", "EvalConfig", "EvalSettings", "register_eval_configs",
    "default_eval_dir", "evaluated_name",
]

# ImageNet-C (Hendrycks & Dietterich 2019): the 15 corruptions of the mCE, in the paper's order, and the 4 extra
# ("validation") corruptions that have no AlexNet normaliser and are reported apart.
IMAGENET_C_CORRUPTIONS = [
    "gaussian_noise", "shot_noise", "impulse_noise", "defocus_blur", "glass_blur", "motion_blur", "zoom_blur",
    "snow", "frost", "fog", "brightness", "contrast", "elastic_transform", "pixelate", "jpeg_compression",
]
IMAGENET_C_EXTRA = ["speckle_noise", "gaussian_blur", "spatter", "saturate"]
ONE_OVER_255 = 1.0 / 255.0


@dataclass
class EvalModelConfig(ModelConfig):
    # Unset in checkpoint mode (the checkpoint names its model); model=<group or timm name> sets it otherwise.
    name: Optional[str] = None


@dataclass
class EvalAttentionConfig(AttentionConfig):
    # No default: evaluating a timm model with the wrong attention would give silently wrong numbers.
    name: Optional[str] = None


@dataclass
class RootsConfig:
    val: Optional[str] = None  # ImageNet val: <val>/<wnid>/<image>.JPEG (1000 wnid folders)
    v2: Optional[str] = None  # folder holding imagenetv2-<variant>-format-val/<0..999>/<image>.jpeg
    real: Optional[str] = None  # ILSVRC2012_val_*.JPEG (flat or in wnid folders); None: roots.val
    a: Optional[str] = None  # ImageNet-A: <a>/<wnid>/<image> (200 wnid folders)
    r: Optional[str] = None  # ImageNet-R: <r>/<wnid>/<image> (200 wnid folders)
    c: Optional[str] = None  # ImageNet-C: <c>/<corruption>/<severity>/<wnid>/<image>.JPEG


@dataclass
class ImageNetValConfig:
    pass


@dataclass
class ImageNetV2Config:
    variants: List[str] = field(default_factory=lambda: ["matched-frequency", "threshold0.7", "top-images"])


@dataclass
class ImageNetRealConfig:
    real_json: Optional[str] = None  # None: the real.json timm ships (timm/data/_info/imagenet_real_labels.json)


@dataclass
class ImageNetSubsetConfig:
    # also report the "ImageNet-200" clean number: val restricted to the same 200 classes (needs eval.roots.val)
    clean_subset: bool = True


@dataclass
class ImageNetCConfig:
    corruptions: List[str] = field(default_factory=lambda: list(IMAGENET_C_CORRUPTIONS))
    extra_corruptions: List[str] = field(default_factory=lambda: list(IMAGENET_C_EXTRA))
    severities: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])


@dataclass
class CleanConfig:
    max_samples: Optional[int] = None  # None: the whole val split; else an evenly spaced fixed subset


@dataclass
class CorruptionsConfig:
    corruptions: List[str] = field(default_factory=lambda: list(IMAGENET_C_CORRUPTIONS))
    extra_corruptions: List[str] = field(default_factory=lambda: list(IMAGENET_C_EXTRA))
    severities: List[int] = field(default_factory=lambda: [1, 2, 3, 4, 5])
    max_samples: Optional[int] = None  # None: the whole val split; else an evenly spaced fixed subset
    seed: int = 0  # each sample's corruption randomness is seeded from (seed, corruption, severity, index)


@dataclass
class FGSMConfig:
    eps: List[float] = field(default_factory=lambda: [ONE_OVER_255])
    max_samples: Optional[int] = None  # None: adversarial.max_samples; else a smaller evenly spaced subset


@dataclass
class PGDConfig:
    eps: List[float] = field(default_factory=lambda: [ONE_OVER_255])
    steps: int = 20
    step_size: float = 0.15  # a fraction of eps (Elliptical-attention protocol: 0.15 * eps)
    random_start: bool = True
    max_samples: Optional[int] = None  # None: adversarial.max_samples; else a smaller evenly spaced subset


@dataclass
class SPSAConfig:
    eps: List[float] = field(default_factory=lambda: [0.1])
    lr: float = 0.01  # Adam
    delta: float = 0.01
    nb_sample: int = 128
    nb_iter: int = 40
    random_start: bool = True  # uniform in the eps-ball, as cleverhans' SPSA (the authors' code) starts
    # iterate: the gradient estimated at x + perturbation (the algorithm); cleverhans_torch: at 2x, where cleverhans'
    # torch SPSA and the authors' copy of it estimate it (quest/evaluation/spsa.py)
    estimate_at: str = "iterate"
    max_batch_size: int = 256  # model inputs per forward while estimating the gradient
    max_samples: Optional[int] = None  # None: adversarial.max_samples; else a smaller evenly spaced subset


@dataclass
class AutoAttackConfig:
    eps: List[float] = field(default_factory=lambda: [ONE_OVER_255])
    version: str = "standard"  # APGD-CE, APGD-T (9 targets), FAB-T (9 targets), Square (5000 queries)
    norm: str = "Linf"
    max_samples: Optional[int] = None  # None: adversarial.max_samples; else a smaller evenly spaced subset


@dataclass
class AdversarialConfig:
    attacks: List[str] = field(default_factory=lambda: ["fgsm", "pgd", "spsa", "autoattack"])
    # pixel: [0, 1] images, normalisation inside the model (sound); normalized: the tensor after mean/std, eps in
    # normalised units, FGSM/PGD/SPSA unclipped (the Elliptical-attention code's convention, QUEST Tables 3/4)
    space: str = "pixel"
    # data: the configured data set's val split (the checkpoint's data, or data=<name>); imagenet_val: eval.roots.val
    # in ImageNet's layout, labels from the sorted wnids (as the imagenet_val evaluation)
    source: str = "data"
    # ground_truth: the data set's labels (sound); predicted: the clean predictions; paper: predicted for FGSM, PGD
    # and SPSA, ground truth for AutoAttack (the authors' scripts). Accuracy is always against the data set's labels.
    labels: str = "ground_truth"
    # estimator of elliptical layers while attacked and scored: None = as trained; mean | median (the authors
    # attacked with --grad-median)
    elliptical_estimator: Optional[str] = None
    max_samples: Optional[int] = None  # None: the whole val split; else an evenly spaced fixed subset
    batch_size: Optional[int] = None  # None: eval.batch_size
    seed: int = 0
    fgsm: FGSMConfig = field(default_factory=FGSMConfig)
    pgd: PGDConfig = field(default_factory=PGDConfig)
    spsa: SPSAConfig = field(default_factory=SPSAConfig)
    autoattack: AutoAttackConfig = field(default_factory=AutoAttackConfig)


def paper_adversarial_config() -> AdversarialConfig:
    """QUEST Tables 3/4 as the Elliptical-attention code ran them (KurtPask/Elliptical-Attention @ 5ae39ee,
    ImageAttack/: engine.py, spsa.py, Scripts/run_{fgm,pgd,spsa,auto}.sh; docs/evaluation.md has the table): the
    normalised tensor, eps 1/255 (0.1 for SPSA) in normalised units, predicted labels except AutoAttack, the median
    estimator, SPSA's gradient where cleverhans' torch code estimates it."""
    cfg = AdversarialConfig(space="normalized", labels="paper", elliptical_estimator="median")
    cfg.spsa.estimate_at = "cleverhans_torch"
    return cfg


@dataclass
class EvalSettings:
    name: str = MISSING  # the suite's name (output folder, wandb run name)
    run: List[str] = MISSING  # evaluations to run, in order (quest.evaluation.runner.EVALUATIONS)
    use_ema: bool = False  # checkpoint mode: evaluate the EMA weights
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "fp32"  # fp32 | bf16 | fp16: autocast of the forward passes (attacks always run in fp32)
    batch_size: int = 128  # per process
    num_workers: int = 0
    torch_threads: Optional[int] = None  # None: torch's default
    # progress lines (quest.eval logger): first and last batch of each pass, every log_every_n-th batch (cell of a
    # corruption grid) when > 0, and whenever log_every_s seconds have passed since the last line when > 0
    log_every_n: int = 0
    log_every_s: float = 30.0
    crop_pct: Optional[float] = None  # None: the training recipe's (checkpoint) or timm's pretrained config
    interpolation: Optional[str] = None  # None: likewise
    roots: RootsConfig = field(default_factory=RootsConfig)
    imagenet_val: ImageNetValConfig = field(default_factory=ImageNetValConfig)
    imagenet_v2: ImageNetV2Config = field(default_factory=ImageNetV2Config)
    imagenet_real: ImageNetRealConfig = field(default_factory=ImageNetRealConfig)
    imagenet_a: ImageNetSubsetConfig = field(default_factory=ImageNetSubsetConfig)
    imagenet_r: ImageNetSubsetConfig = field(default_factory=ImageNetSubsetConfig)
    imagenet_c: ImageNetCConfig = field(default_factory=ImageNetCConfig)
    clean: CleanConfig = field(default_factory=CleanConfig)
    corruptions: CorruptionsConfig = field(default_factory=CorruptionsConfig)
    adversarial: AdversarialConfig = field(default_factory=AdversarialConfig)
    # the same evaluation with the authors' protocol as its defaults, so that a suite can report both side by side
    adversarial_paper: AdversarialConfig = field(default_factory=paper_adversarial_config)


@dataclass
class EvalConfig:
    checkpoint: Optional[str] = None  # a checkpoint written by train.py
    weights: Optional[str] = None  # model mode: a state_dict file (loaded with weights_only=True)
    model: EvalModelConfig = field(default_factory=EvalModelConfig)
    attention: EvalAttentionConfig = field(default_factory=EvalAttentionConfig)
    # data=<name> picks the data set of the clean / corruptions / adversarial evaluations; unset in checkpoint mode:
    # the checkpoint's own data config
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    eval: EvalSettings = field(default_factory=EvalSettings)


def _given(value: Any) -> bool:
    """A resolver argument that is set (interpolated nulls may arrive as None or as the text 'None' / 'null')."""
    return value not in (None, "None", "null", "")


def _truthy(value: Any) -> bool:
    return value is True or str(value).lower() == "true"


def evaluated_name(checkpoint: Any, use_ema: Any = False, weights: Any = None) -> str:
    """What is evaluated, as one path component: ``<checkpoint stem>-<model|ema>`` for a checkpoint (``last-ema``,
    ``best-model``), else the weights file's stem, or ``random-init`` without weights. It names the results
    directory, so evaluations of last.pt, best.pt and the EMA weights never overwrite each other."""
    if _given(checkpoint):
        return f"{Path(str(checkpoint)).stem}-{'ema' if _truthy(use_ema) else 'model'}"
    return Path(str(weights)).stem if _given(weights) else "random-init"


def default_eval_dir(checkpoint: Any, model_name: Any, attention_name: Any, suite: Any, use_ema: Any = False,
                     weights: Any = None) -> str:
    """``<training run>/eval/<suite>/<checkpoint stem>-<model|ema>`` for a checkpoint (results beside the run),
    else ``outputs/eval/<model>-<attention>/<suite>/<weights stem | random-init>``."""
    name = evaluated_name(checkpoint, use_ema, weights)
    if _given(checkpoint):
        parent = Path(str(checkpoint)).expanduser().parent
        run_dir = parent.parent if parent.name == "checkpoints" else parent
        return str(run_dir / "eval" / str(suite) / name)
    return f"outputs/eval/{model_name}-{attention_name}/{suite}/{name}"


def register_eval_configs() -> None:
    ConfigStore.instance().store(name="eval_schema", node=EvalConfig)
    if not OmegaConf.has_resolver("quest_eval_dir"):
        OmegaConf.register_new_resolver("quest_eval_dir", default_eval_dir)
