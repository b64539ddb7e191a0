"""eval.py's config but the sections of the registered evaluations: the keys every suite shares (the ``eval`` node's
own keys, :class:`EvalSettingsBase`), the nodes beside ``eval`` (:class:`EvalConfigBase`) and the name of what is
evaluated, which names the results directory (:func:`evaluated_name`, :func:`default_eval_dir`). A module below the
evaluations, so that registering one (quest.evaluation.kinds refuses a name like one of these keys) and loading the
model evaluated (quest.evaluation.target) need not import the schema that quest.evaluation.config builds from every
registered evaluation.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

from omegaconf import MISSING

from quest.config.checks import DEVICE, PRECISIONS, process_count
from quest.config.schema import SEED, AttentionConfig, DataConfig, LoggerConfig, ModelConfig
from quest.data.config import CROP_FRACTION
from quest.store.records import bounded, described, one_of

# the modes timm's eval transform accepts (timm.data.transforms.str_to_interp_mode), 'random' excluded: an eval
# transform must be deterministic
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")

# Every number of eval.* has an upper bound declared on its field, checked before any work: a typo's 10**20 fails at
# start naming the key, not mid-run ("Stop argument for islice() must be None or an integer") after the results
# directory was written. The declarations every section shares:
#: a batch of images per process (eval.batch_size, a section's batch_size, SPSA's max_batch_size)
BATCH_SIZE = bounded(1, 65536, **described("an integer in 1..65536 (images per process)"))
#: an evenly spaced subset of a split (max_samples); more than a split holds is the whole split
SAMPLE_COUNT = bounded(1, 2**31 - 1, **described("an integer in 1..2**31-1 (null: the whole split)"))
#: an attack's iterations or its samples per gradient estimate (PGD's steps, SPSA's nb_iter and nb_sample)
ITERATIONS = bounded(1, 100_000, **described("an integer in 1..100000"))
#: the seed of an evaluation's randomness: the one declaration of a seed, trainer.seed's (quest.config.schema.SEED)
EVAL_SEED = SEED

__all__ = ["INTERPOLATIONS", "BATCH_SIZE", "SAMPLE_COUNT", "ITERATIONS", "EVAL_SEED", "RootsConfig",
           "EvalSettingsBase", "RESERVED_KEYS", "EvalModelConfig", "EvalAttentionConfig",
           "EvalConfigBase", "evaluated_name", "default_eval_dir"]


@dataclass
class RootsConfig:
    """Folders of the ImageNet test sets (docs/evaluation.md): paths, checked by the evaluations that read them."""

    val: Optional[str] = None  # ImageNet val: <val>/<wnid>/<image>.JPEG (1000 wnid folders)
    v2: Optional[str] = None  # folder holding imagenetv2-<variant>-format-val/<0..999>/<image>.jpeg
    real: Optional[str] = None  # ILSVRC2012_val_*.JPEG (flat or in wnid folders); None: roots.val
    a: Optional[str] = None  # ImageNet-A: <a>/<wnid>/<image> (200 wnid folders)
    r: Optional[str] = None  # ImageNet-R: <r>/<wnid>/<image> (200 wnid folders)
    c: Optional[str] = None  # ImageNet-C: <c>/<corruption>/<severity>/<wnid>/<image>.JPEG


@dataclass
class EvalSettingsBase:
    """The keys every suite shares; eval_settings_schema() adds one section per registered evaluation."""

    name: str = MISSING  # the suite's name (output folder, wandb run name): a free name
    # evaluations to run, in order (quest.evaluation.registry): checked against that registry, which plugins fill
    run: List[str] = MISSING
    use_ema: bool = False  # checkpoint mode: evaluate the EMA weights
    device: str = field(default="auto", metadata=DEVICE)  # auto | cpu | cuda | cuda:N
    # autocast of the forward passes (attacks always run in fp32); fp16 needs CUDA (quest.evaluation.checks)
    precision: str = field(default="fp32", metadata=one_of(*PRECISIONS))
    batch_size: int = field(default=128, metadata=BATCH_SIZE)  # per process
    # DataLoader worker processes and intra-op threads, bounded as data.num_workers and trainer.torch_threads (a
    # typo's 10**12 workers forks until memory runs out)
    num_workers: int = field(default=0, metadata=process_count(0))
    torch_threads: Optional[int] = field(default=None, metadata=process_count())  # None: torch's default
    # progress lines (quest.eval logger): first and last batch of each pass, every log_every_n-th batch (cell of a
    # corruption grid) when > 0, and whenever log_every_s seconds have passed since the last line when > 0
    log_every_n: int = field(default=0, metadata=bounded(
        0, 2**31 - 1, **described("an integer in 0..2**31-1 (0: off)")))
    # seconds between progress lines (0: off)
    log_every_s: float = field(default=10.0, metadata=bounded(
        0, 86400, **described("in [0, 86400] seconds (0: off)")))
    # None: the training recipe's (checkpoint) or timm's pretrained config
    crop_pct: Optional[float] = field(default=None, metadata=CROP_FRACTION)
    interpolation: Optional[str] = field(default=None, metadata=one_of(*INTERPOLATIONS))  # None: likewise
    roots: RootsConfig = field(default_factory=RootsConfig)
    # the results directory holds results of other settings (or another checkpoint): move them to
    # .replaced/<time>/ and evaluate (without it, such a rerun is refused: results are never replaced silently)
    overwrite: bool = False


#: keys of the eval node itself, which no evaluation may take as its name
RESERVED_KEYS = frozenset(f.name for f in dataclasses.fields(EvalSettingsBase))


@dataclass
class EvalModelConfig(ModelConfig):
    """The model evaluated (model mode); a checkpoint names its own."""

    # Unset in checkpoint mode (the checkpoint names its model); model=<group or timm name> sets it otherwise.
    name: Optional[str] = None


@dataclass
class EvalAttentionConfig(AttentionConfig):
    """The attention of the model evaluated (model mode); a checkpoint names its own."""

    # No default: evaluating a timm model with the wrong attention would give silently wrong numbers.
    name: Optional[str] = None


@dataclass
class EvalConfigBase:
    """Everything but ``eval``, which eval_config_schema() adds, typed by the registry."""

    checkpoint: Optional[str] = None  # a checkpoint written by train.py
    # a checkpoint is data: an attention its config names by import path (package.module:Class) is imported only
    # with trust_code=true (or attention=<that path> on the command line), as Hugging Face's trust_remote_code
    trust_code: bool = False
    weights: Optional[str] = None  # model mode: a state_dict file (loaded with weights_only=True)
    model: EvalModelConfig = field(default_factory=EvalModelConfig)
    attention: EvalAttentionConfig = field(default_factory=EvalAttentionConfig)
    # data=<name> picks the data set of the clean / corruptions / adversarial evaluations; unset in checkpoint mode:
    # the checkpoint's own data config
    data: DataConfig = field(default_factory=DataConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


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
