"""The keys every evaluation suite shares (the ``eval`` node's own keys). A module of its own so that the registry
can refuse an evaluation named like one of them without importing the config schema that is built from it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional

from omegaconf import MISSING

__all__ = ["RootsConfig", "EvalSettingsBase", "RESERVED_KEYS"]


@dataclass
class RootsConfig:
    """Folders of the ImageNet test sets (docs/evaluation.md)."""

    val: Optional[str] = None  # ImageNet val: <val>/<wnid>/<image>.JPEG (1000 wnid folders)
    v2: Optional[str] = None  # folder holding imagenetv2-<variant>-format-val/<0..999>/<image>.jpeg
    real: Optional[str] = None  # ILSVRC2012_val_*.JPEG (flat or in wnid folders); None: roots.val
    a: Optional[str] = None  # ImageNet-A: <a>/<wnid>/<image> (200 wnid folders)
    r: Optional[str] = None  # ImageNet-R: <r>/<wnid>/<image> (200 wnid folders)
    c: Optional[str] = None  # ImageNet-C: <c>/<corruption>/<severity>/<wnid>/<image>.JPEG


@dataclass
class EvalSettingsBase:
    """The keys every suite shares; eval_settings_schema() adds one section per registered evaluation."""

    name: str = MISSING  # the suite's name (output folder, wandb run name)
    run: List[str] = MISSING  # evaluations to run, in order (quest.evaluation.registry)
    use_ema: bool = False  # checkpoint mode: evaluate the EMA weights
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    precision: str = "fp32"  # fp32 | bf16 | fp16: autocast of the forward passes (attacks always run in fp32)
    batch_size: int = 128  # per process
    num_workers: int = 0  # DataLoader worker processes
    torch_threads: Optional[int] = None  # None: torch's default
    # progress lines (quest.eval logger): first and last batch of each pass, every log_every_n-th batch (cell of a
    # corruption grid) when > 0, and whenever log_every_s seconds have passed since the last line when > 0
    log_every_n: int = 0
    log_every_s: float = 30.0  # seconds between progress lines (0: off)
    crop_pct: Optional[float] = None  # None: the training recipe's (checkpoint) or timm's pretrained config
    interpolation: Optional[str] = None  # None: likewise
    roots: RootsConfig = field(default_factory=RootsConfig)
    # the results directory holds results of other settings (or another checkpoint): move them to
    # .replaced/<time>/ and evaluate (without it, such a rerun is refused: results are never replaced silently)
    overwrite: bool = False


#: keys of the eval node itself, which no evaluation may take as its name
RESERVED_KEYS = frozenset(f.name for f in dataclasses.fields(EvalSettingsBase))
