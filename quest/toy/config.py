"""Typed config of the toy study (configs/toy/toy.yaml), registered in Hydra's ConfigStore as ``toy_schema``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from hydra.core.config_store import ConfigStore

from .data import ToyDataConfig

__all__ = ["GridConfig", "ToyModelConfig", "ToyTrainConfig", "OutcomeRules", "PaperOutcomeRules", "VariantConfig",
           "StopRule", "StudyConfig", "ToyConfig", "register_toy_config"]


@dataclass
class GridConfig:
    name: str = "full"
    lrs: List[float] = field(default_factory=list)
    weight_decays: List[float] = field(default_factory=list)
    data_seeds: List[int] = field(default_factory=list)
    init_seeds: List[int] = field(default_factory=list)


@dataclass
class ToyModelConfig:
    mlp_hidden: int = 20  # A.3: the MLP hidden layer has the embedding width
    embed_init_std: float = 0.02  # positional embedding ~ truncated N(0, std) as in timm's ViT; [CLS] starts at 0


@dataclass
class ToyTrainConfig:
    epochs: int = 50
    batch_size: int = 32
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # torch.optim.AdamW defaults
    eps: float = 1e-8


@dataclass
class OutcomeRules:
    """This project's partition of runs into the paper's outcomes (fractions; chance is 1 / num_classes = 0.1).

    correct: train and test >= correct_min (paper: both > 90%). degenerate: train <= degenerate_train_max and test
    <= degenerate_test_max (paper: "both at random chance"; a run that memorised a few training samples, train
    0.2-0.3, still counts). biased: train >= biased_train_min and test <= biased_test_max (paper: train 50-80%, test
    20-40%, the gap coming from the shortcut b that the test set lacks). Anything else is "other". Outcomes are
    derived from the stored accuracies whenever results are aggregated, so changing a rule needs no retraining.
    """

    correct_min: float = 0.9
    degenerate_train_max: float = 0.3
    degenerate_test_max: float = 0.2
    biased_train_min: float = 0.45
    biased_test_max: float = 0.45


@dataclass
class PaperOutcomeRules:
    """The paper's own ranges (section 2.2, A.4), reported beside :class:`OutcomeRules`; they leave gaps ("other").

    correct: train and test > 90%. biased: train 50-80% and test 20-40%. degenerate: "both training and test
    accuracy are random chance", read as both <= chance_max (chance 10%; 15% is 5 standard errors of a 1,024-sample
    test accuracy above it).
    """

    correct_above: float = 0.9
    biased_train: List[float] = field(default_factory=lambda: [0.5, 0.8])
    biased_test: List[float] = field(default_factory=lambda: [0.2, 0.4])
    chance_max: float = 0.15


@dataclass
class VariantConfig:
    """A formulation with some of its parameters set or frozen, e.g. QKNorm with its scale fixed at 1 / sqrt(d):
    ``{attention: qknorm, param_init: {attn.qk_scale: 0.2236}, frozen: [attn.qk_scale]}``. Usable wherever an
    attention name is (``attentions``, ``study.scale_variants``)."""

    attention: str = "???"
    param_init: Dict[str, float] = field(default_factory=dict)  # parameter name -> constant it starts at
    frozen: List[str] = field(default_factory=list)  # parameters never updated (no gradient step, no weight decay)
    label: str = ""  # how figures and tables name it


@dataclass
class StopRule:
    """When the success rates have stopped changing with the training-set size (fixed before the sensitivity run,
    docs/results.md): the smallest size n such that, for every formulation of ``cfg.attentions``, the success rate at
    the next size up differs from that at n by at most ``min_points`` percentage points or by at most ``z`` standard
    errors of the difference of two binomial proportions (pooled), i.e. within the noise of the runs measured."""

    min_points: float = 5.0
    z: float = 2.0


@dataclass
class StudyConfig:
    """``grid``: train ``grid`` for every formulation (the paper's study). ``sensitivity``: train ``grid`` (a reduced
    one) for every formulation and training-set size in ``train_sizes``, evaluate on test sets with every biased
    fraction in ``test_biased_fractions``, compare QKNorm's scale choices ``scale_variants`` and both outcome rule
    sets; one CSV, one figure, and the training-set size :class:`StopRule` picks."""

    name: str = "grid"
    train_sizes: List[int] = field(default_factory=list)
    test_biased_fractions: List[float] = field(default_factory=list)
    scale_variants: List[str] = field(default_factory=list)
    stop: StopRule = field(default_factory=StopRule)


@dataclass
class ToyConfig:
    grid: GridConfig = field(default_factory=GridConfig)
    data: ToyDataConfig = field(default_factory=ToyDataConfig)
    model: ToyModelConfig = field(default_factory=ToyModelConfig)
    train: ToyTrainConfig = field(default_factory=ToyTrainConfig)
    outcome: OutcomeRules = field(default_factory=OutcomeRules)
    paper_outcome: PaperOutcomeRules = field(default_factory=PaperOutcomeRules)
    study: StudyConfig = field(default_factory=StudyConfig)
    variants: Dict[str, VariantConfig] = field(default_factory=dict)
    attentions: List[str] = field(default_factory=list)
    compile: bool = True  # torch.compile the training step (forward, backward, AdamW) of each tile of runs
    # where the runs train: auto (the CPU, with a process per core, also on a GPU machine: these models are too small
    # for a GPU to pay; quest.toy.compiled.resolve_toy_device), cpu, cuda, cuda:1, ...
    device: str = "auto"
    # Worker processes training chunks side by side, each with `threads` threads; None: one per CPU core on a CPU
    # (processes scale better than threads for these small kernels, and do not stall when the cores are shared),
    # 1 on a GPU.
    workers: Optional[int] = None
    threads: Optional[int] = None  # torch intra-op threads per worker; None: 1 with several workers, else torch's
    runs_per_call: Optional[int] = None  # runs per compiled call; None: 50 on a CPU (cache-sized), all on a GPU
    probe_size: int = 256  # training samples whose key norms are recorded after every epoch (Figure 4); 0: none
    out_dir: Optional[str] = None  # None: Hydra's run directory


def register_toy_config() -> None:
    ConfigStore.instance().store(name="toy_schema", node=ToyConfig)
